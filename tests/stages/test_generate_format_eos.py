"""`llmplan validate` refuses a generate stage with a `format` and `ignore_eos: true` (#56) at the line of
`ignore_eos`, as `run` would refuse it at its first request: a constrained answer ends with its end-of-sequence
token."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmplan.engine.cli import main
from tests.stages.tiny_run import load_stages


def plan_with(tmp_path: Path, generate: dict[str, object]) -> Path:
    plan = {
        "name": "constrained",
        "stages": [
            *load_stages(tmp_path / "no-model-needed"),
            {"id": "prompt", "uses": "compute.tokenize", "with": {"text": "hello"}},
            {"id": "generate", "uses": "compute.generate", "with": generate},
        ],
    }
    path = tmp_path / "constrained.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False), encoding="utf-8")
    return path


def test_validate_names_the_ignore_eos_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    both = plan_with(tmp_path, {"format": {"choice": ["yes", "no"]}, "ignore_eos": True, "max_new_tokens": 4})
    assert main(["validate", str(both)]) != 0
    said = capsys.readouterr()
    shown = said.out + said.err
    line = next(n for n, text in enumerate(both.read_text().splitlines(), 1) if "ignore_eos" in text)
    assert f"constrained.yaml:{line}:" in shown and "ignore_eos" in shown and "end-of-sequence" in shown, shown
    assert "Traceback" not in shown and len([s for s in shown.splitlines() if "constrained.yaml:" in s]) == 1


def test_either_alone_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for generate in ({"format": {"choice": ["yes", "no"]}}, {"ignore_eos": True}, {"ignore_eos": False, "format": None}):
        assert main(["validate", str(plan_with(tmp_path, generate))]) == 0, capsys.readouterr()
