"""The driver's one writer of a distributed run: results as they arrive, to JSONL shards in the run directory
and to the results database, each request exactly once.

Shards are `RUN_DIR/results/part-NNNNN.jsonl` (one `llmplan.result/v2` object per line, a new part every
`shard_rows` rows), appended and flushed batch by batch. The database gets each batch in one transaction,
after its lines are flushed, so a crash loses at most the batch in flight: the next run finds every stored
request by its cache key and generates only the rest. A request id seen twice (a batch Ray ran again after
a replica died, whose first answer had already arrived) is kept once and counted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from llmplan.ownership import check_writable, claim
from llmplan.stages.results.store import ResultRow, ResultsStore, RunRow

SHARD_ROWS = 10_000


class ResultShards:
    def __init__(self, run_dir: Path, db: str | Path, run: RunRow, *, shard_rows: int = SHARD_ROWS) -> None:
        self.folder = run_dir / "results"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shard_rows = shard_rows
        self.store = ResultsStore(db)
        self.run_id = self.store.open_run(run)
        self.seen: set[str] = set()
        self.duplicates = 0
        self.errors: dict[str, str] = {}
        self._handle: IO[str] | None = None
        self._in_shard = 0
        self._shards = 0

    def add(self, results: Sequence[dict[str, Any]], rows: Sequence[ResultRow]) -> int:
        """Write one batch (result objects and their database rows, in the same order); returns how many
        were new. A request id already written by this run is dropped."""
        fresh = [(r, row) for r, row in zip(results, rows, strict=True) if r["id"] not in self.seen]
        self.duplicates += len(results) - len(fresh)
        for result, _ in fresh:
            self.seen.add(result["id"])
            if result.get("finish_reason") == "error" or result.get("error"):
                self.errors[result["id"]] = result.get("error") or "error"
            handle = self._shard()
            handle.write(json.dumps(result, ensure_ascii=False, default=str) + "\n")
            self._in_shard += 1
        if self._handle is not None:
            self._handle.flush()
        if fresh:
            self.store.add_results(self.run_id, [row for _, row in fresh])
        return len(fresh)

    def _shard(self) -> IO[str]:
        if self._handle is None or self._in_shard >= self.shard_rows:
            if self._handle is not None:
                self._close_shard()
            part = self.folder / f"part-{self._shards:05d}.jsonl"
            check_writable(part, "log")  # appended to: a shard of an earlier run llmplan wrote, or a new one
            self._handle = part.open("a", encoding="utf-8")
            claim(part, "log")
            self._shards += 1
            self._in_shard = 0
        return self._handle

    def _close_shard(self) -> None:
        assert self._handle is not None
        self._handle.close()
        claim(Path(self._handle.name), "log")  # so the next run into this directory may append to it

    def close(self, status: str) -> None:
        try:
            if self._handle is not None:
                self._close_shard()
            self.store.set_status(self.run_id, status)
        finally:
            self.store.close()


def read_shards(run_dir: Path) -> list[dict[str, Any]]:
    """Every result object of a run's shards, in file order."""
    found = []
    for part in sorted((run_dir / "results").glob("part-*.jsonl")):
        with part.open(encoding="utf-8") as handle:
            found += [json.loads(line) for line in handle if line.strip()]
    return found
