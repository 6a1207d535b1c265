"""Issue 33, the results database: a foreign or damaged file is refused and left byte-identical, a damaged
row is a miss (said once) and never an answer, and `db` must be a regular file path.

Every hostile file lives alone in a folder of its own, snapshotted byte for byte (hostile.snapshot) before the
command and compared after (assert_untouched): nothing added beside it (no -wal, no -shm), nothing changed in it.
The benign twins show that our own database, including one written before the stamp, keeps working.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from llmplan.engine.cli import main
from llmplan.stages.results_file import APPLICATION_ID
from llmplan.stages.results_store import _SCHEMA, ResultsStore, RunRow

from .checkpoints import make_checkpoint, plan_for
from .hostile import assert_untouched, memory_bound, refused, snapshot, time_bound

# --- fixtures: one tiny checkpoint, one database our run wrote ------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def cached_plan(folder: Path, model_dir: Path, db: str, *, name: str = "trust") -> Path:
    extra = [
        {"id": "lookup", "uses": "cache.lookup", "with": {"db": db}},
        {"id": "clean", "uses": "output.postprocess"},
        {"id": "text", "uses": "output.detokenize"},
        {"id": "write", "uses": "output.write", "with": {"to": ["stdout_json"]}},
        {"id": "store", "uses": "output.cache", "with": {"db": db}},
    ]
    return plan_for(folder, model_dir, hashes="if_present", extra=extra, max_new_tokens=6, name=name)


def run_plan(plan: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str, dict]:  # type: ignore[type-arg]
    """A run that must succeed: (its one JSON answer, what it said on stderr, stage id -> status)."""
    capsys.readouterr()
    with time_bound(120), memory_bound(1024):
        code = main(["run", str(plan), "--json", "--quiet", "--out", str(out)])
    said = capsys.readouterr()
    assert code == 0, said.err[-600:]
    stages = {s["id"]: s["status"] for s in json.loads((out / "stages.json").read_text())}
    return json.loads(said.out.strip().splitlines()[-1]), said.err, stages


@pytest.fixture(scope="module")
def golden(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:  # type: ignore[type-arg]
    """A database holding one fresh answer for `cached_plan` (written by a real run), and that answer."""
    folder = tmp_path_factory.mktemp("golden")
    db = folder / "results.sqlite"
    plan = cached_plan(folder, model_dir, str(db))
    from llmplan.engine.cli import main as run_main

    code = run_main(["run", str(plan), "--json", "--quiet", "--out", str(folder / "run")])
    assert code == 0 and db.is_file()
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT text, tokens FROM results").fetchone()
    assert row[0] and json.loads(row[1])
    return db, {"text": row[0], "tokens": json.loads(row[1])}


# --- hostile files: each made alone in its folder, returns the path to point `db` at ---------------------------


def _sqlite(path: Path, *statements: str, wal: bool = False) -> Path:
    conn = sqlite3.connect(path, isolation_level=None)
    if wal:
        conn.execute("PRAGMA journal_mode = WAL")
    for statement in statements:
        conn.execute(statement)
    conn.close()
    return path


def _ours(path: Path, *statements: str, stamp: bool = True) -> Path:
    """Our schema (stamped as llmplan writes it, or unstamped as before the stamp), then `statements`."""
    conn = sqlite3.connect(path, isolation_level=None)
    if stamp:
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("PRAGMA user_version = 1")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.executescript(_SCHEMA)
    conn.execute("INSERT INTO schema_version (version) VALUES (1)")
    for statement in statements:
        conn.execute(statement)
    conn.close()
    return path


def _truncated(keep: Callable[[int, int], int]) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        path = folder / "results.sqlite"
        with ResultsStore(path) as store:  # a real one, with rows spread over several pages
            store.record_run(RunRow("p", "fp", "cpu", "ok"), [])
            store._live.execute("BEGIN")
            for i in range(200):
                store._live.execute(
                    "INSERT INTO runs (time, plan, status) VALUES (?, ?, 'ok')", ("t", "plan-" + "x" * 100 + str(i))
                )
            store._live.execute("COMMIT")
        data = path.read_bytes()
        page = int.from_bytes(data[16:18], "big")
        path.write_bytes(data[: keep(len(data), page)])
        return path

    return make


def _page_one_garbage(folder: Path) -> Path:
    path = _ours(folder / "results.sqlite")
    data = bytearray(path.read_bytes())
    data[100:4096] = os.urandom(3996)  # the schema's b-tree page after the header: garbage
    path.write_bytes(bytes(data))
    return path


def _fifo(folder: Path) -> Path:
    path = folder / "results.sqlite"
    os.mkfifo(path)
    return path


def _socket(folder: Path) -> Path:
    path = folder / "r.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()
    return path


def _write(name: str, content: bytes) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(content)
        return path

    return make


FOREIGN = [
    pytest.param(
        lambda f: _sqlite(f / "app.db", "CREATE TABLE notes (body TEXT)", "INSERT INTO notes VALUES ('x')"),
        "another program's SQLite database",
        id="other-program-sqlite",
    ),
    pytest.param(
        lambda f: _sqlite(f / "app.db", "CREATE TABLE notes (body TEXT)", "INSERT INTO notes VALUES ('x')", wal=True),
        "another program's SQLite database",
        id="other-program-sqlite-wal",
    ),
    pytest.param(
        lambda f: _sqlite(f / "fossil.db", "PRAGMA application_id = 252006673", "CREATE TABLE blob (x)"),
        "application_id 252006673",
        id="other-application-id",
    ),
    pytest.param(
        lambda f: _sqlite(f / "app.db", "PRAGMA user_version = 7", "CREATE TABLE t (x)"),
        "user_version 7",
        id="other-user-version",
    ),
    pytest.param(
        lambda f: _sqlite(f / "empty.db", "CREATE TABLE t (x)", "DROP TABLE t"),
        "without tables",
        id="sqlite-without-tables",
    ),
    pytest.param(
        lambda f: _sqlite(
            f / "results.sqlite",
            "CREATE TABLE schema_version (version INTEGER)",
            "CREATE TABLE runs (id INTEGER PRIMARY KEY)",
            "CREATE TABLE results (id INTEGER)",
        ),
        "not shaped as llmplan's",
        id="our-table-names-other-shape",
    ),
    pytest.param(
        lambda f: _ours(f / "results.sqlite", "ALTER TABLE results ADD COLUMN extra TEXT", stamp=False),
        "not shaped as llmplan's",
        id="our-tables-extra-column",
    ),
    pytest.param(
        lambda f: _ours(f / "results.sqlite", "CREATE TABLE payroll (who TEXT)", stamp=False),
        "not llmplan's",
        id="our-tables-and-a-foreign-one",
    ),
    pytest.param(
        lambda f: _sqlite(f / "results.sqlite", "CREATE TABLE results (text TEXT)"),
        "not llmplan's",
        id="only-a-results-table",
    ),
    pytest.param(
        lambda f: _ours(f / "results.sqlite", "PRAGMA user_version = 2"),
        "schema version 2 is newer",
        id="newer-user-version",
    ),
    pytest.param(
        lambda f: _ours(f / "results.sqlite", "UPDATE schema_version SET version = 99", stamp=False),
        "schema version 99 is newer",
        id="newer-schema-table-unstamped",
    ),
    pytest.param(
        lambda f: _ours(f / "results.sqlite", "UPDATE schema_version SET version = 99"),
        "schema version 99 is newer",
        id="newer-schema-table-stamped",
    ),
    pytest.param(
        lambda f: _ours(f / "results.sqlite", "DELETE FROM schema_version"),
        "holds no version",
        id="empty-schema-version",
    ),
    pytest.param(_truncated(lambda n, page: n // 2 + 100), "truncated", id="truncated-mid-page"),
    pytest.param(_truncated(lambda n, page: page * 2), "truncated", id="truncated-at-a-page"),
    pytest.param(_truncated(lambda n, page: 60), "truncated", id="truncated-in-the-header"),
    pytest.param(_truncated(lambda n, page: 10), "truncated", id="truncated-in-the-magic"),
    pytest.param(_write("results.sqlite", b""), "empty file", id="zero-bytes"),
    pytest.param(_write("notes.txt", b"my important notes\n" * 50), "not an SQLite database", id="text-file"),
    pytest.param(_write("data.json", b'{"schema": "llmplan.result/v1"}'), "not an SQLite database", id="json-file"),
    pytest.param(_write("blob.bin", os.urandom(8192)), "not an SQLite database", id="random-bytes"),
    pytest.param(
        _write("x.sqlite", b"SQLite format 3\x00" + b"\xff" * 4080), "header is damaged", id="magic-then-garbage"
    ),
    pytest.param(_page_one_garbage, "cannot use the results database", id="schema-page-garbage"),
]


def _user_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "user"
    folder.mkdir()
    return folder


@pytest.mark.parametrize(("make", "reason"), FOREIGN)
def test_run_refuses_a_foreign_or_damaged_file_and_leaves_it(make, reason, model_dir, tmp_path, capsys) -> None:
    folder = _user_folder(tmp_path)
    db = make(folder)
    before = snapshot(folder)
    plan = cached_plan(tmp_path, model_dir, str(db))
    said = refused(["run", str(plan), "--quiet", "--out", str(tmp_path / "run")], capsys, names=[str(db), reason])
    assert len([line for line in said.splitlines() if str(db) in line]) == 1, said
    assert_untouched(before, folder)
    stages = {s["id"]: s["status"] for s in json.loads((tmp_path / "run" / "stages.json").read_text())}
    assert stages.get("generate") != "ok" and stages.get("weights") != "ok", stages  # refused before any work


@pytest.mark.parametrize(("make", "reason"), FOREIGN)
@pytest.mark.parametrize("command", ["history", "show"])
def test_history_and_show_refuse_a_foreign_or_damaged_file(command, make, reason, tmp_path, capsys) -> None:
    folder = _user_folder(tmp_path)
    db = make(folder)
    before = snapshot(folder)
    argv = [command, "--db", str(db)] + (["1"] if command == "show" else [])
    said = refused(argv, capsys, names=[str(db), reason], seconds=20, memory_mb=256)
    assert len(said.strip().splitlines()) == 1, said
    assert_untouched(before, folder)


def test_a_foreign_database_in_use_by_its_program_is_left_alone(model_dir, tmp_path, capsys) -> None:
    """The issue's case: another program's WAL database, open in that program (its -wal and -shm beside it)."""
    folder = _user_folder(tmp_path)
    db = folder / "app.db"
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("PRAGMA journal_mode = WAL")
    other.execute("CREATE TABLE notes (body TEXT)")
    other.execute("INSERT INTO notes VALUES ('only in the write-ahead log')")
    try:
        assert (folder / "app.db-wal").is_file()
        before = snapshot(folder)
        plan = cached_plan(tmp_path, model_dir, str(db))
        refused(["run", str(plan), "--quiet", "--out", str(tmp_path / "run")], capsys, names=[str(db)])
        refused(["history", "--db", str(db)], capsys, names=[str(db)])
        assert_untouched(before, folder)
        assert other.execute("SELECT body FROM notes").fetchall() == [("only in the write-ahead log",)]
    finally:
        other.close()


def test_validate_deep_refuses_a_foreign_file(model_dir, tmp_path, capsys) -> None:
    folder = _user_folder(tmp_path)
    db = _sqlite(folder / "app.db", "CREATE TABLE notes (body TEXT)", wal=True)
    before = snapshot(folder)
    plan = cached_plan(tmp_path, model_dir, str(db))
    said = refused(["validate", "--deep", str(plan)], capsys, names=[str(db), "another program's SQLite database"])
    assert "stages[5].with.db" in said or "db" in said
    assert_untouched(before, folder)


# --- `db` must be a regular file path: refused by plain `validate` -------------------------------------------


def _dangling(folder: Path) -> Path:
    link = folder / "results.sqlite"
    link.symlink_to(folder / "gone.sqlite")
    return link


def _below_a_file(folder: Path) -> Path:
    (folder / "notes.txt").write_text("keep me\n")
    return folder / "notes.txt" / "results.sqlite"


def _link_to_folder(folder: Path) -> Path:
    (folder / "sub").mkdir()
    link = folder / "results.sqlite"
    link.symlink_to(folder / "sub")
    return link


NOT_A_FILE = [
    pytest.param(lambda f: "", "db is empty", id="empty"),
    pytest.param(lambda f: "   ", "db is empty", id="blank"),
    pytest.param(lambda f: "/dev/null", "character device", id="dev-null"),
    pytest.param(lambda f: "/dev/zero", "character device", id="dev-zero"),
    pytest.param(lambda f: str(f), "directory", id="a-directory"),
    pytest.param(lambda f: str(f) + "/", "directory", id="a-directory-slash"),
    pytest.param(lambda f: str(_fifo(f)), "FIFO", id="fifo"),
    pytest.param(lambda f: str(_socket(f)), "socket", id="socket"),
    pytest.param(lambda f: str(_dangling(f)), "symbolic link to nothing", id="dangling-link"),
    pytest.param(lambda f: str(_below_a_file(f)), "is not a folder", id="below-a-file"),
    pytest.param(lambda f: str(_link_to_folder(f)), "directory", id="link-to-a-directory"),
    pytest.param(lambda f: "run\x00s/results.sqlite", "NUL", id="nul-character"),
]


@pytest.mark.parametrize(("target", "reason"), NOT_A_FILE)
@pytest.mark.parametrize("how", ["in-plan", "set"])
def test_validate_refuses_a_db_that_is_not_a_regular_file_path(
    how, target, reason, model_dir, tmp_path, capsys
) -> None:
    folder = _user_folder(tmp_path)
    db = target(folder)
    before = snapshot(folder)
    plan = cached_plan(tmp_path, model_dir, db if how == "in-plan" else str(tmp_path / "fine.sqlite"))
    sets = [] if how == "in-plan" else ["--set", f"store.db={db}"]
    if how == "set" and "\x00" in db:
        reason = "store.db"  # the --set parser refuses a NUL before the stage sees it
    said = refused(["validate", str(plan), *sets], capsys, names=[reason], seconds=20, memory_mb=256)
    assert ".db" in said, said  # the field is named
    assert_untouched(before, folder)
    assert not (tmp_path / "fine.sqlite").exists()


@pytest.mark.parametrize("db", ["", "/dev/null"])
def test_run_with_an_unusable_db_replays_nothing(db, model_dir, golden, tmp_path, capsys, monkeypatch) -> None:
    """The issue's case: `db: ''` or `/dev/null` validated, then replayed answers from another database."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(golden[0], tmp_path / "results.sqlite")  # a database nearby that a wrong path could reach
    before = snapshot(tmp_path)
    (tmp_path / "user").mkdir()
    plan = cached_plan(tmp_path / "user", model_dir, db)
    said = refused(["run", str(plan), "--quiet", "--out", str(tmp_path / "user" / "run")], capsys, names=["db"])
    assert "replayed" not in said
    assert snapshot(tmp_path / "results.sqlite") == {k: v for k, v in before.items() if k.endswith("results.sqlite")}
