"""The results database (SQLite): every run's completions, for `llmplan history` and the result cache.

Safe for several processes at once: WAL journaling (readers never block the writer), a busy
timeout, and a retry loop on SQLITE_BUSY for the moments SQLite reports "locked" without waiting
(switching to WAL, upgrading a read transaction). A run and its results go in one transaction, so
a crash leaves either all of them or none. The schema carries its version in `schema_version` and
in the file's `user_version`; a database written by a newer llmplan is refused rather than misread.

Safe for files that are not ours: nothing is written to a file until it is known to be an llmplan
results database (results_file.py: the header, then the tables, read by a connection that writes
nothing), and a new database appears whole or not at all. Safe for rows that are damaged: every row
is decoded and typed (result_rows.py); one that does not decode to a whole answer is never replayed.

The cache key lives here too, so the stage that looks results up and the stage that stores them
cannot disagree on it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from llmplan.llm.generation import OPENAI_FINISH

from .file import (
    APPLICATION_ID,
    StoreError,
    create_whole,
    immutable_connection,
    read_header,
    refusal,
)
from .rows import DamagedRow, decode_answer, decode_row

DEFAULT_DB = "results.sqlite"  # relative to the data home (llmplan/data_home.py)
SCHEMA_VERSION = 5  # also the file's PRAGMA user_version
# v2 adds `evals` (what `llmplan eval` measured); v3 adds `results.finish_detail`: finish_reason holds OpenAI's
# word (stop, length, ...) and the detail (eos, stop_string, ...) that v1 and v2 kept in finish_reason moves
# there (llm/generation/ending.py). An older file is read as it is (result_rows.py reads old rows' finish_reason as the
# detail) and upgraded, tables, old rows and version, in the same transaction as its first write: a command
# that only reads never writes.
# v4 adds `result_formats`: the constraint a result ran under (`format`: kind, hash, summary, whether the
# answer is whole), one row per shaped result.
# v5 adds `runs.model`: the model the run ran, by the name its user knows (ModelSource.name: a GGUF's file stem,
# an HF directory's name), beside the fingerprint that identifies its files; an older run has none (NULL).
V2_TABLE = "evals"
V3_COLUMN = "finish_detail"
V4_TABLE = "result_formats"
V5_COLUMN = "model"
# v2: the key covers every stage upstream of generation, the model files' content identity, the
# device and the precision. Rows stored under v1 keys (generation params only) can never match a v2
# key, so an old database is never misread: its rows stay as history and are simply not replayed.
CACHE_KEY_VERSION = "llmplan.cache/v2"
EXCERPT_CHARS = 200
BUSY_TIMEOUT_MS = 30_000
_RETRIES = 50
_MAX_TABLES = 64  # a file with more tables is not ours: listed no further
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time TEXT NOT NULL,
    plan TEXT NOT NULL,
    model_fingerprint TEXT,
    device TEXT,
    status TEXT NOT NULL,
    run_dir TEXT,
    model TEXT
);
CREATE TABLE IF NOT EXISTS results (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    cache_key TEXT,
    request_id TEXT NOT NULL,
    prompt_excerpt TEXT NOT NULL,
    text TEXT NOT NULL,
    tokens TEXT NOT NULL,
    finish_reason TEXT NOT NULL,
    usage TEXT NOT NULL,
    timings TEXT NOT NULL,
    logprobs TEXT,
    candidates TEXT NOT NULL,
    error TEXT,
    from_cache INTEGER NOT NULL DEFAULT 0,
    created TEXT NOT NULL,
    finish_detail TEXT
);
CREATE INDEX IF NOT EXISTS results_cache_key ON results(cache_key);
CREATE INDEX IF NOT EXISTS results_run ON results(run_id);
CREATE TABLE IF NOT EXISTS evals (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time TEXT NOT NULL,
    plan TEXT NOT NULL,
    plan_file TEXT,
    plan_hash TEXT NOT NULL,
    change TEXT NOT NULL,
    reference TEXT NOT NULL,
    reference_hash TEXT NOT NULL,
    text_source TEXT NOT NULL,
    text_hash TEXT NOT NULL,
    settings TEXT NOT NULL,
    figures TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS evals_plan_hash ON evals(plan_hash);
CREATE TABLE IF NOT EXISTS result_formats (
    result_id INTEGER PRIMARY KEY REFERENCES results(id),
    kind TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    summary TEXT NOT NULL,
    complete INTEGER
);
"""


