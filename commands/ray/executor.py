"""`llmplan run PLAN --executor ray`: the same plan, its requests spread over N replicas on a Ray cluster.

The driver (this process) runs the plan up to its tokenize stage (environment, model files, tokenizer:
no weights are loaded here), keys every request as the results cache does, and looks each key up in the
results database: a stored answer is replayed, the rest become a Ray Dataset. `map_batches` hands them,
`batch_size` at a time, to a pool of `replicas` actors (commands/ray/replica.py): each loads the plan's resident
stages once and runs the request stages per batch. Results stream back to the driver, the one writer of the
JSONL shards and the database (commands/ray/result_shards.py), so a run killed half-way resumes where it
stopped, and a replica that dies is restarted by Ray with its batches retried (`max_restarts`).

Keys match across runs when the replicas resolve what the driver assumes: threads = threads_per_replica,
and the device: CPU when no GPU is reserved (a plan's `device: auto` is pinned to cpu then), else cuda:0.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any, TextIO

from llmplan.data_home import default_db
from llmplan.engine.cli import CliError, new_context
from llmplan.engine.console import RichProgress, print_stage, stderr
from llmplan.engine.executors import ExecutorJob, ExecutorMissing
from llmplan.engine.plan import BoundPlan, bind
from llmplan.engine.runner import Runner, RunResult, write_json
from llmplan.ownership import check_writable, claim
from llmplan.stages import completion_rendering as output_format
from llmplan.stages.cache_stages import (
    generation_params,
    key_context,
    report_damaged,
    request_key,
    result_row,
    stored_result,
)
from llmplan.stages.results.store import ResultRow, RunRow, StoreError, open_existing
from llmplan.stages.slots import InferenceContext

from .replica import TOKENIZE, PlanReplica, encode_request, key_stage
from .result_shards import ResultShards, read_shards

OnBatch = Callable[[str, int], None]  # (the replica that answered "host:pid", rows written so far)


MISSING = "executor 'ray' needs Ray, which is not installed: pip install 'llmplan[ray]'"


class RayExecutor:
    """The `llmplan.executors` entry point `ray`."""

    def check(self) -> None:
        try:
            import ray  # an optional extra
            import ray.data  # noqa: F401
        except ImportError:
            raise ExecutorMissing(MISSING) from None

    def __call__(self, job: ExecutorJob) -> int:
        return execute(job)


RAY = RayExecutor()


def execute(job: ExecutorJob, on_batch: OnBatch | None = None) -> int:
    try:
        import ray  # an optional extra: said in one line when it is missing
        import ray.data
    except ImportError:
        raise CliError(MISSING) from None
    bound = _bind_for_ray(job)

    # 1. The driver's part: the plan up to tokenize (no weights), then a key per request.
    ctx, prepared = _run_to_tokenize(job, bound)
    if prepared.exit_code:
        if prepared.status != "interrupted":
            print(f"error: {prepared.message}", file=sys.stderr)
        return prepared.exit_code
    requests = ctx.requests or []
    keys, gen_params = _request_keys(ctx, bound, requests)
    db, mode = store_settings(bound)

    # 2. What the database already holds is replayed; the rest goes to the cluster.
    stored = lookup(db, keys) if mode == "reuse" else {}
    assert ctx.model_source is not None
    fingerprint = ctx.model_source.fingerprint
    shards = ResultShards(
        job.run_dir,
        db,
        RunRow(bound.plan.name, fingerprint, ctx.device, "running", str(job.run_dir), ctx.model_source.name),
    )
    metrics: dict[str, Any] = {
        "kind": "ray",
        **job.bound.plan.executor.model_dump(exclude={"kind"}),
        "requests": len(requests),
        "db": str(db),
    }
    started = time.perf_counter()
    status = "failed"
    try:
        replayed = [r for r in requests if r.id in stored]
        if replayed:
            completions = [stored_result(r, stored[r.id], gen_params) for r in replayed]
            results = [output_format.result_object(c, plan=bound.plan.name, model=fingerprint) for c in completions]
            shards.add(results, [result_row(c, keys[c.request_id]) for c in completions])
            _print_json(job, results, sys.stdout)
        pending = [r for r in requests if r.id not in stored]
        metrics.update({"replayed": len(replayed), "generated_requests": 0, "generated_tokens": 0})
        if replayed:
            stderr.print(f"replayed from the results database {db}: {len(replayed)} of {len(requests)} request(s)")
        if pending:
            _generate_logged(job, bound, pending, keys, shards, ctx, metrics, on_batch)
        status = "errors" if shards.errors else "ok"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except ray.exceptions.RayError as bad:  # a replica that cannot load, a cluster that went away
        if job.debug:
            raise
        where = f"{job.run_dir / 'ray.log'}, /tmp/ray/session_latest/logs"
        raise CliError(f"ray executor: {explain(bad)} (Ray's own messages: {where})") from None
    finally:
        _close_run(job, ctx, shards, metrics, status, started, bound.plan.name)
    return _conclude(job, bound, requests, shards, metrics, fingerprint)


def _bind_for_ray(job: ExecutorJob) -> BoundPlan:
    """The plan bound with the replicas' overrides; refused unless it tokenizes and detokenizes."""
    overrides = [*job.overrides, *replica_overrides(job.bound)]
    bound = bind(job.bound.source, job.registry, overrides)
    if _tokenize_id(bound) is None or not any(s.spec.uses == "output.detokenize" for s in bound.stages):
        raise CliError(f"{bound.source.file}: the ray executor needs a {TOKENIZE} and an output.detokenize stage")
    return bound


