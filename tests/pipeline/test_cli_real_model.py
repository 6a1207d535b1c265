"""CLI commands on the bundled model: tokenize both ways, validate --deep, run --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmplan.engine.cli import main

from .conftest import PLANS


def test_tokenize_both_directions(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = str(PLANS / "llama-int8.yaml")
    assert main(["tokenize", plan, "介绍 2024 🦙", "--json"]) == 0
    encoded = json.loads(capsys.readouterr().out)
    # SmolLM2's pre-tokenizer splits digits one by one before the byte-level step (tokenizer.ggml.pre=smollm)
    assert [t for t in encoded["tokens"] if t.isdigit()] == ["2", "0", "2", "4"]
    assert main(["tokenize", plan, "--decode", ",".join(map(str, encoded["ids"])), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "介绍 2024 🦙"


def test_tokenize_rejects_bad_ids(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenize", str(PLANS / "llama-int8.yaml"), "--decode", "1,x"]) == 1
    assert capsys.readouterr().err.strip() == "--decode: expected comma-separated integers (got '1,x')"


def test_validate_deep_checks_files_and_prints_the_memory_estimate(
    smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", "--deep", "--format", "json", str(PLANS / "llama-int8.yaml")]) == 0
    report = json.loads(capsys.readouterr().out)
    estimate = report["estimates"][str(PLANS / "llama-int8.yaml")]
    # int8 linears (106M weights + scales) + fp32 embeddings and norms (28.3M) ~ 240 MB; KV 2048 tokens fp32 94 MB
    assert 200e6 < estimate["weights"] < 280e6
    # and each slot's validity (bool) and position (int64) per token, and its next position
    assert estimate["kv_cache"] == 2 * 30 * 3 * 64 * 4 * 2048 + 2048 * (1 + 8) + 8


def test_validate_deep_refuses_a_plan_that_does_not_fit(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "validate",
            "--deep",
            str(PLANS / "llama-fp32.yaml"),
            "--set",
            "place.max_batch=4096",
            "--set",
            "place.kv_cache.max_tokens=8192",
        ]
    )
    assert code == 1
    out = capsys.readouterr().out
    assert "does not fit available host memory" in out and "llama-fp32.yaml:" in out


def test_validate_deep_refuses_cuda_without_a_gpu(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["validate", "--deep", str(PLANS / "llama-int8.yaml"), "--set", "device=cuda"]) == 1
    assert "device: 'cuda' was asked for, but this machine has no CUDA device" in capsys.readouterr().out


def test_run_json_prints_only_json_lines(smollm2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "run",
            str(PLANS / "llama-fp32.yaml"),
            "--json",
            "--quiet",
            "--prompt",
            "Say hi.",
            "--set",
            "generate.max_new_tokens=6",
            "--set",
            f"lookup.db={tmp_path / 'r.sqlite'}",
            "--set",
            f"store.db={tmp_path / 'r.sqlite'}",
            "--set",
            f"write.to=[{{json: {tmp_path / 'out.json'}}}]",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["id"] == "prompt" and result["usage"]["completion_tokens"] == len(result["tokens"]) <= 6
    assert (result["finish_reason"], result["finish_detail"]) in (("stop", "eos"), ("length", "length"))
    assert set(result["timings"]) >= {"load_s", "ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s"}
