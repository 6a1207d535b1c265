"""The transformers baseline of `llmplan bench --vs transformers` (a bench/test dependency, imported lazily).

Same weights (the HF-format directory the plan loaded from), fp32, eager, in this process and thread count.
Timed like llmplan: one forward over the prompts (the head on the last position only), then one forward
per generated token with the DynamicCache, greedy argmax. That is what `generate()` does minus its
logits processors, so the baseline is, if anything, slightly flattered.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmplan.engine.cli import CliError


def load_transformers(model_dir: Path) -> tuple[Any, float]:
    """(model, load seconds) from the HF-format directory, fp32, eval mode."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise CliError("--vs transformers needs the `transformers` package (pip install transformers)") from None
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, time.perf_counter() - start


def hf_run_once(model: Any, prompts: list[list[int]], gen_tokens: int) -> dict[str, Any]:
    """Prefill + (gen_tokens - 1) cached decode steps, greedy; the same figures as `measure.run_once`."""
    from transformers import DynamicCache

    ids = torch.tensor(prompts)
    batch, width = ids.shape
    # transformers 5 renamed `past_key_values` to `cache` (the old name warns); use what this version takes
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens: list[Tensor] = []
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: DynamicCache()})
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        first = time.perf_counter()
        for _ in range(gen_tokens - 1):
            out = model(input_ids=nxt, use_cache=True, **{key: getattr(out, key)})
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
        end = time.perf_counter()
    steps = gen_tokens - 1
    prefill = first - start
    return {
        "prefill_s": prefill,
        "prefill_tok_s": batch * width / prefill,
        "ttft_s": prefill,
        "decode_tok_s": batch * steps / (end - first) if steps else None,
        "decode_ms_per_step": 1000 * (end - first) / steps if steps else None,
        "peak_device_bytes": None,
        "tokens": torch.cat(tokens, dim=1).tolist(),
    }