def _tokenize_id(bound: BoundPlan) -> str | None:
    """The id of the plan's tokenize stage, where the driver's part ends."""
    return next((s.id for s in bound.stages if s.spec.uses == TOKENIZE), None)


def _run_to_tokenize(job: ExecutorJob, bound: BoundPlan) -> tuple[InferenceContext, RunResult]:
    """Run the plan on the driver up to its tokenize stage (no weights are loaded here)."""
    ctx: InferenceContext = new_context(job.registry, bound, json_mode=True)  # type: ignore[assignment]
    ctx.progress = RichProgress(enabled=not job.quiet)
    report = None if job.quiet else print_stage
    until = _tokenize_id(bound)
    prepared = Runner(bound, ctx, job.run_dir, until=until, report=report, debug=job.debug).run()
    if not prepared.exit_code and job.bound.plan.executor.gpus_per_replica > 0:
        # the replicas' device, which the keys name (see the module docstring)
        ctx.device = bound.plan.device if bound.plan.device.startswith("cuda:") else "cuda:0"
    return ctx, prepared


def _request_keys(ctx: InferenceContext, bound: BoundPlan, requests: list[Any]) -> tuple[dict[str, str], Any]:
    """(request id -> its results-database key, the generation settings the keys were made with)."""
    stage = key_stage(bound)
    gen_params, seed = generation_params(ctx, stage)
    context = key_context(ctx, stage)
    return {r.id: request_key(ctx, r, gen_params, seed, context) for r in requests}, gen_params


def _generate_logged(
    job: ExecutorJob,
    bound: BoundPlan,
    pending: list[Any],
    keys: dict[str, str],
    shards: ResultShards,
    ctx: InferenceContext,
    metrics: dict[str, Any],
    on_batch: OnBatch | None,
) -> None:
    """`_generate`, with Ray's driver notices (a task retried after a replica died), which it prints on
    stdout, the stream for results, sent to the run directory's ray.log instead."""
    results_out = sys.stdout
    log_path = job.run_dir / "ray.log"
    check_writable(log_path, "log")  # appended to: only llmplan's own log (the run dir was checked)
    with log_path.open("a", encoding="utf-8") as ray_log, redirect_stdout(ray_log):
        claim(log_path, "log")
        _generate(job, bound, pending, keys, shards, ctx, metrics, on_batch, results_out)
    claim(log_path, "log")