def cache_key(
    fingerprint: str,
    prompt_ids: Sequence[int],
    generation_params: dict[str, Any],
    overrides: dict[str, Any],
    seed: int,
    context: dict[str, Any] | None = None,
) -> str:
    """SHA-256 of everything that decides a generation: model, prompt ids, sampling settings, seed, and
    `context` — the resolved parameters of every stage generation depends on, the content identity of
    the model files, the device (cache_stages.key_context builds it)."""
    material = {
        "v": CACHE_KEY_VERSION,
        "model": fingerprint,
        "prompt": [int(i) for i in prompt_ids],
        "params": generation_params,
        "overrides": overrides,
        "seed": int(seed),
        "context": context or {},
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class RunRow:
    plan: str
    model_fingerprint: str | None
    device: str | None
    status: str
    run_dir: str | None = None
    model: str | None = None  # the model's name (ModelSource.name), as history and show say it


@dataclass
class ResultRow:
    """One completion as stored; JSON-able fields are plain Python values here."""

    request_id: str
    prompt: str
    text: str
    tokens: list[int]
    finish_reason: str  # OpenAI's word; a row made with the detail alone is stored as written before v3
    usage: dict[str, int]
    timings: dict[str, Any]
    candidates: list[dict[str, Any]]
    cache_key: str | None = None
    logprobs: list[float] | None = None
    error: str | None = None
    from_cache: bool = False
    finish_detail: str | None = None
    format: dict[str, Any] | None = None  # {kind, sha256, summary, complete}: the constraint it ran under


@dataclass
class EvalRow:
    """One plan's quality figures (`llmplan eval`), keyed by the hash of the plan as it was scored."""

    plan: str
    plan_file: str | None
    plan_hash: str
    change: str
    reference: str
    reference_hash: str
    text_source: str
    text_hash: str
    settings: dict[str, Any]
    figures: dict[str, Any]


def _is_busy(error: sqlite3.OperationalError) -> bool:
    text = str(error).lower()
    return "locked" in text or "busy" in text


def _retry(action: Callable[[], T]) -> T:
    """Run `action`, retrying with a jittered backoff while SQLite reports the database busy."""
    for attempt in range(_RETRIES):
        try:
            return action()
        except sqlite3.OperationalError as error:
            if not _is_busy(error) or attempt == _RETRIES - 1:
                raise
            time.sleep(min(0.5, 0.005 * (2 ** min(attempt, 7))) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def _statements() -> list[str]:
    # Statement by statement: executescript() would COMMIT an open transaction first.
    return [s.strip() for s in _SCHEMA.split(";") if s.strip()]


@functools.cache
def _our_shape() -> dict[str, list[tuple[Any, ...]]]:
    """Our tables and their columns, as PRAGMA table_info reports them: what another file is compared with."""
    conn = sqlite3.connect(":memory:")
    try:
        for statement in _statements():
            conn.execute(statement)
        return _shape(conn)
    finally:
        conn.close()


def _shape(conn: sqlite3.Connection) -> dict[str, list[tuple[Any, ...]]]:
    names = [
        r[0]
        for r in conn.execute(
            f"SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'"
            f" LIMIT {_MAX_TABLES + 1}"
        )
    ]
    return {str(n): [tuple(c[1:]) for c in conn.execute("SELECT * FROM pragma_table_info(?)", (n,))] for n in names}


def _build(conn: sqlite3.Connection) -> None:
    """A new database, whole: stamped as ours, in WAL mode, every table, its schema version."""
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.execute("PRAGMA journal_mode = WAL").fetchone()
    conn.execute("BEGIN IMMEDIATE")
    for statement in _statements():
        conn.execute(statement)
    conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
    conn.execute("COMMIT")


def _newer(path: Path, version: int) -> StoreError:
    return StoreError(f"{path}: schema version {version} is newer than this llmplan supports ({SCHEMA_VERSION})")


def identify(path: Path) -> str:
    """What is at `path`: "absent", "ours" (stamped) or "legacy" (written before the stamp); StoreError for
    anything else. Reads only: the header, then (unstamped files) the tables through an immutable connection."""
    header = read_header(path)
    if header is None:
        return "absent"
    if header.application_id == APPLICATION_ID:
        if header.user_version > SCHEMA_VERSION:
            raise _newer(path, header.user_version)
        return "ours"
    if header.application_id != 0 or header.user_version != 0:
        raise refusal(
            path,
            f"it is another program's SQLite database (application_id {header.application_id}, "
            f"user_version {header.user_version}); choose another path",
        )
    for attempt in range(3):  # a checkpoint of another process may be rewriting pages as we read them
        try:
            with immutable_connection(path) as conn:
                check_contents(conn, path)
            return "legacy"
        except sqlite3.DatabaseError as bad:
            if attempt == 2:
                raise refusal(path, f"it is damaged ({bad}); choose another path") from None
            time.sleep(0.05)
    raise AssertionError("unreachable")


def _older_shapes() -> list[dict[str, list[tuple[Any, ...]]]]:
    """v4 (v5 less runs.model), v3 (v4 less `result_formats`), v2 (v3 less results.finish_detail) and v1 (v2
    less `evals`)."""
    ours = _our_shape()
    v4 = {**ours, "runs": [c for c in ours["runs"] if c[0] != V5_COLUMN]}
    v3 = {name: columns for name, columns in v4.items() if name != V4_TABLE}
    v2 = {**v3, "results": [c for c in v3["results"] if c[0] != V3_COLUMN]}
    return [v4, v3, v2, {name: columns for name, columns in v2.items() if name != V2_TABLE}]


def check_contents(conn: sqlite3.Connection, path: Path) -> None:
    """Our tables with our columns (those of v5, v4, v3, v2 or v1), and a schema version this llmplan reads."""
    shape = _shape(conn)
    ours = _our_shape()
    versions = [ours, *_older_shapes()]
    if shape not in versions:
        if not shape:
            reason = "it is an SQLite database without tables, which llmplan did not write"
        elif set(shape) in [set(v) for v in versions]:
            reason = "its tables are not shaped as llmplan's (another program's database, or altered)"
        elif set(shape) & set(ours):
            reason = "its tables are not llmplan's (another program's database, or altered)"
        else:
            names = ", ".join(sorted(shape)[:4]) + (", …" if len(shape) > 4 else "")
            reason = f"it is another program's SQLite database (tables {names})"
        raise refusal(path, f"{reason}; choose another path")
    version = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
    if not isinstance(version, int) or isinstance(version, bool):
        raise refusal(path, "its schema_version table holds no version; choose another path")
    if version > SCHEMA_VERSION:
        raise _newer(path, version)
    stamped = conn.execute("PRAGMA user_version").fetchone()[0]
    if stamped > SCHEMA_VERSION:
        raise _newer(path, stamped)


class ResultsStore:
    """One database file. Opening creates it (and its folder) unless `create=False`.

    Nothing is written to an existing file before it is known to be ours (results_file.py): its header, then
    its tables and schema version, read through a connection that writes nothing. `damaged` lists the rows
    a lookup met that do not decode to a whole answer (result id, why): each was a miss, not an answer.
    """

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        if not str(path).strip():  # Path("") is the current directory
            raise StoreError("db is empty; give the results database's file path")
        self.path = Path(path).expanduser()
        self._conn: sqlite3.Connection | None = None
        self.damaged: list[tuple[int, str]] = []
        kind = identify(self.path)
        if kind == "absent":
            if not create:
                raise StoreError(f"{self.path}: no results database here")
            try:
                create_whole(self.path, _build)
            except (sqlite3.Error, OSError) as bad:
                reason = bad.strerror if isinstance(bad, OSError) and bad.strerror else str(bad)
                raise StoreError(f"{self.path}: cannot create the results database ({reason})") from None
            kind = identify(self.path)  # ours, or the one another process linked first (checked all the same)
        try:
            self._conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
            self._conn.row_factory = sqlite3.Row
            self._conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            # Read again through this connection (it sees the write-ahead log too) before its first write.
            _retry(lambda: check_contents(self._live, self.path))
            _retry(lambda: self._live.execute("PRAGMA journal_mode = WAL").fetchone())
            self._live.execute("PRAGMA synchronous = NORMAL")
            self._live.execute("PRAGMA foreign_keys = ON")
            if kind == "legacy":
                self._stamp()
        except StoreError:
            self.close()
            raise
        except sqlite3.DatabaseError as bad:
            self.close()
            busy = isinstance(bad, sqlite3.OperationalError) and _is_busy(bad)
            reason = "another process has held it locked for too long; try again" if busy else f"it is damaged ({bad})"
            raise refusal(self.path, reason if busy else f"{reason}; choose another path") from None

    @property
    def _live(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"{self.path}: the results database is closed")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> ResultsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stamp(self) -> None:
        """A database written before llmplan stamped its files gets the stamp, so the header alone tells next time."""
        with self._write() as conn:
            if conn.execute("PRAGMA application_id").fetchone()[0] == 0:
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction: the write lock is taken up front, so it cannot deadlock later."""
        conn = self._live
        _retry(lambda: conn.execute("BEGIN IMMEDIATE"))
        try:
            yield conn
        except BaseException:
            with suppress(sqlite3.Error):  # SQLite may have rolled back already (disk full, damage)
                conn.execute("ROLLBACK")
            raise
        _retry(lambda: conn.execute("COMMIT"))

    def _read(self, action: Callable[[sqlite3.Connection], T]) -> T:
        """A read, retried while busy; a damaged page or an I/O error is one line naming the file."""
        conn = self._live
        try:
            return _retry(lambda: action(conn))
        except sqlite3.DatabaseError as bad:
            raise StoreError(f"{self.path}: cannot read the results database ({bad}); it may be damaged") from None

    # --- writing ---------------------------------------------------------------------------------

    def record_run(self, run: RunRow, results: Sequence[ResultRow]) -> int:
        """Insert a run and its results atomically; returns the run's id."""
        with self._write() as conn:
            _upgrade(conn)
            run_id = self._insert_run(conn, run)
            self._insert_results(conn, run_id, results)
        return run_id

    def open_run(self, run: RunRow) -> int:
        """Insert a run whose results come later, batch by batch (`add_results`); returns its id."""
        with self._write() as conn:
            _upgrade(conn)
            return self._insert_run(conn, run)

    def add_results(self, run_id: int, results: Sequence[ResultRow]) -> None:
        """One batch of an open run's results, in one transaction: a crash keeps whole batches only."""
        with self._write() as conn:
            _upgrade(conn)
            self._insert_results(conn, run_id, results)

    def set_status(self, run_id: int, status: str) -> None:
        with self._write() as conn:
            conn.execute("UPDATE runs SET status = ? WHERE id = ?", (status, int(run_id)))

    @staticmethod
    def _insert_run(conn: sqlite3.Connection, run: RunRow) -> int:
        cursor = conn.execute(
            "INSERT INTO runs (time, plan, model_fingerprint, device, status, run_dir, model)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (_now(), run.plan, run.model_fingerprint, run.device, run.status, run.run_dir, run.model),
        )
        return int(cursor.lastrowid or 0)

    @staticmethod
    def _insert_results(conn: sqlite3.Connection, run_id: int, results: Sequence[ResultRow]) -> None:
        now = _now()
        for r in results:
            cursor = conn.execute(_RESULT_INSERT, _result_values(run_id, r, now))
            if r.format is not None:
                conn.execute(_FORMAT_INSERT, _format_values(int(cursor.lastrowid or 0), r.format))

    def record_evals(self, rows: Sequence[EvalRow]) -> list[int]:
        """Store evaluations in one transaction (an older file is upgraded first); returns their ids."""
        with self._write() as conn:
            _upgrade(conn)
            now = _now()
            return [int(conn.execute(_EVAL_INSERT, (now, *_eval_values(r))).lastrowid or 0) for r in rows]

    # --- reading ---------------------------------------------------------------------------------

    def lookup(self, key: str) -> dict[str, Any] | None:
        """The newest freshly generated (not itself replayed) result stored under `key`, if it decodes to a
        whole answer; a row that does not is a miss, listed in `damaged`."""
        row = self._read(
            lambda conn: conn.execute(
                "SELECT results.*, runs.time AS run_time, runs.plan AS run_plan, runs.run_dir AS run_dir FROM results"
                " JOIN runs ON runs.id = results.run_id"
                " WHERE cache_key = ? AND from_cache = 0 AND error IS NULL"
                " ORDER BY results.id DESC LIMIT 1",
                (key,),
            ).fetchone()
        )
        if row is None:
            return None
        try:
            return decode_answer(row)
        except DamagedRow as bad:
            self.damaged.append((int(row["id"]), str(bad)))
            return None

    def history(self, limit: int = 20) -> list[dict[str, Any]]:
        """The newest results; one that does not decode is {id, run_id, run_time, plan, damaged: why}."""
        rows = self._read(
            lambda conn: conn.execute(
                "SELECT results.*, runs.time AS run_time, runs.plan, runs.model_fingerprint, runs.device,"
                f" runs.status{_model_column(conn)}{_format_columns(conn)}"
                f" FROM results JOIN runs ON runs.id = results.run_id{_format_join(conn)}"
                " ORDER BY results.id DESC LIMIT ?",
                (int(limit),),
            ).fetchall()
        )
        return [_shown(r) for r in rows]

    def get(self, result_id: int) -> dict[str, Any] | None:
        """One result by id (None: no such id); damaged as in `history`."""
        row = self._read(
            lambda conn: conn.execute(
                "SELECT results.*, runs.time AS run_time, runs.plan, runs.model_fingerprint, runs.device,"
                f" runs.status, runs.run_dir{_model_column(conn)}{_format_columns(conn)}"
                f" FROM results JOIN runs ON runs.id = results.run_id{_format_join(conn)} WHERE results.id = ?",
                (int(result_id),),
            ).fetchone()
        )
        return None if row is None else _shown(row)

    def evals(self, plan_hash: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        """The newest stored evaluations (of one plan hash, if given); a v1 file has none. A row whose JSON does
        not decode is {id, plan, damaged: why}."""

        def read(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            known = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
            if not conn.execute(known, (V2_TABLE,)).fetchone():
                return []
            where, values = ("WHERE plan_hash = ?", (plan_hash,)) if plan_hash else ("", ())
            query = f"SELECT * FROM evals {where} ORDER BY id DESC LIMIT ?"
            return conn.execute(query, (*values, int(limit))).fetchall()

        return [_eval_shown(r) for r in self._read(read)]

    def count(self, table: str = "results") -> int:
        if table not in ("results", "runs", V2_TABLE):
            raise ValueError(table)
        return int(self._read(lambda conn: conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]))


def _upgrade(conn: sqlite3.Connection) -> None:
    """Bring a v1 to v4 file to v5, inside the caller's write transaction (a v5 file is left as it is)."""
    for statement in _statements():
        if V2_TABLE in statement or V4_TABLE in statement:  # the tables and index: IF NOT EXISTS
            conn.execute(statement)
    columns = {row[1] for row in conn.execute("SELECT * FROM pragma_table_info('results')")}
    if V3_COLUMN not in columns:
        conn.execute(f"ALTER TABLE results ADD COLUMN {V3_COLUMN} TEXT")
        # Old rows said the detail in finish_reason: it moves, and finish_reason takes OpenAI's word for it.
        words = " ".join(f"WHEN '{detail}' THEN '{word}'" for detail, word in OPENAI_FINISH.items())
        conn.execute(
            f"UPDATE results SET {V3_COLUMN} = finish_reason,"
            f" finish_reason = CASE finish_reason {words} ELSE finish_reason END"
            " WHERE typeof(finish_reason) = 'text'"  # a damaged value stays as it is, and is shown as damaged
        )
    if V5_COLUMN not in {row[1] for row in conn.execute("SELECT * FROM pragma_table_info('runs')")}:
        conn.execute(f"ALTER TABLE runs ADD COLUMN {V5_COLUMN} TEXT")  # older runs: NULL, their model unnamed
    if (conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0) < SCHEMA_VERSION:
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


_RESULT_INSERT = (
    "INSERT INTO results (run_id, cache_key, request_id, prompt_excerpt, text, tokens, finish_reason,"
    " usage, timings, logprobs, candidates, error, from_cache, created, finish_detail)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_FORMAT_INSERT = "INSERT INTO result_formats (result_id, kind, sha256, summary, complete) VALUES (?, ?, ?, ?, ?)"


def _result_values(run_id: int, r: ResultRow, now: str) -> tuple[Any, ...]:
    logprobs = None if r.logprobs is None else _dumps(r.logprobs)
    plain = (run_id, r.cache_key, r.request_id, excerpt(r.prompt), r.text, _dumps(r.tokens), r.finish_reason)
    rest = (_dumps(r.usage), _dumps(r.timings), logprobs, _dumps(r.candidates), r.error, int(r.from_cache), now)
    return (*plain, *rest, r.finish_detail)


def _format_values(result_id: int, f: dict[str, Any]) -> tuple[Any, ...]:
    complete = None if f.get("complete") is None else int(bool(f["complete"]))
    return (result_id, str(f["kind"]), str(f["sha256"]), str(f.get("summary", "")), complete)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def excerpt(prompt: str, limit: int = EXCERPT_CHARS) -> str:
    """Head and tail of a long prompt: a chat prompt starts with the system text, ends with the question."""
    if len(prompt) <= limit:
        return prompt
    head = limit // 4
    return prompt[:head] + " … " + prompt[-(limit - head - 3) :]


def open_existing(path: str | Path) -> ResultsStore | None:
    """The store at `path` if there is a file (lookups must not create databases), else None; a file that
    is not our database is StoreError, never a silent miss."""
    if not str(path).strip():
        raise StoreError("db is empty; give the results database's file path")
    return None if read_header(Path(path).expanduser()) is None else ResultsStore(path, create=False)


def damage_note(db: str | Path, damaged: Sequence[tuple[int, str]]) -> str:
    """One line for the rows a lookup could not replay: which, why (the first), and what happened instead."""
    ids = ", ".join(str(i) for i, _ in damaged[:5]) + (", …" if len(damaged) > 5 else "")
    return (
        f"{db}: stored result {ids} {'is' if len(damaged) == 1 else 'are'} damaged ({damaged[0][1]}) "
        "and not replayed; generating again"
    )


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _has_formats(conn: sqlite3.Connection) -> bool:
    known = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
    return conn.execute(known, (V4_TABLE,)).fetchone() is not None


def _model_column(conn: sqlite3.Connection) -> str:
    """The run's model name in a read (a file before v5 has none: its runs' models are known by fingerprint)."""
    columns = {row[1] for row in conn.execute("SELECT * FROM pragma_table_info('runs')")}
    return f", runs.{V5_COLUMN}" if V5_COLUMN in columns else ""


def _format_columns(conn: sqlite3.Connection) -> str:
    """The format's columns of a read (a file before v4 has none: its results ran under no recorded format)."""
    if not _has_formats(conn):
        return ""
    return (
        ", result_formats.kind AS format_kind, result_formats.sha256 AS format_sha256,"
        " result_formats.summary AS format_summary, result_formats.complete AS format_complete"
    )


def _format_join(conn: sqlite3.Connection) -> str:
    return " LEFT JOIN result_formats ON result_formats.result_id = results.id" if _has_formats(conn) else ""


def _with_format(data: dict[str, Any]) -> dict[str, Any]:
    """The row's format columns as one `format` value: {kind, sha256, summary, complete}, or None."""
    columns = {name: data.pop(f"format_{name}", None) for name in ("kind", "sha256", "summary", "complete")}
    if not isinstance(columns["kind"], str) or not isinstance(columns["sha256"], str):
        data["format"] = None
        return data
    complete = columns["complete"]
    columns["complete"] = None if complete is None else bool(complete)
    columns["summary"] = columns["summary"] if isinstance(columns["summary"], str) else ""
    data["format"] = columns
    return data


def _shown(row: sqlite3.Row) -> dict[str, Any]:
    try:
        return _with_format(decode_row(row))
    except DamagedRow as bad:
        data = dict(row)
        keep = ("id", "run_id", "run_time", "plan", "model", "model_fingerprint", "created")
        return {**{k: data[k] for k in keep if k in data}, "damaged": str(bad)}


_EVAL_INSERT = (
    "INSERT INTO evals (time, plan, plan_file, plan_hash, change, reference, reference_hash, text_source, text_hash,"
    " settings, figures) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _eval_values(r: EvalRow) -> tuple[Any, ...]:
    plain = (r.plan, r.plan_file, r.plan_hash, r.change, r.reference, r.reference_hash, r.text_source, r.text_hash)
    return (*plain, _dumps(r.settings), _dumps(r.figures))


def _eval_shown(row: sqlite3.Row) -> dict[str, Any]:
    data = dict(row)
    try:
        for column in ("settings", "figures"):
            value = json.loads(data[column])
            if not isinstance(value, dict):
                raise ValueError(f"its {column} is not an object")
            data[column] = value
    except (TypeError, ValueError) as bad:
        return {"id": data.get("id"), "plan": data.get("plan"), "damaged": str(bad)}
    return data
