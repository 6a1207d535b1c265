"""Quantized and half-precision plans on the bundled SmolLM2, measured against our fp32 model.

Our fp32 model equals transformers' (test_smollm2_oracle.py), so it is the reference here. One chat
prompt of ~40 tokens; every position's logits are compared. Bounds are the measured values with
headroom (measured on this machine: bf16 0.0057 / 100%, fp16 0.0008 / 100%, int8 0.042 / 97.7%, int4
0.058 / 93.0%). bf16 and fp16 round only the weights: on the CPU the activations stay fp32 (they were bf16
before, at 0.025 / 97.7%); the bounds leave room for the torch fallback without native kernels, whose
fbgemm path also keeps fp32 activations.
- relative logit error ||ours - fp32|| / ||fp32||,
- top-1 agreement: the fraction of positions whose argmax equals fp32's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmplan.llm.tokenizer import Tokenizer

from .conftest import PLANS, run_plan

BOUNDS = {"bf16": (0.02, 0.97), "fp16": (0.005, 0.97), "int8": (0.06, 0.95), "int4": (0.09, 0.88)}


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    result = run_plan(PLANS / "llama-fp32.yaml", tmp_path_factory.mktemp("fp32"), until="place")
    assert result.exit_code == 0, result.message
    tok = Tokenizer.from_dir(smollm2_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Explain how a transformer language model generates text, step by step."}]
    )
    ids = torch.tensor([tok.encode(text)])
    positions = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        logits = result.context.model(ids, positions).float()
    return ids, positions, logits


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_precision_stays_close_to_fp32(dtype: str, reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ids, positions, expected = reference
    result = run_plan(PLANS / "llama-fp32.yaml", tmp_path, [f"convert.dtype={dtype}"], until="place")
    assert result.exit_code == 0, result.message
    with torch.inference_mode():
        logits = result.context.model(ids, positions).float()
    error = float((logits - expected).norm() / expected.norm())
    agree = float((logits.argmax(-1) == expected.argmax(-1)).float().mean())
    max_error, min_agree = BOUNDS[dtype]
    assert error < max_error and agree > min_agree, f"{dtype}: error {error:.3f}, top-1 agreement {agree:.3f}"