def _close_run(
    job: ExecutorJob,
    ctx: InferenceContext,
    shards: ResultShards,
    metrics: dict[str, Any],
    status: str,
    started: float,
    plan_name: str,
) -> None:
    """The run's closing metrics, the shards closed with its status, the run record written."""
    metrics.update(
        {
            "wall_s": time.perf_counter() - started,
            "written": len(shards.seen),
            "duplicates_dropped": shards.duplicates,
            "results_dir": str(shards.folder),
        }
    )
    shards.close(status)
    _finish(job.run_dir, ctx, metrics, status, plan_name)


def _conclude(
    job: ExecutorJob,
    bound: BoundPlan,
    requests: list[Any],
    shards: ResultShards,
    metrics: dict[str, Any],
    fingerprint: str,
) -> int:
    """The exit code once every shard is in: 1 for a request without a result, 3 for any in error; the
    plan's JSON files are written when none is missing."""
    missing = len(requests) - len(shards.seen)
    if missing:  # every request once, or the run failed: never a silent gap
        print(f"error: {missing} request(s) have no result", file=sys.stderr)
        return 1
    deliver(bound, job.run_dir, [r.id for r in requests], fingerprint)
    if not job.quiet:
        stderr.print(_summary(metrics, shards))
    if shards.errors:
        listed = "; ".join(f"{rid}: {why}" for rid, why in list(shards.errors.items())[:5])
        print(f"error: {len(shards.errors)} request(s) ended in error ({listed})", file=sys.stderr)
        return 3
    return 0


def deliver(bound: BoundPlan, run_dir: Path, order: list[str], model: str) -> None:
    """The plan's output.write JSON files, written once every result is in (in request order), as a local run
    writes them. Its terminal and text/Markdown sinks are not run for a distributed set (the shards are its
    results); that is said in one line."""
    from llmplan.stages import output_write

    for stage in bound.stages:
        if stage.spec.uses != "output.write":
            continue
        files = output_write.file_sinks(stage.params)
        left = [sink for sink in stage.params.to if isinstance(sink, str)] + [
            f"{kind}: {path}" for kind, path in files if kind != "json"
        ]
        json_files = [path for kind, path in files if kind == "json"]
        if json_files:
            by_id = {r["id"]: r for r in read_shards(run_dir)}
            results = [by_id[rid] for rid in order]
            for path in json_files:
                chunks = output_format.json_document_chunks(results, plan=bound.plan.name, model=model)
                output_write.atomic_write(path, chunks, "json")
        if left:
            stderr.print(f"ray executor: not run for a distributed set: the {', '.join(left)} sink(s)", style="dim")


def explain(error: BaseException) -> str:
    """One line from a Ray error: the replica's own message when there is one (it ends Ray's traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in reversed(lines):
        if "ReplicaError: " in line:
            return line.split("ReplicaError: ", 1)[1]
    return lines[-1] if lines else "the Ray task failed without a message (run with --debug for the traceback)"


def replica_overrides(bound: BoundPlan) -> list[str]:
    """What a replica runs with beyond the user's overrides: its threads, and a pinned device."""
    settings = bound.plan.executor
    extra = [f"threads={settings.threads_per_replica}"]
    if bound.plan.device == "auto":
        extra.append("device=cpu" if settings.gpus_per_replica == 0 else "device=cuda")
    return extra


def store_settings(bound: BoundPlan) -> tuple[str, str]:
    """(the results database, the lookup mode): the plan's cache stages decide; without them the default
    database and `reuse`, so that any distributed run can resume."""
    db, mode = str(default_db()), "reuse"
    for stage in bound.stages:
        if stage.spec.uses == "output.cache":
            db = stage.params.db
        elif stage.spec.uses == "cache.lookup":
            db, mode = stage.params.db, stage.params.mode
    return db, mode


