"""Issue 56 for a plan: a format that only the model's tokenizer shows cannot be kept (a literal spelling the
end token) is a `validate --deep` finding at the format's line, and refused when `run` starts; its benign twin
validates and runs to a complete answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmplan.engine.cli import main

from .tiny_run import make_tiny_model_dir, write_plan


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    made, _ = make_tiny_model_dir(tmp_path_factory.mktemp("format-model"), n_layers=1)
    return made


def _plan(tmp_path: Path, model_dir: Path, regex: str) -> Path:
    generate = {"format": {"regex": regex}, "ignore_eos": False, "max_new_tokens": 8}
    return write_plan(tmp_path, model_dir, generate=generate, name="shape")


def test_validate_deep_finds_a_format_that_spells_the_end_token(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _plan(tmp_path, model_dir, "abc</s>")
    assert main(["validate", str(plan)]) == 0  # no tokenizer: nothing to see yet
    capsys.readouterr()
    assert main(["validate", "--deep", str(plan)]) == 1
    out = capsys.readouterr()
    said = out.out + out.err
    line = next(i for i, text in enumerate(plan.read_text().splitlines(), 1) if "abc</s>" in text)
    assert f"{plan}:{line}:" in said and "end token" in said, said
    twin = _plan(tmp_path, model_dir, "abc")
    assert main(["validate", "--deep", str(twin)]) == 0, capsys.readouterr().err


def test_run_refuses_it_at_the_start_and_runs_the_twin(tmp_path: Path, model_dir: Path) -> None:
    plan = _plan(tmp_path, model_dir, "abc</s>")
    assert main(["run", str(plan), "--out", str(tmp_path / "bad"), "--quiet"]) != 0
    assert "end token" in (tmp_path / "bad" / "run.json").read_text()
    assert not (tmp_path / "bad" / "generations.json").exists()  # refused before any token
    twin = _plan(tmp_path, model_dir, "abc")
    assert main(["run", str(twin), "--out", str(tmp_path / "good"), "--quiet"]) == 0
    text = (tmp_path / "good" / "generations.json").read_text()
    assert '"complete": true' in text and '"summary": "abc"' in text, text[:400]
