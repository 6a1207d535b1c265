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
from llmplan.stages.results.file import APPLICATION_ID
from llmplan.stages.results.store import _SCHEMA, ResultRow, ResultsStore, RunRow

from .checkpoints import make_checkpoint, plan_for
from .hostile import EXCEPTION_NAME, assert_clean_message, assert_untouched, memory_bound, refused, snapshot, time_bound

# --- fixtures: one tiny checkpoint, one database our run wrote ------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def cached_plan(folder: Path, model_dir: Path, db: str, *, name: str = "trust") -> Path:
    extra = [
        {"id": "lookup", "uses": "cache.lookup", "with": {"db": db, "mode": "reuse"}},
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
            store.record_run(RunRow("p", "fp", "cpu", "ok"), [_sound_row("x" * 300) for _ in range(100)])
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
        lambda f: _ours(f / "results.sqlite", "PRAGMA user_version = 6"),
        "schema version 6 is newer",
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


# --- damaged rows: a miss, said once, never an answer ----------------------------------------------------------


def _copy_of(golden_db: Path, folder: Path, *statements: str) -> Path:
    """The golden database (our own, one fresh answer) with `statements` applied as a careless editor would."""
    db = folder / "results.sqlite"
    shutil.copy(golden_db, db)
    conn = sqlite3.connect(db, isolation_level=None)
    for statement in statements:
        conn.execute(statement)
    conn.close()
    return db


DAMAGED_ROWS = [
    pytest.param("UPDATE results SET tokens = '[]'", "tokens where its usage says", id="tokens-emptied"),
    pytest.param(
        "UPDATE results SET tokens = '[]', usage = '{\"prompt_tokens\":9,\"completion_tokens\":0}'",
        "no tokens",
        id="tokens-and-usage-emptied",
    ),
    pytest.param("UPDATE results SET tokens = '{}'", "not a list of token ids", id="tokens-an-object"),
    pytest.param("UPDATE results SET tokens = 'not json'", "not valid JSON", id="tokens-not-json"),
    pytest.param("UPDATE results SET tokens = '[1, \"2\"]'", "not a list of token ids", id="tokens-a-string-id"),
    pytest.param("UPDATE results SET tokens = '[1.5, 2]'", "not a list of token ids", id="tokens-a-float-id"),
    pytest.param("UPDATE results SET tokens = '[true, 2]'", "not a list of token ids", id="tokens-a-bool-id"),
    pytest.param("UPDATE results SET tokens = '[-1, 2]'", "not a list of token ids", id="tokens-negative"),
    pytest.param("UPDATE results SET tokens = X'5b315d'", "column is not text", id="tokens-a-blob"),
    pytest.param(
        "UPDATE results SET tokens = '[' || printf('%.*c', 5000, '1') || ']'", "not valid JSON", id="tokens-huge-int"
    ),
    pytest.param(
        "UPDATE results SET tokens = printf('%.*c', 100000, '[') || printf('%.*c', 100000, ']')",
        "not valid JSON",
        id="tokens-nested-deep",
    ),
    pytest.param(
        "UPDATE results SET tokens = json_remove(tokens, '$[#-1]')", "tokens where its usage says", id="token-dropped"
    ),
    pytest.param(
        "UPDATE results SET tokens = json_set(tokens, '$[0]', 999999)", "outside the vocabulary", id="token-id-huge"
    ),
    pytest.param(
        "UPDATE results SET tokens = (SELECT json_group_array(value) FROM (SELECT value FROM json_each(tokens)"
        " UNION ALL SELECT value FROM json_each(tokens))),"
        " usage = json_set(usage, '$.completion_tokens', json_extract(usage, '$.completion_tokens') * 2),"
        " logprobs = NULL",
        "more than max_new_tokens",
        id="more-tokens-than-allowed",
    ),
    pytest.param("UPDATE results SET usage = '{}'", "usage is not two token counts", id="usage-emptied"),
    pytest.param("UPDATE results SET usage = 'null'", "usage is not two token counts", id="usage-null"),
    pytest.param("UPDATE results SET usage = json_set(usage, '$.completion_tokens', -6)", "usage", id="usage-negative"),
    pytest.param("UPDATE results SET finish_detail = 'cancelled'", "finish reason", id="finish-cancelled"),
    pytest.param("UPDATE results SET finish_reason = 'content_filter'", "does not match", id="finish-not-its-detail"),
    pytest.param("UPDATE results SET finish_detail = X'656f73'", "finish_detail is not text", id="finish-detail-a-blob"),
    pytest.param("UPDATE results SET finish_reason = ''", "finish reason", id="finish-empty"),
    pytest.param("UPDATE results SET finish_reason = X'656f73'", "finish_reason is not text", id="finish-eos-a-blob"),
    pytest.param("UPDATE results SET text = X'00ff'", "text is not text", id="text-a-blob"),
    pytest.param("UPDATE results SET logprobs = '[-0.5]'", "logprobs for", id="logprobs-misaligned"),
    pytest.param("UPDATE results SET logprobs = '[NaN, 1, 2, 3, 4, 5]'", "log-probabilities", id="logprobs-nan"),
    pytest.param("UPDATE results SET logprobs = '\"-0.5\"'", "log-probabilities", id="logprobs-a-string"),
    pytest.param("UPDATE results SET candidates = '{\"a\": 1}'", "candidates are not a list", id="candidates-object"),
    pytest.param("UPDATE results SET candidates = '[1]'", "candidate is not a table", id="candidates-not-tables"),
    pytest.param(
        'UPDATE results SET candidates = \'[{"tokens": "abc", "text": "x"}]\'',
        "candidate tokens",
        id="candidate-tokens-text",
    ),
    pytest.param("UPDATE results SET timings = '[]'", "timings", id="timings-a-list"),
    pytest.param("UPDATE results SET request_id = X'01'", "request_id is not text", id="request-id-a-blob"),
]


@pytest.mark.parametrize(("damage", "why"), DAMAGED_ROWS)
def test_a_damaged_row_is_a_miss_said_once_never_an_answer(damage, why, model_dir, golden, tmp_path, capsys) -> None:
    golden_db, fresh = golden
    db = _copy_of(golden_db, tmp_path, damage)
    plan = cached_plan(tmp_path, model_dir, str(db))
    answer, err, stages = run_plan(plan, tmp_path / "run", capsys)
    assert stages["generate"] == "ok" and answer["from_cache"] is False  # generated again, not replayed
    assert answer["text"] == fresh["text"] and answer["tokens"] == fresh["tokens"] and answer["text"]
    notes = [line for line in err.splitlines() if "is damaged" in line]
    assert len(notes) == 1 and str(db) in notes[0] and why in notes[0] and "not replayed" in notes[0], err
    assert_clean_message(notes[0])
    assert "replayed from the results cache" not in err


def test_after_a_damaged_row_the_fresh_answer_is_replayed(model_dir, golden, tmp_path, capsys) -> None:
    """Benign twin: the damaged row's miss stored a fresh answer, which the next run replays, silently."""
    golden_db, fresh = golden
    db = _copy_of(golden_db, tmp_path, "UPDATE results SET tokens = '[]'")
    plan = cached_plan(tmp_path, model_dir, str(db))
    run_plan(plan, tmp_path / "run1", capsys)
    again, err, stages = run_plan(plan, tmp_path / "run2", capsys)
    assert stages["generate"] == "skipped" and again["from_cache"] is True
    assert again["text"] == fresh["text"] and again["tokens"] == fresh["tokens"]
    assert "is damaged" not in err and "replayed from the results cache" in err


def test_our_own_database_replays(model_dir, golden, tmp_path, capsys) -> None:
    """Benign twin: the very database our run wrote, untouched, replays its answer."""
    golden_db, fresh = golden
    db = _copy_of(golden_db, tmp_path)
    answer, err, stages = run_plan(cached_plan(tmp_path, model_dir, str(db)), tmp_path / "run", capsys)
    assert stages["generate"] == "skipped" and answer["from_cache"] is True and answer["text"] == fresh["text"]
    assert "is damaged" not in err


# --- history and show on damaged rows and damaged databases ---------------------------------------------------

SHOWN_DAMAGE = [p for p in DAMAGED_ROWS if p.id in {
    "tokens-an-object", "tokens-not-json", "tokens-a-blob", "tokens-huge-int", "tokens-nested-deep", "usage-null",
    "finish-eos-a-blob", "text-a-blob", "logprobs-nan", "candidates-not-tables", "timings-a-list",
}]  # fmt: skip


@pytest.mark.parametrize(("damage", "why"), SHOWN_DAMAGE)
def test_show_of_a_damaged_row_is_one_line(damage, why, golden, tmp_path, capsys) -> None:
    db = _copy_of(golden[0], tmp_path, damage)
    for extra in ([], ["--json"]):
        said = refused(["show", "1", "--db", str(db), *extra], capsys, names=[str(db), "result 1 is damaged", why])
        assert len(said.strip().splitlines()) == 1, said


@pytest.mark.parametrize(("damage", "why"), SHOWN_DAMAGE[:4])
def test_history_lists_a_damaged_row_as_damaged(damage, why, golden, tmp_path, capsys) -> None:
    db = _copy_of(golden[0], tmp_path, damage)
    with ResultsStore(db) as store:  # a second, sound result beside the damaged one
        store.record_run(RunRow("second", "fp", "cpu", "ok"), [_sound_row("fine answer")])
    capsys.readouterr()
    assert main(["history", "--db", str(db)]) == 0
    said = capsys.readouterr()
    notes = said.err.strip().splitlines()
    assert len(notes) == 1 and "result 1 is damaged" in notes[0] and why in notes[0], said.err
    assert_clean_message(said.err)
    assert "(damaged)" in said.out and "second" in said.out and not EXCEPTION_NAME.search(said.out)
    assert main(["history", "--db", str(db), "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["id"] for line in lines] == [2, 1] and "damaged" in lines[1] and lines[0]["text"] == "fine answer"


def _sound_row(text: str, prompt: str = "a prompt") -> ResultRow:
    return ResultRow("r", prompt, text, [1, 2], "eos", {"prompt_tokens": 3, "completion_tokens": 2}, {}, [])


def EXCEPTION_IN(text: str) -> bool:
    from .hostile import EXCEPTION_NAME

    return bool(EXCEPTION_NAME.search(text))


def test_history_on_a_database_damaged_inside_is_one_line(tmp_path, capsys) -> None:
    db = tmp_path / "results.sqlite"
    with ResultsStore(db) as store:
        store.record_run(RunRow("p", "fp", "cpu", "ok"), [_sound_row("x" * 3000, "p" * 150) for _ in range(60)])
    data = bytearray(db.read_bytes())
    data[4 * 4096 : 12 * 4096] = os.urandom(8 * 4096)  # the results table's pages, not the schema's
    db.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    said = refused(["history", "--db", str(db), "--limit", "100"], capsys, names=[str(db), "damaged"])
    assert len(said.strip().splitlines()) == 1, said
    assert_untouched(before, tmp_path)


def test_stored_text_is_never_read_as_markup(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # one line per row: the cells are not wrapped
    db = tmp_path / "results.sqlite"
    with ResultsStore(db) as store:
        store.record_run(RunRow("[/dim]plan[bold]", "fp", "cpu", "ok"), [_sound_row("a", "[/red] prompt [link=x]")])
    capsys.readouterr()
    assert main(["history", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "[/dim]plan[bold]" in out and "[/red] prompt [link=x]" in out


# --- benign twins: our own database, as it is and as it was before the stamp -------------------------------


def test_a_database_written_before_the_stamp_keeps_working(model_dir, golden, tmp_path, capsys) -> None:
    """Unstamped (application_id 0), as every llmplan before this one wrote it: read, replayed, then stamped."""
    golden_db, fresh = golden
    db = _copy_of(golden_db, tmp_path, "PRAGMA application_id = 0", "PRAGMA user_version = 0")
    assert db.read_bytes()[68:72] == bytes(4)
    capsys.readouterr()
    assert main(["show", "1", "--db", str(db)]) == 0 and fresh["text"] in capsys.readouterr().out
    answer, _, stages = run_plan(cached_plan(tmp_path, model_dir, str(db)), tmp_path / "run", capsys)
    assert stages["generate"] == "skipped" and answer["from_cache"] is True and answer["text"] == fresh["text"]
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        assert conn.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 2


def test_a_new_path_is_created_whole_and_alone(model_dir, tmp_path, capsys) -> None:
    db = tmp_path / "new" / "deeper" / "results.sqlite"
    answer, _, stages = run_plan(cached_plan(tmp_path, model_dir, str(db)), tmp_path / "run", capsys)
    assert stages["generate"] == "ok" and stages["store"] == "ok" and answer["from_cache"] is False
    assert sorted(p.name for p in db.parent.iterdir()) == ["results.sqlite"]  # no hidden temp file left
    header = db.read_bytes()[:100]
    assert header[68:72] == APPLICATION_ID.to_bytes(4, "big") and header[18:20] == b"\x02\x02"  # stamped, WAL


def test_a_link_to_our_database_works(model_dir, golden, tmp_path, capsys) -> None:
    db = _copy_of(golden[0], tmp_path)
    link = tmp_path / "link.sqlite"
    link.symlink_to(db)
    capsys.readouterr()
    assert main(["validate", str(cached_plan(tmp_path, model_dir, str(link)))]) == 0
    answer, _, stages = run_plan(cached_plan(tmp_path, model_dir, str(link)), tmp_path / "run", capsys)
    assert stages["generate"] == "skipped" and answer["text"] == golden[1]["text"]


def test_many_creators_at_once_make_one_whole_database(tmp_path) -> None:
    """Concurrency: every thread creates the same new database at the same moment; none is refused."""
    import threading

    db = tmp_path / "results.sqlite"
    start = threading.Barrier(8)
    failures: list[BaseException] = []

    def create(i: int) -> None:
        try:
            start.wait()
            with ResultsStore(db) as store:
                store.record_run(RunRow(f"t{i}", None, "cpu", "ok"), [_sound_row(f"answer {i}")])
        except BaseException as bad:
            failures.append(bad)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    with time_bound(60):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not failures, failures
    with ResultsStore(db, create=False) as store:
        assert store.count("runs") == 8 and store.count("results") == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.sqlite"]


def test_a_damaged_row_is_never_served(model_dir, tmp_path) -> None:
    """The issue's case, served: after the stored answer is damaged, the server generates it again (never an
    empty string from the cache), stores the fresh one, and replays that."""
    import httpx

    from llmplan.commands.serve.app import ServerSettings
    from tests.commands.conftest import LiveServer, write_serve_plan

    db = tmp_path / "results.sqlite"
    plan = write_serve_plan(tmp_path, model_dir, name="served", cache_db=db, max_new_tokens=6)
    body = {"prompt": "Hello world", "max_tokens": 6}
    with time_bound(120), LiveServer(plan, ServerSettings()) as live:
        url = f"{live.url}/completions"
        first = httpx.post(url, json=body, timeout=30)
        assert first.status_code == 200 and first.headers["x-llmplan-replayed"] == "false"
        text = first.json()["choices"][0]["text"]
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE results SET tokens = '[]'")
        damaged = httpx.post(url, json=body, timeout=30)
        assert damaged.status_code == 200 and damaged.headers["x-llmplan-replayed"] == "false"
        assert damaged.json()["choices"][0]["text"] == text and damaged.json()["usage"]["completion_tokens"] == 6
        again = httpx.post(url, json=body, timeout=30)
        assert again.headers["x-llmplan-replayed"] == "true" and again.json()["choices"][0]["text"] == text


@pytest.mark.parametrize(("target", "reason"), NOT_A_FILE)
def test_history_refuses_a_db_that_is_not_a_regular_file_path(target, reason, tmp_path, capsys) -> None:
    folder = _user_folder(tmp_path)
    db = target(folder)
    before = snapshot(folder)
    if "\x00" in db:
        reason = "NUL"
    said = refused(["history", "--db", db], capsys, names=[reason], seconds=20, memory_mb=256)
    assert len(said.strip().splitlines()) == 1, said
    assert_untouched(before, folder)
