"""The results database (SQLite): every run's completions, for `llmplan history` and the result cache.

Safe for several processes at once: WAL journaling (readers never block the writer), a busy
timeout, and a retry loop on SQLITE_BUSY for the moments SQLite reports "locked" without waiting
(switching to WAL, upgrading a read transaction). A run and its results go in one transaction, so
a crash leaves either all of them or none. The schema carries its version in `schema_version`;
a database written by a newer llmplan is refused rather than misread.

The cache key lives here too, so the stage that looks results up and the stage that stores them
cannot disagree on it.
"""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

SCHEMA_VERSION = 1
# v2: the key covers every stage upstream of generation, the model files' content identity, the
# device and the precision. Rows stored under v1 keys (generation params only) can never match a v2
# key, so an old database is never misread: its rows stay as history and are simply not replayed.
CACHE_KEY_VERSION = "llmplan.cache/v2"
EXCERPT_CHARS = 200
BUSY_TIMEOUT_MS = 30_000
_RETRIES = 50
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
    run_dir TEXT
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
    created TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS results_cache_key ON results(cache_key);
CREATE INDEX IF NOT EXISTS results_run ON results(run_id);
"""


class StoreError(Exception):
    """The database cannot be used: not SQLite, a newer schema, or locked for too long. One line."""


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


@dataclass
class ResultRow:
    """One completion as stored; JSON-able fields are plain Python values here."""

    request_id: str
    prompt: str
    text: str
    tokens: list[int]
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, Any]
    candidates: list[dict[str, Any]]
    cache_key: str | None = None
    logprobs: list[float] | None = None
    error: str | None = None
    from_cache: bool = False


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


class ResultsStore:
    """One database file. Opening creates it (and its folder) unless `create=False`."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise StoreError(f"{self.path}: no results database here")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
            self._conn.row_factory = sqlite3.Row
            self._conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            _retry(lambda: self._conn.execute("PRAGMA journal_mode = WAL").fetchone())
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._conn.execute("PRAGMA foreign_keys = ON")
            self._init_schema(create)
        except sqlite3.DatabaseError as bad:
            self.close()
            raise StoreError(f"{self.path}: cannot use the results database ({bad})") from None

    def close(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
            self._conn = None  # type: ignore[assignment]

    def __enter__(self) -> ResultsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction: the write lock is taken up front, so it cannot deadlock later."""
        _retry(lambda: self._conn.execute("BEGIN IMMEDIATE"))
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        _retry(lambda: self._conn.execute("COMMIT"))

    def _init_schema(self, create: bool) -> None:
        tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "schema_version" not in tables:
            if not create:
                raise StoreError(f"{self.path}: not an llmplan results database (no schema_version table)")
            with self._write() as conn:
                # Statement by statement: executescript() would COMMIT our transaction first.
                for statement in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                    conn.execute(statement)
                if conn.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 0:
                    conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        row = self._conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        version = row[0] if row else None
        if version is None:
            raise StoreError(f"{self.path}: schema_version table is empty")
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: schema version {version} is newer than this llmplan supports ({SCHEMA_VERSION})"
            )

    # --- writing ---------------------------------------------------------------------------------

    def record_run(self, run: RunRow, results: Sequence[ResultRow]) -> int:
        """Insert a run and its results atomically; returns the run's id."""
        with self._write() as conn:
            run_id = self._insert_run(conn, run)
            self._insert_results(conn, run_id, results)
        return run_id

    def open_run(self, run: RunRow) -> int:
        """Insert a run whose results come later, batch by batch (`add_results`); returns its id."""
        with self._write() as conn:
            return self._insert_run(conn, run)

    def add_results(self, run_id: int, results: Sequence[ResultRow]) -> None:
        """One batch of an open run's results, in one transaction: a crash keeps whole batches only."""
        with self._write() as conn:
            self._insert_results(conn, run_id, results)

    def set_status(self, run_id: int, status: str) -> None:
        with self._write() as conn:
            conn.execute("UPDATE runs SET status = ? WHERE id = ?", (status, int(run_id)))

    @staticmethod
    def _insert_run(conn: sqlite3.Connection, run: RunRow) -> int:
        cursor = conn.execute(
            "INSERT INTO runs (time, plan, model_fingerprint, device, status, run_dir) VALUES (?, ?, ?, ?, ?, ?)",
            (_now(), run.plan, run.model_fingerprint, run.device, run.status, run.run_dir),
        )
        return int(cursor.lastrowid or 0)

    @staticmethod
    def _insert_results(conn: sqlite3.Connection, run_id: int, results: Sequence[ResultRow]) -> None:
        now = _now()
        conn.executemany(
            "INSERT INTO results (run_id, cache_key, request_id, prompt_excerpt, text, tokens, finish_reason,"
            " usage, timings, logprobs, candidates, error, from_cache, created)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    run_id,
                    r.cache_key,
                    r.request_id,
                    excerpt(r.prompt),
                    r.text,
                    _dumps(r.tokens),
                    r.finish_reason,
                    _dumps(r.usage),
                    _dumps(r.timings),
                    None if r.logprobs is None else _dumps(r.logprobs),
                    _dumps(r.candidates),
                    r.error,
                    int(r.from_cache),
                    now,
                )
                for r in results
            ],
        )

    # --- reading ---------------------------------------------------------------------------------

    def lookup(self, key: str) -> dict[str, Any] | None:
        """The newest freshly generated (not itself replayed) result stored under `key`."""
        row = _retry(
            lambda: self._conn.execute(
                "SELECT results.*, runs.time AS run_time, runs.plan AS run_plan, runs.run_dir AS run_dir FROM results"
                " JOIN runs ON runs.id = results.run_id"
                " WHERE cache_key = ? AND from_cache = 0 AND error IS NULL"
                " ORDER BY results.id DESC LIMIT 1",
                (key,),
            ).fetchone()
        )
        return None if row is None else _result_dict(row)

    def history(self, limit: int = 20) -> list[dict[str, Any]]:
        rows = _retry(
            lambda: self._conn.execute(
                "SELECT results.*, runs.time AS run_time, runs.plan, runs.model_fingerprint, runs.device,"
                " runs.status FROM results JOIN runs ON runs.id = results.run_id"
                " ORDER BY results.id DESC LIMIT ?",
                (int(limit),),
            ).fetchall()
        )
        return [_result_dict(r) for r in rows]

    def get(self, result_id: int) -> dict[str, Any] | None:
        row = _retry(
            lambda: self._conn.execute(
                "SELECT results.*, runs.time AS run_time, runs.plan, runs.model_fingerprint, runs.device,"
                " runs.status, runs.run_dir FROM results JOIN runs ON runs.id = results.run_id"
                " WHERE results.id = ?",
                (int(result_id),),
            ).fetchone()
        )
        return None if row is None else _result_dict(row)

    def count(self, table: str = "results") -> int:
        if table not in ("results", "runs"):
            raise ValueError(table)
        return int(self._conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def excerpt(prompt: str, limit: int = EXCERPT_CHARS) -> str:
    """Head and tail of a long prompt: a chat prompt starts with the system text, ends with the question."""
    if len(prompt) <= limit:
        return prompt
    head = limit // 4
    return prompt[:head] + " … " + prompt[-(limit - head - 3) :]


def open_existing(path: str | Path) -> ResultsStore | None:
    """The store at `path` if the file exists (lookups must not create databases), else None."""
    return ResultsStore(path, create=False) if Path(path).is_file() else None


_JSON_COLUMNS = ("tokens", "usage", "timings", "logprobs", "candidates")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _result_dict(row: sqlite3.Row) -> dict[str, Any]:
    data = dict(row)
    for column in _JSON_COLUMNS:
        if data.get(column) is not None:
            data[column] = json.loads(data[column])
    data["from_cache"] = bool(data.get("from_cache"))
    return data
