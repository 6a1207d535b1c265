"""Sinks never destroy data: only new files or regular files llmplan wrote are replaced; the refusal
comes before generation; killed writes' temp files go away; outputs follow the umask."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from llmplan.engine.findings import StageFailure
from llmplan.engine.runner import Runner
from llmplan.engine.stage import DeepCheck
from llmplan.stages.completion_rendering import SCHEMA
from llmplan.stages.output_write import OutputWrite, WriteParams, atomic_write, check_target
from llmplan.stages.slots import InferenceContext


def _plan(tokenizer_dir: Path, sink: dict[str, str]) -> str:
    return f"""name: sinks
stages:
  - {{id: source, uses: fake.source, with: {{tokenizer_dir: {json.dumps(str(tokenizer_dir))}}}}}
  - {{id: weights, uses: fake.weights}}
  - {{id: generate, uses: fake.generate}}
  - {{id: post, uses: output.postprocess}}
  - {{id: detok, uses: output.detokenize}}
  - {{id: write, uses: output.write, with: {{to: [{json.dumps(sink)}]}}}}
"""


def _run(make_plan, tokenizer_dir: Path, tmp_path: Path, sink: dict[str, str]):
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return Runner(make_plan(_plan(tokenizer_dir, sink)), InferenceContext(), run_dir).run()


def test_a_results_database_is_not_replaced(make_plan, tokenizer_dir, tmp_path):
    db = tmp_path / "results.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE results (id INTEGER)")
        conn.executemany("INSERT INTO results VALUES (?)", [(i,) for i in range(26)])
    before = db.read_bytes()
    result = _run(make_plan, tokenizer_dir, tmp_path, {"json": str(db)})
    assert result.exit_code == 1 and "is an SQLite database" in result.message
    assert "\n" not in result.message
    statuses = {r.id: r.status for r in result.records}
    assert statuses["generate"] == "not_run" and statuses["source"] == "not_run"  # refused before any work
    assert db.read_bytes() == before


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink", "foreign"])
def test_other_targets_are_refused_and_kept(make_plan, tokenizer_dir, tmp_path, kind):
    target = tmp_path / "out.txt"
    elsewhere = tmp_path / "precious.txt"
    elsewhere.write_text("keep me\n")
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()
    elif kind == "symlink":
        target.symlink_to(elsewhere)
    else:
        target.write_text("the user's own notes\n")
    result = _run(make_plan, tokenizer_dir, tmp_path, {"text": str(target)})
    assert result.exit_code == 1 and str(target) in result.message
    assert {r.id: r.status for r in result.records}["generate"] == "not_run"
    info = os.lstat(target)
    assert {
        "fifo": stat.S_ISFIFO,
        "directory": stat.S_ISDIR,
        "symlink": stat.S_ISLNK,
        "foreign": stat.S_ISREG,
    }[kind](info.st_mode)
    assert elsewhere.read_text() == "keep me\n"
    if kind == "foreign":
        assert target.read_text() == "the user's own notes\n"


def test_a_device_is_refused():
    null = Path("/dev/null")
    if not stat.S_ISCHR(os.stat(null).st_mode):
        pytest.skip("/dev/null is not a character device here")
    with pytest.raises(StageFailure, match="/dev/null: is a character device"):
        check_target(null, "json")
    assert stat.S_ISCHR(os.stat(null).st_mode)


def test_own_outputs_are_replaced_but_an_edited_one_is_kept(tmp_path):
    for kind, name in (("text", "a.txt"), ("markdown", "a.md"), ("json", "a.json")):
        target = tmp_path / name
        chunks = ['{"schema": "', SCHEMA, '", "results": []}\n'] if kind == "json" else ["first\n"]
        atomic_write(target, iter(chunks), kind)
        atomic_write(target, iter(chunks), kind)  # the second run replaces the first one's file
        if kind == "json":
            # Shaped like a result document, but edited by hand: the user's now (was replaced before #33).
            target.write_text(json.dumps({"schema": SCHEMA, "edited": True}))
        else:
            target.write_text("first\nand the user's edit\n")
        with pytest.raises(StageFailure, match=r"not a file llmplan wrote \(or was changed since\)"):
            atomic_write(target, iter(chunks), kind)


def test_killed_writes_leave_no_temp_files_behind(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    target = tmp_path / "out.json"
    stale = tmp_path / f".out.json.llmplan-{dead.pid}-0badc0de.tmp"
    stale.write_text("half a fil")
    live = tmp_path / f".out.json.llmplan-{os.getpid()}-00c0ffee.tmp"  # a writer still running: kept
    live.write_text("in progress")
    atomic_write(target, iter(['{"schema": "', SCHEMA, '"}']), "json")
    assert not stale.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, f".{target.name}.llmplan", live.name])


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_outputs_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "out.txt", iter(["x\n"]), "text")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out.txt").st_mode) == 0o666 & ~umask


def test_validate_deep_names_the_bad_target(tmp_path):
    os.mkfifo(tmp_path / "pipe.json")
    deep = DeepCheck(None)
    deep.current = "write"
    OutputWrite().check(WriteParams(to=[{"json": str(tmp_path / "pipe.json")}]), deep)
    assert deep.problems == [
        (
            "write",
            "to.0.json",
            f"{tmp_path / 'pipe.json'}: is a FIFO (named pipe); llmplan writes only regular files it owns; "
            "choose another path",
        )
    ]
