"""The three real models run as stored (their own blocks, mapped) against their fp32 import (slow; opt-in).

Opt-in as tests/llm/test_gguf_real.py (`make test-real`, LLMPLAN_REAL_MODELS=1, the files where the plans'
first use left them). The fp32 import holds the file's exact values (gguf-py's dequantization), so what is
measured here is only what the block kernels' arithmetic costs: rounding each product's input per 32 columns
(activation_bits, as each model's stored plan sets it) and the summation order. For each model:

* quality on `llmplan eval`'s default text (8 chunks of 512 tokens of pydoc_data, its reference the same plan in
  fp32): KL mean from the fp32 logits <= 1e-3 and perplexity within 0.3 % (the plan as shipped, through the CLI);
* greedy: 4 prompts x 128 steps of the fp32 import's greedy path; at each step the stored model's argmax (on the
  fused native pass, the backend `run` takes) is the import's token, unless the import's top-two margin there
  is within twice the stored logits' measured distance at that position (a near-tie the arithmetic can flip:
  printed with its margin, and that prompt ends there).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from tiny import load_tiny

from llmplan.cache_home import cache_home
from llmplan.llm.formats.gguf import import_gguf, map_gguf
from llmplan.llm.formats.gguf.stored import stored_weights
from llmplan.llm.generation import ModelRunner, generate
from llmplan.llm.generation.flat_batch import FlatBatch, Part
from llmplan.llm.kernels import native
from llmplan.llm.kv import KVCache, SlotCache
from llmplan.llm.model import Transformer, make_linear
from llmplan.llm.sampling import Pick
from llmplan.llm.text import Tokenizer
from llmplan.stages.model_source import default_cache_dir

if os.environ.get("LLMPLAN_REAL_MODELS") != "1":
    pytest.skip("real-model checks are opt-in: make test-real", allow_module_level=True)
if native.kernels() is None:
    pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PLANS = ["plans/gemma3-270m-stored.yaml", "plans/qwen2.5-0.5b-stored.yaml", "plans/qwen2.5-1.5b-chat.yaml"]
KL_LIMIT = 1e-3
PPL_LIMIT = 0.3  # percent
STEPS = 128
PROMPTS = [
    "The history of the printing press",
    "def quicksort(items):\n    ",
    "Water is made of",
    "Once upon a time, in a small village,",
]


def _plan_facts(plan: str) -> tuple[Path, int]:
    """The plan's GGUF (its pieces joined in the downloads cache) and its activation_bits."""
    stages = yaml.safe_load((ROOT / plan).read_text())["stages"]
    pieces = next(s for s in stages if s["uses"] == "model.source")["with"]["pieces"]
    convert = next(s for s in stages if s["uses"] == "load.convert").get("with", {})
    path = cache_home() / "downloads" / pieces["sha256"][:16] / pieces["name"]
    return path, int(convert.get("activation_bits", 8))


@pytest.fixture(scope="module", params=PLANS)
def plan(request: pytest.FixtureRequest) -> dict[str, Any]:
    path, bits = _plan_facts(request.param)
    if not path.is_file():
        pytest.skip(f"{path} is not there (make test-real fetches it)")
    return {"plan": request.param, "path": path, "bits": bits}


def test_quality_on_evals_text_is_the_files(plan: dict[str, Any]) -> None:
    cmd = [sys.executable, "-m", "llmplan", "eval", plan["plan"], "--format", "json", "--no-store"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    ref, row = report["reference"], report["plans"][0]
    delta = (row["perplexity"] / ref["perplexity"] - 1) * 100
    print(f"\n{plan['plan']}: KL mean {row['kl_mean']:.3g}, ppl {row['perplexity']:.5g} vs {ref['perplexity']:.5g} "
          f"({delta:+.3f} %), top-1 {row['top1_agreement']:.4f}, activations {row['activations']}")
    assert row["weights"] == "stored"
    assert row["kl_mean"] <= KL_LIMIT
    assert abs(delta) <= PPL_LIMIT


def _logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """Every position's logits on the fused native pass, the sequence as one chunk."""
    cache = SlotCache.for_model(model, 1, len(ids), chunk=len(ids))
    runner = ModelRunner(model, cache)
    assert runner.backend == "native"
    with torch.inference_mode():
        cache.claim([0], [ids])
        return runner.forward(FlatBatch([Part(0, 0, ids, len(ids))]), cache)


def _greedy(logits: torch.Tensor, seen: list[int]) -> Pick:
    token = int(logits.argmax())
    return Pick(token=token, logprob=float(logits.log_softmax(-1)[token]))


def _greedy_path(model: Transformer, ids: list[int]) -> list[int]:
    """The model's own greedy continuation (prefill, then a decode step a token, EOS ignored)."""
    cache = KVCache.for_model(model, 1, len(ids) + STEPS + 1)
    runner = ModelRunner(model, cache)
    gens = generate(model, cache, [ids], pickers=[_greedy], max_new_tokens=STEPS, eos_ids=set(), pad_id=0,
                    runner=runner)
    return list(gens[0].tokens)


def test_greedy_steps_are_the_fp32_imports(plan: dict[str, Any]) -> None:
    folder = import_gguf(plan["path"], default_cache_dir())
    tok = Tokenizer.from_dir(folder)
    reference = load_tiny(folder)
    cfg, weights = stored_weights(map_gguf(plan["path"]))
    factory = functools.partial(make_linear, activation_bits=plan["bits"])
    stored = Transformer.from_weights(cfg, weights, linear_factory=factory, device="cpu")
    agreed, ties = 0, []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        path = _greedy_path(reference, ids)
        want, got = _logits(reference, ids + path), _logits(stored, ids + path)
        for step, token in enumerate(path):
            row = len(ids) - 1 + step
            top = want[row].topk(2)
            if int(got[row].argmax()) != token:
                room = 2 * float((got[row] - want[row]).abs().max())
                margin = float(top.values[0] - top.values[1])
                assert margin <= room, f"{prompt!r} step {step}: margin {margin:.4f} > 2 x distance ({room:.4f})"
                ties.append(f"{prompt!r} step {step}: margin {margin:.4f} within {room:.4f}")
                break
            agreed += 1
    print(f"\n{plan['plan']}: greedy steps identical {agreed}/{len(PROMPTS) * STEPS}; ties: {ties or 'none'}")
