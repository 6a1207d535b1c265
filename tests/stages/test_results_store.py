from __future__ import annotations

import argparse
import json
import multiprocessing
import sqlite3

import pytest

from llmplan.commands import history as history_commands
from llmplan.engine.cli import CliError
from llmplan.stages.results.store import (
    SCHEMA_VERSION,
    EvalRow,
    ResultRow,
    ResultsStore,
    RunRow,
    StoreError,
    open_existing,
)


def _row(i: int, key: str | None = None) -> ResultRow:
    return ResultRow(
        request_id=f"r{i}",
        prompt=f"prompt {i} " + "x" * 300,
        text=f"answer {i} 你好 🎉",
        tokens=[1, 2, i],
        finish_reason="eos",
        usage={"prompt_tokens": 4, "completion_tokens": 3},
        timings={"ttft_s": 0.01, "decode_tokens_per_s": 80.0 + i},
        candidates=[{"text": "c", "tokens": [1], "score": -1.0, "finish_reason": "eos"}],
        cache_key=key,
        logprobs=[-0.5, -0.25, float("-inf")],
    )


def _run(plan: str = "p") -> RunRow:
    return RunRow(plan, "fp-1", "cpu", "ok", "/runs/x")


def test_schema_and_round_trip(tmp_path):
    db = tmp_path / "sub" / "results.sqlite"
    with ResultsStore(db) as store:
        run_id = store.record_run(_run(), [_row(1, "k1"), _row(2)])
        assert store.count("runs") == 1 and store.count("results") == 2
        hit = store.lookup("k1")
        assert hit is not None and hit["run_id"] == run_id and hit["text"] == "answer 1 你好 🎉"
        assert hit["tokens"] == [1, 2, 1] and hit["logprobs"][2] == float("-inf")
        assert len(hit["prompt_excerpt"]) == 200
        assert store.lookup("nope") is None
        newest = store.history(limit=1)
        assert [r["request_id"] for r in newest] == ["r2"] and newest[0]["plan"] == "p"
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]


def test_failed_insert_leaves_nothing_half_written(tmp_path):
    db = tmp_path / "r.sqlite"
    with ResultsStore(db) as store:
        store.record_run(_run(), [_row(1)])
        bad = _row(2)
        bad.request_id = None  # type: ignore[assignment]  # NOT NULL: the second row fails
        with pytest.raises(sqlite3.IntegrityError):
            store.record_run(_run("second"), [_row(3), bad])
        assert store.count("runs") == 1 and store.count("results") == 1  # the run and row 3 rolled back


def test_newer_schema_and_non_database_are_refused(tmp_path):
    db = tmp_path / "r.sqlite"
    ResultsStore(db).close()
    conn = sqlite3.connect(db)
    conn.execute("UPDATE schema_version SET version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match=r"schema version 99 is newer than this llmplan supports \(5\)"):
        ResultsStore(db)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=r"junk\.sqlite: cannot use the results database"):
        ResultsStore(junk)
    assert open_existing(tmp_path / "missing.sqlite") is None
    assert not (tmp_path / "missing.sqlite").exists()


def _writer(db: str, worker: int, start: multiprocessing.synchronize.Event) -> None:
    start.wait()
    with ResultsStore(db) as store:
        for i in range(50):
            store.record_run(RunRow(f"w{worker}", None, "cpu", "ok"), [_row(worker * 1000 + i, f"{worker}-{i}")])


def test_two_processes_lose_nothing(tmp_path):
    db = str(tmp_path / "shared.sqlite")
    mp = multiprocessing.get_context("fork")
    start = mp.Event()
    workers = [mp.Process(target=_writer, args=(db, w, start)) for w in (1, 2)]
    for p in workers:
        p.start()
    start.set()  # both create the schema and write at the same moment
    for p in workers:
        p.join(timeout=120)
        assert p.exitcode == 0
    with ResultsStore(db) as store:
        assert store.count("results") == 100 and store.count("runs") == 100
        assert store.lookup("1-49") is not None and store.lookup("2-0") is not None


# --- llmplan history / show ----------------------------------------------------------------------


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    history_commands.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.handler(args)


