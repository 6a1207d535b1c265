"""`load.convert` dtype `stored`: a GGUF's own blocks mapped from the file, through `llmplan run`.

The tiny GGUF (tests/llm/tiny_gguf.py: Qwen2, Q4_K/Q6_K linears, a tied Q8_0 table) runs the fp32 plan twice:
as the plan says (the fp32 import) and with `convert.dtype=stored`. Greedy tokens must be equal up to the first
near tie: the mapped model's products round activations to int8 per 32 columns (tests/llm/test_gguf_stored.py
measures what that moves: about 2 % of the logit range here), so a divergence is allowed only where the fp32
run's top-2 logprob margin was under 0.2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmplan.engine.cli import main
from tests.llm.tiny_gguf import write_tiny_model
from tests.stages.tiny_run import make_tiny_model_dir
from tests.trust.checkpoints import private_cache_home

PLAN = str(Path(__file__).resolve().parents[2] / "plans" / "llama-fp32.yaml")
COMMON = ["--set", "generate.max_new_tokens=8", "--set", "lookup.mode=off", "--prompt", "the the"]


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from private_cache_home(tmp_path_factory.mktemp("llmplan-cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    write_tiny_model(str(path), arch="qwen2", tied=True, embed="Q8_0")
    return path


def _run(model: Path, out: Path, *extra: str) -> tuple[int, dict]:
    code = main(["run", PLAN, "--model", str(model), *COMMON, "--out", str(out), *extra])
    return code, json.loads((out / "generations.json").read_text())[0] if code == 0 else {}


def test_stored_answers_with_the_fp32_plans_tokens(
    tiny: Path, cache_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, fp32 = _run(tiny, tmp_path / "fp32")
    assert code == 0
    capsys.readouterr()
    code, stored = _run(tiny, tmp_path / "stored", "--set", "convert.dtype=stored")
    said = capsys.readouterr().err
    assert code == 0, said
    assert "tiny-qwen2.gguf: mapped, 0.8 MiB of Q4_K/Q6_K/Q8_0" in said
    assert stored["text"]
    for i, (a, b) in enumerate(zip(fp32["tokens"], stored["tokens"], strict=True)):
        if a != b:
            first, second = fp32["alternatives"][i][:2]
            assert first[1] - second[1] < 0.2, (i, fp32["tokens"], stored["tokens"])
            break
    metrics = json.loads((tmp_path / "stored" / "metrics.json").read_text())
    assert metrics["convert"]["dtype"] == "stored"
    assert set(metrics["convert"]["stored_types"]) == {"Q4_K", "Q6_K", "Q8_0"}
    kernels = metrics["place"]["linear_kernels"]
    assert all("gguf" in path for path in kernels), kernels
    resident = metrics["place"]["resident_weights"]
    assert resident["head_shares_embeddings"] and resident["parts"]["matrices"]["as"] == "Q4_K/Q6_K"


def test_stored_needs_a_gguf_source(cache_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir, _ = make_tiny_model_dir(tmp_path / "hf")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    code = main(["run", PLAN, "--model", str(model_dir), *COMMON, "--set", "convert.dtype=stored"])
    said = capsys.readouterr().err
    assert code != 0 and "dtype stored keeps a GGUF's own blocks" in said and "Traceback" not in said, said
