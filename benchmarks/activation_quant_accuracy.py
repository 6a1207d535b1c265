"""Would int8 activations (for VNNI int8 dot products) keep the accuracy of the weight-only int8/int4 plans?

    .venv/bin/python benchmarks/activation_quant_accuracy.py [int8,int4]

Simulates symmetric int8 activation quantization (scale = absmax / 127 per row, or per block of B columns
as llama.cpp's Q8_0 does with B = 32) at the input of every linear layer of the bundled SmolLM2-135M, and
measures what tests/pipeline/test_smollm2_precisions.py measures: the relative logit error against our fp32
model (which equals transformers) and the top-1 agreement, over every position of two chat prompts.
The result decides issue #16's "VNNI on quantized activations only where accuracy holds": see
benchmarks/activation_quant_accuracy.md.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmplan.llm.model import HEAD_NAME, LINEAR_NAMES
from llmplan.llm.text import Tokenizer
from tests.pipeline.conftest import PLANS, run_plan

TEXTS = [
    "Explain how a transformer language model generates text, step by step.",
    "Write a short poem about the sea and the wind, then translate it to French.",
]
BLOCKS: list[int | None] = [None, 0, 192, 64, 32]  # None: weights only (today); 0: one scale per row


def quantize_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """x with its last dim quantized to int8 per `block` columns (0: the whole row) and back to float."""
    k = x.shape[-1]
    b = k if block == 0 else block
    xb = x.reshape(-1, k // b, b)
    s = xb.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (torch.round(xb / s).clamp(-127, 127) * s).reshape(x.shape)


def logits(model: torch.nn.Module, tok: Tokenizer) -> list[torch.Tensor]:
    out = []
    for text in TEXTS:
        ids = torch.tensor([tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))])
        with torch.inference_mode():
            out.append(model(ids, torch.arange(ids.shape[1])[None]).float())
    return out


def main() -> None:
    dtypes = (sys.argv[1] if len(sys.argv) > 1 else "int8,int4").split(",")
    tmp = Path(tempfile.mkdtemp())
    ref = run_plan(PLANS / "llama-fp32.yaml", tmp / "fp32", until="place")
    tok = Tokenizer.from_dir(Path(ref.context.model_source.model_dir))
    expected = logits(ref.context.model, tok)
    print("| weights | activations | relative logit error | top-1 agreement |\n|---|---|---:|---:|")
    for dtype in dtypes:
        loaded = run_plan(PLANS / "llama-fp32.yaml", tmp / dtype, [f"convert.dtype={dtype}"], until="place")
        model = loaded.context.model
        layers = [m for name, m in model.named_modules() if name.endswith(LINEAR_NAMES) or name == HEAD_NAME]
        for block in BLOCKS:
            hooks = [
                m.register_forward_pre_hook(lambda _m, args, b=block: (quantize_rows(args[0], b),))
                for m in (layers if block is not None else [])
            ]
            got = logits(model, tok)
            for hook in hooks:
                hook.remove()
            err = sum(float((g - e).norm() / e.norm()) for g, e in zip(got, expected, strict=True)) / len(got)
            pairs = zip(got, expected, strict=True)
            agree = sum(float((g.argmax(-1) == e.argmax(-1)).float().mean()) for g, e in pairs)
            what = "fp32 (weight-only)" if block is None else f"int8 per {'row' if block == 0 else f'{block} cols'}"
            print(f"| {dtype} | {what} | {err:.4f} | {agree / len(got):.3f} |", flush=True)


if __name__ == "__main__":
    main()