def test_history_and_show(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per row
    db = tmp_path / "r.sqlite"
    with ResultsStore(db) as store:
        store.record_run(_run("plan-a"), [_row(1), _row(2)])
    assert _cli(["history", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "plan-a" in out and "82.0" in out and "81.0" in out and "4+3" in out and "prompt 1" in out and "xxx…" in out
    assert _cli(["history", "--db", str(db), "--json", "--limit", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["request_id"] == "r2"
    assert _cli(["show", "1", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "answer 1 你好 🎉" in out and "plan plan-a" in out and "candidate 1" in out
    assert _cli(["show", "2", "--db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "answer 2 你好 🎉"


def test_missing_db_and_unknown_id_are_one_line(tmp_path):
    missing = tmp_path / "none.sqlite"
    with pytest.raises(CliError, match="no results database here"):
        _cli(["history", "--db", str(missing)])
    assert not missing.exists()
    db = tmp_path / "r.sqlite"
    ResultsStore(db).close()
    with pytest.raises(CliError, match="no result with id 7"):
        _cli(["show", "7", "--db", str(db)])


def _eval(plan_hash: str) -> EvalRow:
    return EvalRow(
        plan="p",
        plan_file="plans/p.yaml",
        plan_hash=plan_hash,
        change="weights int8",
        reference="p (weights fp32)",
        reference_hash="ref",
        text_source="pydoc_data",
        text_hash="txt",
        settings={"context": 16, "chunks": 2},
        figures={"kl_mean": 0.01, "perplexity": 12.5, "layer_drift": [0.0, float("nan")]},
    )


def _v2_database(db, version: int = 2) -> None:
    """A results database as llmplan wrote it before v3: no finish_detail, the detail in finish_reason."""
    with ResultsStore(db) as store:
        store.record_run(_run(), [_row(1, "k1")])
    conn = sqlite3.connect(db, isolation_level=None)
    conn.executescript(
        "DROP TABLE result_formats; ALTER TABLE results DROP COLUMN finish_detail; ALTER TABLE runs DROP COLUMN model;"
        " UPDATE results SET finish_reason = 'eos';"
        f" UPDATE schema_version SET version = {version}; PRAGMA user_version = {version};"
    )
    conn.close()


def _v1_database(db) -> None:
    """A results database as llmplan 1 wrote it: the v2 schema less `evals`, stamped version 1, one result."""
    _v2_database(db, version=1)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.executescript("DROP TABLE evals;")
    conn.close()


def test_evals_round_trip_by_plan_hash(tmp_path):
    with ResultsStore(tmp_path / "r.sqlite") as store:
        ids = store.record_evals([_eval("aaa"), _eval("bbb")])
        assert len(ids) == 2 and store.count("evals") == 2
        (only,) = store.evals("bbb")
        assert only["id"] == ids[1] and only["settings"] == {"context": 16, "chunks": 2}
        assert only["figures"]["kl_mean"] == 0.01 and only["figures"]["layer_drift"][0] == 0.0
        assert [row["plan_hash"] for row in store.evals()] == ["bbb", "aaa"] and store.evals("ccc") == []


def test_a_v1_database_is_read_unchanged_and_upgraded_by_its_first_eval(tmp_path):
    db = tmp_path / "v1.sqlite"
    _v1_database(db)
    before = db.read_bytes()
    with ResultsStore(db, create=False) as store:  # what `history` does: read, write nothing
        assert store.evals() == [] and store.lookup("k1") is not None
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'evals'").fetchone() is None
    conn.close()
    assert db.read_bytes()[:100] == before[:100]
    with ResultsStore(db) as store:
        store.record_evals([_eval("aaa")])
        assert store.lookup("k1") is not None and store.evals("aaa")[0]["change"] == "weights int8"
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    assert conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == 5
    conn.close()
    with ResultsStore(db) as store:  # and it opens as a current database afterwards
        assert store.count("evals") == 1


def test_an_eval_row_that_does_not_decode_is_listed_as_damaged(tmp_path):
    db = tmp_path / "r.sqlite"
    with ResultsStore(db) as store:
        store.record_evals([_eval("aaa")])
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("UPDATE evals SET figures = '[1, 2'")
    conn.close()
    with ResultsStore(db) as store:
        (row,) = store.evals()
        assert row["plan"] == "p" and "damaged" in row


def test_a_v2_database_reads_in_the_new_vocabulary_and_its_first_write_moves_old_rows(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the history table on one line per row
    db = tmp_path / "v2.sqlite"
    _v2_database(db)
    before = db.read_bytes()
    with ResultsStore(db, create=False) as store:  # read as it is: finish_reason eos is the old detail
        (old,) = store.history()
        assert (old["finish_reason"], old["finish_detail"]) == ("stop", "eos")
        assert store.lookup("k1") is not None
    assert _cli(["show", "1", "--db", str(db)]) == 0 and "finish stop (eos)" in capsys.readouterr().out
    assert db.read_bytes()[:100] == before[:100]
    with ResultsStore(db) as store:
        filtered = _row(2)
        filtered.finish_reason, filtered.finish_detail = "content_filter", "length"
        store.record_run(_run(), [filtered])
        assert store.lookup("k1")["finish_detail"] == "eos"  # the old row still replays
    conn = sqlite3.connect(db)
    stored = conn.execute("SELECT request_id, finish_reason, finish_detail FROM results ORDER BY id").fetchall()
    assert stored == [("r1", "stop", "eos"), ("r2", "content_filter", "length")]  # SQL sees one vocabulary too
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    conn.close()
    assert _cli(["history", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "stop (eos)" in out and "content_filter (length)" in out


FORMAT = {"kind": "json_schema", "sha256": "ab" * 32, "summary": "object {name, tags}", "complete": False}


def test_the_format_a_result_ran_under_is_stored_and_shown(tmp_path, capsys):
    db = tmp_path / "r.sqlite"
    shaped = _row(2)
    shaped.format, shaped.finish_reason, shaped.finish_detail = FORMAT, "length", "length"
    with ResultsStore(db) as store:
        store.record_run(_run(), [_row(1), shaped])
        free, cut = store.get(1), store.get(2)
    assert free is not None and free["format"] is None
    assert cut is not None and cut["format"] == FORMAT
    assert _cli(["show", "2", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "finish length (cut short: json_schema may not parse)" in out
    assert f"format json_schema {'ab' * 6}: object {{name, tags}}" in out
    assert _cli(["history", "--db", str(db), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["format"] for r in rows] == [FORMAT, None]


def test_a_v3_database_is_read_as_it_is_and_gains_the_format_table_with_its_first_write(tmp_path):
    db = tmp_path / "v3.sqlite"
    with ResultsStore(db) as store:
        store.record_run(_run(), [_row(1, "k1")])
    conn = sqlite3.connect(db, isolation_level=None)
    conn.executescript(
        "DROP TABLE result_formats; ALTER TABLE runs DROP COLUMN model;"
        " UPDATE schema_version SET version = 3; PRAGMA user_version = 3;"
    )
    conn.close()
    with ResultsStore(db, create=False) as store:  # read as it is: the old row has no format
        assert store.get(1)["format"] is None and store.history()[0]["format"] is None
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    conn.close()
    shaped = _row(2)
    shaped.format = {**FORMAT, "complete": True}
    with ResultsStore(db) as store:
        store.record_run(_run(), [shaped])
        assert store.get(2)["format"]["complete"] is True and store.get(1)["format"] is None
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5


def test_a_run_names_its_model_and_a_v4_run_is_known_by_its_fingerprint(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    db = tmp_path / "v4.sqlite"
    with ResultsStore(db) as store:
        store.record_run(_run(), [_row(1, "k1")])
    conn = sqlite3.connect(db, isolation_level=None)
    conn.executescript("ALTER TABLE runs DROP COLUMN model; UPDATE schema_version SET version = 4; PRAGMA user_version = 4;")
    conn.close()
    with ResultsStore(db, create=False) as store:  # read as it is: no name, the fingerprint stands in
        assert "model" not in store.get(1)
    named = RunRow("llama-int8", "d39e33b1aa", "cpu", "ok", None, "qwen2.5-coder-0.5b-instruct-q4_k_m")
    with ResultsStore(db) as store:
        store.record_run(named, [_row(2)])
        assert store.get(1)["model"] is None and store.get(2)["model"] == named.model
    assert _cli(["history", "--db", str(db)]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()}
    assert "qwen2.5-coder-0.5b-instruct-q4_k_m" in listed["2"] and "fp-1" in listed["1"]
    assert _cli(["show", "2", "--db", str(db)]) == 0
    assert "model qwen2.5-coder-0.5b-instruct-q4_k_m  ·  files d39e33b1aa" in capsys.readouterr().out