def lookup(db: str, keys: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Request id -> its stored row, for every request whose key is in the database."""
    try:
        store = open_existing(db)
    except StoreError as bad:
        raise CliError(str(bad)) from None
    if store is None:
        return {}
    with store:
        found = {rid: store.lookup(key) for rid, key in keys.items()}
    if store.damaged:  # each a miss: generated again
        report_damaged(db, store.damaged)
    return {rid: row for rid, row in found.items() if row is not None}


def _generate(
    job: ExecutorJob,
    bound: BoundPlan,
    pending: list[Any],
    keys: dict[str, str],
    shards: ResultShards,
    ctx: InferenceContext,
    metrics: dict[str, Any],
    on_batch: OnBatch | None,
    results_out: TextIO,
) -> None:
    settings = bound.plan.executor
    t0 = time.perf_counter()
    answered = _submit(job, bound, pending)
    replicas: dict[str, int] = {}
    batch_seconds: list[float] = []
    mismatched = 0
    driver_s = 0.0  # the one writer's own time per batch: what caps a cluster of any size
    first_s: float | None = None
    with ctx.progress.task(f"requests on {settings.replicas} Ray replica(s)", total=len(pending)) as advance:
        for batch in answered.iter_batches(batch_size=None, batch_format="numpy"):
            handled = time.perf_counter()
            first_s = first_s if first_s is not None else handled - t0
            results = [json.loads(text) for text in batch["result"]]
            stored_rows = [ResultRow(**json.loads(text)) for text in batch["row"]]
            mismatched += sum(1 for row in stored_rows if row.cache_key and row.cache_key != keys.get(row.request_id))
            written = shards.add(results, stored_rows)
            _print_json(job, results, results_out)
            for notices in batch["notices"]:
                for notice in json.loads(str(notices)):
                    ctx.notice(notice["kind"], notice["message"])
            batch_seconds += [float(s) for s in batch["batch_s"] if s > 0]
            for replica in batch["replica"]:
                replicas[str(replica)] = replicas.get(str(replica), 0) + 1
            metrics["generated_requests"] += written
            metrics["generated_tokens"] += int(sum(batch["generated"]))
            advance(len(results))
            driver_s += time.perf_counter() - handled
            if on_batch is not None:
                on_batch(str(batch["replica"][0]), len(shards.seen))
    wall = time.perf_counter() - t0
    metrics.update(
        {
            "cluster_s": wall,
            "first_result_s": first_s,  # start-up: Ray, the actors and their model loads, the first batch
            "replicas_seen": replicas,
            "batches": len(batch_seconds),
            "batch_s_mean": sum(batch_seconds) / len(batch_seconds) if batch_seconds else None,
            "driver_s": driver_s,
            "tokens_per_s": metrics["generated_tokens"] / wall if wall > 0 else 0.0,
            "key_mismatches": mismatched,
        }
    )
    if mismatched:
        stderr.print(
            f"warning: {mismatched} result(s) were keyed differently by the replicas than by this driver "
            "(another device or model files?): a rerun will generate them again",
            style="yellow",
        )


def _submit(job: ExecutorJob, bound: BoundPlan, pending: list[Any]) -> Any:
    """Connect to (or start) the cluster and hand it the pending requests: the dataset of their answers,
    computed as it is read."""
    import ray
    import ray.data

    settings = bound.plan.executor
    _quiet_ray()
    if not ray.is_initialized():  # a caller (a test, a notebook) may have connected already
        ray.init(**init_args(settings.address))
    data_context = ray.data.DataContext.get_current()
    data_context.enable_progress_bars = False  # ours counts rows; Ray's would interleave with it
    data_context.print_on_execution_start = False
    rows = [{"request": encode_request(r)} for r in pending]
    blocks = max(1, math.ceil(len(rows) / settings.batch_size))
    dataset = ray.data.from_items(rows, override_num_blocks=blocks)
    with warnings.catch_warnings():
        # Ray 2.60 deprecates passing max_restarts through **ray_remote_args (from 2.64 Ray Data's own default,
        # unlimited restarts, applies); it is still the one way to bound them, and works from 2.30 on.
        warnings.filterwarnings("ignore", message=".*ray_remote_args.* is deprecated")
        return _map(ray, dataset, job, bound)


def init_args(address: str | None) -> dict[str, Any]:
    """ray.init's arguments: start a cluster here (None, "local": no dashboard), join one ("auto", HOST:PORT),
    or connect through Ray Client (ray://HOST:PORT, which takes no local-start options)."""
    if address is not None and address.startswith("ray://"):
        return {"address": address}
    # The replicas' own output stays in Ray's log files: what they have to say comes back with their results
    # (notices), and a failure as one line (`explain`).
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
    if address in (None, "local"):
        return {**quiet, "include_dashboard": False}
    return {**quiet, "address": address}


def _map(ray: Any, dataset: Any, job: ExecutorJob, bound: BoundPlan) -> Any:
    """The replicas: a fixed pool of actors, each holding the loaded plan, fed `batch_size` requests at a time."""
    settings = bound.plan.executor
    return dataset.map_batches(
        PlanReplica,
        fn_constructor_kwargs={
            "plan_file": bound.source.file,
            "plan_data": bound.source.data,
            "overrides": [*job.overrides, *replica_overrides(job.bound)],
            "cwd": os.getcwd(),
        },
        batch_size=settings.batch_size,
        batch_format="numpy",
        # one batch in flight a replica: a batch is minutes of decoding, so a second one queued behind it waits
        # while another replica may sit idle (Ray's default queues several per actor)
        compute=ray.data.ActorPoolStrategy(size=settings.replicas, max_tasks_in_flight_per_actor=1),
        num_cpus=settings.threads_per_replica,
        num_gpus=settings.gpus_per_replica or None,
        max_restarts=settings.max_restarts,
        max_task_retries=settings.max_restarts,
    )


def _quiet_ray() -> None:
    """No Ray usage-stats prompt or upload; Ray Data's log lines (its stack traces too: a failure is said in
    one line by this executor) stay in Ray's log files."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logging.getLogger("ray.data").setLevel(logging.CRITICAL)


def _print_json(job: ExecutorJob, results: list[dict[str, Any]], out: TextIO) -> None:
    """Under --json, one result object per line on stdout, as results arrive (nothing else goes there)."""
    if job.json_mode and results:
        out.write("".join(output_format.json_line(r) + "\n" for r in results))
        out.flush()


def _finish(run_dir: Path, ctx: InferenceContext, metrics: dict[str, Any], status: str, plan: str) -> None:
    """metrics.json and run.json of the whole run: the driver's stages, then the executor's numbers."""
    by_stage = dict(ctx.metrics.by_stage)
    by_stage["executor"] = metrics
    run = by_stage.setdefault("run", {})
    run.update({"status": status, "notices": ctx.notice_summary()})
    write_json(run_dir / "metrics.json", by_stage)
    message = "ok" if status == "ok" else status
    write_json(
        run_dir / "run.json",
        {"plan": plan, "status": status, "message": message, "wall_s": metrics["wall_s"], "executor": "ray"},
    )


def _summary(metrics: dict[str, Any], shards: ResultShards) -> str:
    text = (
        f"ray: {metrics['requests']} request(s): {metrics['replayed']} replayed, "
        f"{metrics['generated_requests']} generated"
    )
    if metrics.get("cluster_s"):
        text += (
            f" on {len(metrics.get('replicas_seen') or {})} replica process(es), {metrics['generated_tokens']} tokens, "
            f"{metrics['tokens_per_s']:.1f} tok/s"
        )
    return f"{text}; results in {shards.folder}"
