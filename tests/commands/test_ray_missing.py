"""Without Ray installed, `--executor ray` is one clear line and a non-zero exit, before anything is made."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmplan.engine.cli import main

PLAN = Path(__file__).resolve().parents[2] / "plans" / "llama-int8.yaml"


def test_executor_ray_without_ray_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError, as when not installed
    out = tmp_path / "run"
    assert main(["run", str(PLAN), "--executor", "ray", "--replicas", "2", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "executor 'ray' needs Ray, which is not installed: pip install 'llmplan[ray]'"
    ]
    assert captured.out == ""
    assert not out.exists()  # refused before the run directory was made


def test_executor_in_the_plan_without_ray_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.read_text(encoding="utf-8") + "executor: {kind: ray, replicas: 4}\n", encoding="utf-8")
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["run", str(plan), "--out", str(tmp_path / "run")]) == 1
    assert "needs Ray, which is not installed" in capsys.readouterr().err
