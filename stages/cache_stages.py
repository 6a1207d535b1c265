"""`cache.lookup` and `output.cache`: reuse stored results instead of generating, and store new ones.

The key of a request (results_store.cache_key) is the SHA-256 of the model fingerprint, the
prompt ids, the generation stage's parameters as the plan resolved them (`generate_stage`, dumped
to JSON; minus `stream`, which only changes how text is shown), the request's own overrides, the
plan seed, and `key_context`: the resolved parameters of EVERY stage the generation stage depends on
(walked upstream in the plan graph, so precision, KV cache, conversion, verification… all count,
including stages a future plugin adds), the content identity of every model file (its SHA-256 from
SHA256SUMS, else its size/mtime/ctime/inode), the resolved device, the plan's threads and the
llmplan version. Anything that could change the answer changes the key; at worst a key misses.

A replayed answer says so: a line on stderr naming the database and the run it came from,
`from_cache: true` in every result (`--json`, files, database), and `replayed_from` in the lookup
stage's metrics (metrics.json of the run).

A run generates unless a replay is asked for: `cache.lookup`'s mode is `off` by default, and only `reuse` (the
plan's, or `llmplan run --replay`) looks up. `cache.lookup` (mode `reuse`) fills `generations` only when EVERY
request is found: the runner
then skips the generate stage and everything only it needs (weights, model, KV cache). A partial
hit fills nothing and the whole batch is generated again — mixing replayed and fresh rows would
need a second, smaller batch for no real gain, and keeps the two paths simple. `refresh` and
`off` never fill. A missing database is a miss; the lookup never creates one. A stored row that
does not decode to a whole answer (result_rows.py) is a miss too, said once on stderr, never an answer.
`db` must be a regular file path (checked when the plan is read), and a file there that is not an
llmplan results database is refused before any stage runs, left exactly as it was (results_file.py).

`output.cache` stores every completion of the run (replayed ones marked `from_cache`, failed ones
without a key so they are never replayed) with the run's metadata, in one transaction.
Both stages must name the same `db` and `generate_stage`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from llmplan.data_home import in_home
from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage
from llmplan.llm.trust import MANIFEST_NAME, ManifestError, read_sha256sums

from .results.file import path_problem
from .results.rows import DamagedRow, check_replay
from .results.store import (
    DEFAULT_DB,
    ResultRow,
    ResultsStore,
    RunRow,
    StoreError,
    cache_key,
    damage_note,
    identify,
    open_existing,
)
from .slots import InferenceContext
from .types import Candidate, Generation, Request, Result, candidate_records

# Generation params that change how output is shown, never what is generated: not part of the key.
UNKEYED_PARAMS = frozenset({"stream"})
NOT_REPLAYED = frozenset({"cancelled", "error"})


class StoreParams(Params):
    db: str = Field(
        DEFAULT_DB,
        validate_default=True,
        description="the SQLite results database; a relative path is under the data home ($LLMPLAN_HOME, "
        "else $XDG_DATA_HOME/llmplan or ~/.local/share/llmplan), so every directory finds the same one",
    )
    generate_stage: str = Field("generate", description="id of the plan's generation stage (its params are keyed)")

    @field_validator("db")
    @classmethod
    def _regular_file(cls, value: str) -> str:
        # Refused at `validate`: an empty path, /dev/null, a directory or a FIFO can never hold the database
        # (SQLite would open a temporary one, or another file, and replay from it).
        problem = path_problem(value)
        if problem is None and value:  # resolved once, here: lookup, store, history and the report agree
            value = str(in_home(value))
            problem = path_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


class LookupParams(StoreParams):
    # off by default: a run generates unless the user asks for a replay (this mode, or `llmplan run --replay`)
    mode: Literal["reuse", "refresh", "off"] = Field(
        "off", description="reuse: replay when every request is stored (or `run --replay`); off/refresh: generate"
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `off` as false; that is what the user meant.
        return "off" if value is False else value


def generation_params(ctx: InferenceContext, stage_id: str) -> tuple[dict[str, Any], int]:
    """(the generation stage's resolved params as JSON, the plan seed) from the bound plan."""
    if ctx.plan is None:
        raise StageFailure("the cache needs the plan (to key on the generation parameters)")
    try:
        bound = ctx.plan.stage(stage_id)
    except KeyError:
        plan = ctx.plan.plan.name
        raise StageFailure(
            f"generate_stage: no stage with id {stage_id!r} in plan {plan!r} (set it to the generation stage's id)"
        ) from None
    dumped = bound.params.model_dump(mode="json")
    return {k: v for k, v in dumped.items() if k not in UNKEYED_PARAMS}, int(ctx.plan.plan.seed)


def upstream_params(ctx: InferenceContext, stage_id: str) -> list[dict[str, Any]]:
    """(uses, resolved params) of every stage `stage_id` depends on, from the plan graph.

    Fill edges (a cache lookup before generation) are not dependencies: the lookup does not decide
    what is generated. A stage that makes the requests is keyed by what it made (each request's
    prompt ids and overrides are in the key), not by its params: one new prompt in a batch must not
    invalidate the others. Stage ids are left out (renaming a stage changes nothing); the list is sorted.
    """
    assert ctx.plan is not None
    entries = []
    for node in ctx.plan.graph.depends_on(stage_id):
        bound = ctx.plan.stage(node)  # a served request's plan holds that request's own parameters
        if bound.cls.fills or "requests" in bound.cls.writes:
            continue
        entries.append({"uses": bound.spec.uses, "params": bound.params.model_dump(mode="json")})
    return sorted(entries, key=lambda e: json.dumps(e, sort_keys=True, default=str))


# Files a model directory may hold that no stage reads: never part of its identity.
_NOT_MODEL = {".llmplan-hashes.json"}


def model_identity(model_dir: Path) -> dict[str, str]:
    """File name -> content identity, for every regular file of the model directory.

    A file listed in SHA256SUMS is identified by that SHA-256 (what verify checks it against); any other
    file by (size, mtime_ns, ctime_ns, inode): no hashing on the lookup path, and any rewrite changes
    ctime (see llm/trust/hash_cache.py), so a changed unlisted file makes the key miss rather than replay.
    """
    sums: dict[str, str] = {}
    if (model_dir / MANIFEST_NAME).is_file():
        try:
            sums = read_sha256sums(model_dir / MANIFEST_NAME)
        except ManifestError as bad:
            raise StageFailure(str(bad)) from None
    identity: dict[str, str] = {}
    try:
        entries = sorted(os.scandir(model_dir), key=lambda e: e.name)
    except OSError as bad:
        raise StageFailure(f"{model_dir}: cannot list the model directory ({bad.strerror})") from None
    for entry in entries:
        if entry.name in _NOT_MODEL or entry.name.startswith("."):
            continue
        if entry.name in sums:
            identity[entry.name] = f"sha256:{sums[entry.name]}"
            continue
        try:
            st = entry.stat()
        except OSError:
            identity[entry.name] = "unreadable"
            continue
        if stat.S_ISREG(st.st_mode):
            identity[entry.name] = f"stat:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
    return identity


def key_context(ctx: InferenceContext, stage_id: str) -> dict[str, Any]:
    """Everything beyond the generation params that decides the answer (see the module docstring)."""
    from importlib.metadata import PackageNotFoundError, version

    assert ctx.plan is not None and ctx.model_source is not None
    try:
        release = version("llmplan")
    except PackageNotFoundError:
        release = "unknown"
    files = model_identity(ctx.model_source.model_dir)
    return {
        "upstream": upstream_params(ctx, stage_id),
        "files": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest(),
        "device": ctx.device,
        "threads": ctx.plan.plan.threads,
        "llmplan": release,
    }


def request_key(
    ctx: InferenceContext, request: Request, params: dict[str, Any], seed: int, context: dict[str, Any]
) -> str:
    assert ctx.model_source is not None
    return cache_key(ctx.model_source.fingerprint, request.prompt_ids, params, request.overrides, seed, context)


def _store_error(error: StoreError) -> StageFailure:
    return StageFailure(str(error))


def check_database(db: str) -> None:
    """StageFailure unless `db` is absent or our results database: before any stage runs, nothing written."""
    try:
        if not db.strip():
            raise StoreError("db is empty; give the results database's file path")
        identify(Path(db).expanduser())
    except StoreError as bad:
        raise _store_error(bad) from None


def deep_check_database(params: Any, deep: DeepCheck) -> None:
    try:
        check_database(params.db)
    except StageFailure as bad:
        deep.problem(str(bad), "db")


# Damaged rows already reported by this process: a server meets the same row once per request, says it once.
_REPORTED: set[tuple[str, int]] = set()


def report_damaged(db: str, damaged: list[tuple[int, str]]) -> None:
    """One line on stderr for the damaged rows a lookup treated as misses (each row once per process)."""
    fresh = [(i, why) for i, why in damaged if (db, i) not in _REPORTED]
    if fresh:
        _REPORTED.update((db, i) for i, _ in fresh)
        print(damage_note(db, fresh), file=sys.stderr)


class CacheLookup(Stage):
    """Replay stored generations when every request's key is in the results database."""

    name = "cache.lookup"
    phase = Phase.COMPUTE
    Params = LookupParams
    replay_setting = ("mode", "reuse", "off")
    reads = ("requests", "model_source")
    fills = ("generations",)

    def prepare(self, ctx: InferenceContext, params: Any) -> None:
        if params.mode == "reuse":
            check_database(params.db)

    def check(self, params: Any, deep: DeepCheck) -> None:
        if params.mode == "reuse":
            deep_check_database(params, deep)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.requests is not None
        ctx.metrics.set("mode", params.mode)
        if params.mode != "reuse":
            return
        gen_params, seed = generation_params(ctx, params.generate_stage)
        context = key_context(ctx, params.generate_stage)
        started = time.perf_counter()
        try:
            store = open_existing(params.db)
        except StoreError as bad:
            raise _store_error(bad) from None
        if store is None:
            ctx.metrics.set("hits", 0)
            ctx.metrics.set("misses", len(ctx.requests))
            return
        found: list[Result] = []
        sources: list[dict[str, Any]] = []
        vocab = ctx.tokenizer.vocab_size if ctx.tokenizer is not None else None
        with store:
            for request in ctx.requests:
                row = store.lookup(request_key(ctx, request, gen_params, seed, context))
                if row is not None:
                    limit = request.overrides.get("max_new_tokens", gen_params.get("max_new_tokens"))
                    try:
                        check_replay(row, vocab_size=vocab, max_new_tokens=limit if isinstance(limit, int) else None)
                    except DamagedRow as bad:
                        store.damaged.append((int(row["id"]), str(bad)))
                        row = None
                if row is None:
                    break
                found.append(_replay(request, row, gen_params))
                sources.append(_source(request, row))
        if store.damaged:
            report_damaged(params.db, store.damaged)
            ctx.metrics.set("damaged", [i for i, _ in store.damaged])
            ctx.log.info("cache_damaged_rows", rows=[{"result_id": i, "why": why} for i, why in store.damaged])
        hits = len(found)
        ctx.metrics.set("hits", hits)
        ctx.metrics.set("misses", len(ctx.requests) - hits)
        if ctx.requests and hits == len(ctx.requests):
            ctx.generations = found
            ctx.metrics.set("replayed", True)
            ctx.metrics.set("replayed_from", {"db": params.db, "results": sources})
            ctx.log.info("cache_hit", requests=hits, lookup_s=round(time.perf_counter() - started, 6), sources=sources)
            runs = sorted({str(s["run_id"]) for s in sources})
            # Said on stderr whatever the output mode: a replayed answer must never pass for a fresh one.
            print(
                f"replayed from the results cache: {hits} answer(s) from run {', '.join(runs)} of {params.db}; "
                "nothing was generated (asked by cache.lookup mode: reuse, or --replay; mode: off generates)",
                file=sys.stderr,
            )
        else:
            ctx.log.info("cache_miss", hits=hits, requests=len(ctx.requests))


def _source(request: Request, row: dict[str, Any]) -> dict[str, Any]:
    """Where a replayed answer came from: its stored result and the run that generated it."""
    return {
        "request": request.id,
        "result_id": row["id"],
        "run_id": row["run_id"],
        "run_time": row.get("run_time"),
        "run_dir": row.get("run_dir"),  # the report shows that run's pictures
    }


def _replay(request: Request, row: dict[str, Any], gen_params: dict[str, Any]) -> Result:
    usage = row.get("usage") or {}
    # The record's generation; not its timings: the original run's speed says nothing about this one.
    gen = Generation(
        prompt_tokens=int(usage.get("prompt_tokens", len(request.prompt_ids))),
        tokens=[int(t) for t in row["tokens"]],
        logprobs=[float(x) if x is not None else float("-inf") for x in row.get("logprobs") or []],
        finish_reason=row["finish_detail"],
    )
    return Result(
        request.id,
        gen,
        candidates=[
            # finish_detail: the decoded row has it, from whichever version wrote the row (result_rows.py)
            Candidate([int(t) for t in c.get("tokens", [])], float(c.get("score") or 0.0), c.get("finish_detail"))
            for c in row.get("candidates") or []
        ],
        params=gen_params,
        from_cache=True,
    )


def stored_result(request: Request, row: dict[str, Any], gen_params: dict[str, Any]) -> Result:
    """A stored answer as the result a run delivers, marked replayed, its text the stored one (the distributed
    executor's resume: made by the post-processing and filter of the run that generated it)."""
    result = _replay(request, row, gen_params)
    result.prompt = request.prompt_text
    result.user_text = request.user_text
    result.text = row["text"]
    result.candidate_texts = [str(c.get("text", "")) for c in row.get("candidates") or []]
    usage = row.get("usage") or {}
    if "completion_tokens" in usage and int(usage["completion_tokens"]) != len(result.tokens):
        result.redacted_tokens = int(usage["completion_tokens"])
    return result


class OutputCache(Stage):
    """Store the run's completions and metadata in the results database (history + cache)."""

    name = "output.cache"
    phase = Phase.OUTPUT
    Params = StoreParams
    reads = ("completions",)
    optional_reads = ("model_source", "requests")
    writes = ("cache_record",)

    def prepare(self, ctx: InferenceContext, params: Any) -> None:
        check_database(params.db)

    def check(self, params: Any, deep: DeepCheck) -> None:
        deep_check_database(params, deep)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.completions is not None
        fingerprint = ctx.model_source.fingerprint if ctx.model_source is not None else None
        keys: dict[str, str] = {}
        if ctx.model_source is not None and ctx.requests is not None:
            gen_params, seed = generation_params(ctx, params.generate_stage)
            context = key_context(ctx, params.generate_stage)
            keys = {r.id: request_key(ctx, r, gen_params, seed, context) for r in ctx.requests}
        rows = [result_row(c, keys.get(c.request_id)) for c in ctx.completions]
        plan = ctx.plan.plan.name if ctx.plan is not None else "-"
        status = "ok" if all(c.error is None for c in ctx.completions) else "errors"
        model = ctx.model_source.name if ctx.model_source is not None else None  # the model this run ran
        run = RunRow(plan, fingerprint, ctx.device, status, str(ctx.run_dir) if ctx.run_dir else None, model)
        try:
            with ResultsStore(params.db) as store:
                run_id = store.record_run(run, rows)
        except StoreError as bad:
            raise _store_error(bad) from None
        except (OSError, sqlite3.DatabaseError) as bad:
            reason = bad.strerror if isinstance(bad, OSError) and bad.strerror else str(bad)
            raise StageFailure(f"{params.db}: cannot write the results database ({reason})") from None
        ctx.cache_record = {
            "db": params.db,
            "run_id": run_id,
            "results": len(rows),
            "keys": [r.cache_key for r in rows],
        }
        ctx.metrics.set("run_id", run_id)
        ctx.metrics.set("stored", len(rows))


def result_row(c: Result, key: str | None) -> ResultRow:
    return ResultRow(
        request_id=c.request_id,
        prompt=c.user_text or c.prompt,  # the excerpt `history` and `show` print: the user's words
        text=c.text,
        tokens=list(c.tokens),
        finish_reason=c.finish_reason,
        finish_detail=c.finish_detail,
        usage={"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens},
        timings=dict(c.timings),
        candidates=candidate_records(c),
        # A failed, cancelled or filtered-out generation is history, not something to replay (a cancelled one
        # is cut wherever its client left; a filtered answer has no ids to replay).
        cache_key=key if c.error is None and not c.flagged and c.finish_detail not in NOT_REPLAYED else None,
        logprobs=list(c.logprobs) if c.logprobs else None,
        error=c.error,
        from_cache=c.from_cache,
        format=None if c.format_record is None else dict(c.format_record),
    )
