"""`llmplan eval` on the bundled SmolLM2: what each precision costs in quality, against fp32.

One evaluation (2 chunks of 128 tokens of Python's pydoc_data topics, so 128 scored tokens) of the fp32
plan at every weight dtype and one KV cache dtype. What must hold:
- fp32 against itself: KL exactly 0, agreement 1, no drift (the same weights through the same code);
- the ordering the formats imply: bf16 and fp16 (16-bit weights) diverge less than int8, int8 less than
  int4 (the figures are printed by the test);
- perplexity of the fp32 plan equals transformers' over the same tokens within 0.1 % (fp32 sums in another
  order move each log-probability by ~1e-6; 0.1 % of the perplexity is ~1e-3 of the mean NLL).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from llmplan.commands.eval import default_text, evaluate, markdown, read_text
from llmplan.engine.cli import CliError, build_parser
from llmplan.llm.evaluation import quality
from llmplan.llm.text import Tokenizer

from .conftest import PLANS

CONTEXT, CHUNKS = 128, 2


@pytest.fixture(scope="module")
def report(smollm2_dir: Path) -> dict[str, Any]:
    argv = [
        "eval", str(PLANS / "llama-fp32.yaml"), "--dtypes", "bf16,fp16,int8,int4", "--kv-dtypes", "bf16",
        "--context", str(CONTEXT), "--chunks", str(CHUNKS), "--prompts", "1", "--greedy", "8", "--format", "json",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    return evaluate(args, default_text(), "pydoc_data")


def rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["change"] or "as written": row for row in report["plans"]}


def test_fp32_against_itself_is_exact(report: dict[str, Any]) -> None:
    same = rows(report)["as written"]
    assert same["weights"] == "fp32" and same["kl_mean"] == 0.0 and same["kl_p99"] == 0.0
    assert same["top1_agreement"] == 1.0 and same["same_token_rate"] == 1.0
    assert all(d == 0.0 for d in same["layer_drift"]) and len(same["layer_drift"]) == 30
    assert same["perplexity"] == report["reference"]["perplexity"]


def test_divergence_follows_the_formats(report: dict[str, Any]) -> None:
    by = {name: row["kl_mean"] for name, row in rows(report).items()}
    print({name: (f"{kl:.3g}", rows(report)[name]["perplexity"]) for name, kl in by.items()})
    assert 0 < by["weights fp16"] < by["weights int8"] and 0 < by["weights bf16"] < by["weights int8"]
    assert by["weights int8"] < by["weights int4"]
    assert 0 < by["kv bf16"] < by["weights int8"]  # a 16-bit cache rounds K and V only
    for row in report["plans"]:
        assert row["tokens_scored"] == CHUNKS * CONTEXT // 2 and row["kl_p99"] >= row["kl_mean"]
        assert 0 < row["top1_agreement"] <= 1 and not math.isnan(row["perplexity"])
    int4, int8 = rows(report)["weights int4"], rows(report)["weights int8"]
    assert int4["perplexity"] > report["reference"]["perplexity"] and min(int8["layer_drift"]) > 0
    # The bundled GGUF is Q4_1 (groups of 32, d*q + m): its blocks' weights are exactly int4 codes with a scale
    # and zero per group, so re-quantizing the blocks to int4 loses nothing; only the head (stored in more bits
    # in the GGUF) is rounded. The drift says so: none at any block's output.
    assert all(d == 0.0 for d in int4["layer_drift"])


def test_perplexity_equals_transformers(report: dict[str, Any], smollm2_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()
    ids = Tokenizer.from_dir(smollm2_dir).encode(default_text(), add_bos=False, special=False)
    nll, count = 0.0, 0
    for chunk in quality.chunks(ids, CONTEXT, CHUNKS):
        start = quality.first_scored(CONTEXT)
        with torch.inference_mode():
            logits = hf(torch.tensor([chunk])).logits[0, start:-1].float()
        targets = torch.tensor(chunk[start + 1 :])
        nll -= float(torch.log_softmax(logits, -1).gather(1, targets[:, None]).double().sum())
        count += len(targets)
    theirs = math.exp(nll / count)
    ours = report["reference"]["perplexity"]
    assert report["reference"]["tokens_scored"] == count
    assert abs(ours / theirs - 1) < 1e-3, (ours, theirs)


def test_markdown_names_every_row(report: dict[str, Any]) -> None:
    table = markdown(report)
    for change in ("weights int4", "weights bf16", "kv bf16"):
        assert f"llama-fp32 ({change})" in table
    assert "| llama-fp32 | fp32 |" in table


def test_a_text_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "latin1.txt"
    binary.write_bytes(b"caf\xe9")
    for path, said in ((tmp_path / "missing.txt", "file not found"), (binary, "not UTF-8 text (byte 3)")):
        with pytest.raises(CliError) as refused:
            read_text(str(path))
        assert str(refused.value) == f"{path}: {said}"
