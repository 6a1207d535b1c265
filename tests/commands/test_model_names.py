"""Issue 57: a model is named as its user knows it, in `history`, `show` and `/v1/models`: a GGUF by its file's
stem (not the plan's name, not a hash, not its `general.name`, which for a Q4_K_M may say "AWQ"), an HF directory
by its name, a Hub cache snapshot by its repository."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from llmplan.commands.serve.app import ServerSettings
from llmplan.engine.cli import main
from llmplan.stages.types import ModelSource
from tests.commands.conftest import LiveServer, write_serve_plan
from tests.llm.tiny_gguf import write_tiny_model
from tests.trust.checkpoints import private_cache_home

PLANS = Path(__file__).resolve().parents[2] / "plans"
QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"
AWQ = "Qwen2.5 Coder 0.5B Instruct AWQ"  # the general.name the real Q4_K_M file carries


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Path]:
    yield from private_cache_home(tmp_path / "llmplan-cache")


@pytest.fixture
def qwen(tmp_path: Path, cache: Path) -> Path:
    path = tmp_path / "models" / f"{QWEN}.gguf"
    path.parent.mkdir()
    write_tiny_model(str(path), arch="qwen2", tied=True, embed="Q8_0", name=AWQ)
    return path


def test_history_and_show_name_the_model_a_model_run_ran(
    qwen: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    plan = str(PLANS / "llama-fp32.yaml")
    run = ["run", plan, "--model", str(qwen), "--set", "generate.max_new_tokens=4", "--prompt", "the the"]
    assert main([*run, "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["history", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["plan"] == "llama-fp32" and row["model"] == QWEN  # the model run, beside the plan that ran it
    assert main(["history"]) == 0
    listed = capsys.readouterr().out
    assert QWEN in listed and row["model_fingerprint"][:8] not in listed
    assert main(["show", str(row["id"])]) == 0
    assert f"model {QWEN}  ·  files {row['model_fingerprint']}" in capsys.readouterr().out


def test_models_lists_a_gguf_by_its_file_name_with_its_own_name_an_alias(qwen: Path, tmp_path: Path) -> None:
    plan = write_serve_plan(tmp_path, qwen, name="qwen-tiny")
    with LiveServer(plan, ServerSettings()) as live:
        client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [QWEN]
        assert client.models.retrieve(QWEN).id == QWEN
        entry = httpx.get(f"{live.url}/models", timeout=10).json()["data"][0]
    assert (entry["llmplan"]["plan"], entry["llmplan"]["aliases"]) == ("qwen-tiny", [AWQ, "qwen-tiny"])


def test_a_hub_snapshot_is_named_by_its_repository_and_a_folder_by_its_name(tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "0123abcd"
    assert ModelSource(snapshot, "hf-dir", "fp").name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ModelSource(tmp_path / "my-llama", "hf-dir", "fp").name == "my-llama"
    imported = ModelSource(tmp_path / "b179c9523d0e6a0f-f2-x", "gguf", "fp", gguf_file=tmp_path / f"{QWEN}.gguf")
    assert imported.name == QWEN
