"""`llmplan eval` on a tiny model stores its figures in the results database, keyed by the plan's hash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmplan.commands.eval_store import plan_hash
from llmplan.engine.cli import main
from llmplan.stages.results.store import ResultsStore
from tests.stages.tiny_run import SENTENCES, make_tiny_model_dir, write_plan


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("eval")
    model_dir, _ = make_tiny_model_dir(tmp, n_layers=2)
    return write_plan(tmp, model_dir)


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_text(" ".join(SENTENCES * 4), encoding="utf-8")
    return path


def _eval(plan: Path, text: Path, *extra: str) -> list[str]:
    return ["eval", str(plan), "--text", str(text), "--context", "16", "--chunks", "2", "--greedy", "2", *extra]


def test_figures_are_stored_with_the_plans_hash(plan: Path, text: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # the history table at a terminal's width, not the test's pipe
    db = tmp_path / "results.sqlite"
    assert main([*_eval(plan, text, "--dtypes", "int8", "--db", str(db), "--format", "json")]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert f"stored in {db}" in captured.err
    with ResultsStore(db, create=False) as store:
        stored = {row["change"]: row for row in store.evals()}
    as_written, int8 = stored[""], stored["weights int8"]
    assert as_written["plan_hash"] == plan_hash(plan, []) == report["plans"][0]["plan_hash"]
    assert int8["plan_hash"] == plan_hash(plan, ["convert.dtype=int8"]) != as_written["plan_hash"]
    # The reference is the plan at fp32, which this plan already is: the same resolved plan, the same hash.
    assert as_written["reference_hash"] == as_written["plan_hash"]
    assert as_written["figures"]["kl_mean"] == 0.0 and int8["figures"]["kl_mean"] > 0
    assert int8["figures"]["perplexity"] == report["plans"][1]["perplexity"]
    assert as_written["settings"] == {"context": 16, "chunks": 2} and as_written["text_source"] == str(text)
    assert main(["history", "--evals", "--db", str(db), "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["change"] for row in listed] == ["weights int8", ""]  # newest first
    assert main(["history", "--evals", "--db", str(db)]) == 0
    shown = capsys.readouterr().out
    assert "evaluations in" in shown and as_written["plan_hash"][:12] in shown and "weights int8" in shown


def test_no_store_writes_no_database_and_markdown_is_the_default(plan: Path, text: Path, tmp_path: Path, capsys):
    db = tmp_path / "results.sqlite"
    assert main([*_eval(plan, text, "--db", str(db), "--no-store")]) == 0
    assert "| plan | weights |" in capsys.readouterr().out and not db.exists()


def test_a_db_that_is_not_ours_is_refused_before_loading(plan: Path, text: Path, tmp_path: Path, capsys) -> None:
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database" * 50)
    assert main([*_eval(plan, text, "--db", str(junk))]) != 0
    err = capsys.readouterr().err
    assert "junk.sqlite: cannot use the results database" in err and "Traceback" not in err
    assert junk.read_bytes() == b"not a database" * 50
