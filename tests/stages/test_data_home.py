"""One home for what runs leave behind (#29): runs/, out/ and results.sqlite under the data home, found from
any directory; `--out DIR` never replaces an earlier run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmplan.data_home import data_home
from llmplan.engine.cli import main
from tests.stages.tiny_run import make_tiny_model_dir, write_plan


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))[0]


def _plan(folder: Path, model_dir: Path, prompt: str) -> Path:
    """The tiny plan as a shipped plan is written: the default database, a relative json sink."""
    plan = write_plan(folder, model_dir, prompt=prompt)
    document = yaml.safe_load(plan.read_text(encoding="utf-8"))
    document["stages"] += [
        {"id": "lookup", "uses": "cache.lookup", "with": {"mode": "reuse"}},
        {"id": "post", "uses": "output.postprocess"},
        {"id": "text", "uses": "output.detokenize"},
        {"id": "write", "uses": "output.write", "with": {"to": [{"json": "out/tiny.json"}]}},
        {"id": "store", "uses": "output.cache"},
    ]
    plan.write_text(yaml.safe_dump(document, allow_unicode=True), encoding="utf-8")
    return plan


def test_where_the_home_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMPLAN_HOME", str(tmp_path / "mine"))
    assert data_home() == tmp_path / "mine"
    monkeypatch.delenv("LLMPLAN_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_home() == tmp_path / "xdg" / "llmplan"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/xdg")  # invalid by the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert data_home() == tmp_path / "user" / ".local" / "share" / "llmplan"


def test_runs_outputs_and_history_live_in_the_home_whatever_the_directory(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home, here, elsewhere = tmp_path / "fresh-home", tmp_path / "project", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("LLMPLAN_HOME", str(home))
    plan = _plan(here, model_dir, "Hello model, and tokens.")
    monkeypatch.chdir(here)
    assert main(["run", str(plan), "--quiet"]) == 0
    assert sorted(p.name for p in here.iterdir()) == ["tiny.yaml"]  # nothing left where the user stands
    [run_dir] = list((home / "runs").iterdir())
    assert (run_dir / "stages.json").is_file()
    written = json.loads((home / "out" / "tiny.json").read_text(encoding="utf-8"))
    capsys.readouterr()

    monkeypatch.chdir(elsewhere)  # history, show and the results cache find the run from anywhere
    assert main(["history", "--json"]) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["prompt_excerpt"] == "Hello model, and tokens."  # the user's words, not the template's tail
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["history"]) == 0
    listed = capsys.readouterr().out
    assert "Hello model, and tokens." in listed and "assistant" not in listed, listed
    assert main(["show", str(row["id"]), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["text"] == written["results"][0]["text"]
    assert main(["run", str(plan), "--quiet"]) == 0
    assert "replayed from the results cache" in capsys.readouterr().err
    assert sorted(p.name for p in elsewhere.iterdir()) == []


def test_out_never_replaces_an_earlier_run(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first_plan = _plan(tmp_path / "a", model_dir, "Hello model, and tokens.")
    second_plan = _plan(tmp_path / "b", model_dir, "The cache keeps keys.")
    out = tmp_path / "same-out"
    assert main(["run", str(first_plan), "--out", str(out), "--quiet"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["run", str(second_plan), "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"--out {out}: holds an earlier run; a run never replaces another: give a new or empty directory"]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # the first run, untouched
    (tmp_path / "empty").mkdir()
    assert main(["run", str(second_plan), "--out", str(tmp_path / "empty"), "--quiet"]) == 0  # new or empty: fine
