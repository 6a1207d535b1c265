"""Runs a bound plan: stages in graph order, each measured, logged and checked.

Per stage the runner records wall time and memory before/after, writes structured events, and
checks that the stage wrote every slot it promised. A stage runs only while something still needs
it: when a slot is already filled (a cache hit), its writer and whatever only that writer needed
are skipped. On an error or Ctrl-C the `always` stages (release) still run, what finished is kept,
and the run ends with one clear line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import networkx as nx
import structlog

from llmplan.ownership import NotOurs, check_directory_ours, claim, write_file
from llmplan.plain_errors import plain_error

from .context import Context
from .findings import StageFailure
from .graph import DATA, FILL, build_graph, execution_order, upstream
from .memory import MemorySampler, device_bytes, peak_rss_bytes, rss_bytes
from .plan import BoundPlan
from .trace import chrome_trace


@dataclass
class StageRecord:
    id: str
    uses: str
    phase: str
    status: str  # ok | skipped | failed | not_run
    wall_s: float = 0.0
    rss_before: int = 0
    rss_after: int = 0
    device_before: int | None = None
    device_after: int | None = None
    reason: str = ""


@dataclass
class RunResult:
    run_dir: Path
    status: str  # ok | errors (some request ended in error: exit 3) | failed | interrupted
    exit_code: int
    message: str
    records: list[StageRecord] = field(default_factory=list)
    context: Context | None = None


Reporter = Callable[[StageRecord], None]
EXIT_REQUEST_ERRORS = 3  # the run finished, but at least one request ended with finish_reason "error"
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away


def make_run_dir(root: str | Path, plan_name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{stamp}-{plan_name}"
    candidate, n = base, 1
    while True:
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            return candidate
        except FileExistsError:
            n += 1
            candidate = base.with_name(f"{base.name}-{n}")


def write_text_atomic(path: Path, text: str) -> Path:
    """A temp file in the same folder renamed into place, so a crash never leaves half a file; only onto a path
    that is free or that llmplan wrote (llmplan/ownership.py: NotOurs otherwise), and claimed with a marker so
    the next run into the same directory may replace it."""
    return write_file(path, text)


def write_json(path: Path, data: Any, *, indent: int | None = 2) -> Path:
    """Atomic (see write_text_atomic)."""
    return write_text_atomic(path, json.dumps(data, indent=indent, default=str, ensure_ascii=False))


EVENTS_FILE = "events.jsonl"


def check_run_dir(run_dir: Path, what: str = "run directory") -> None:
    """Before anything is written or loaded: an existing run directory holds only files llmplan wrote (it may
    replace them), so a run never replaces or appends to a file of the user's (NotOurs names the first)."""
    check_directory_ours(run_dir, what)


def event_logger(events: Any, plan_name: str) -> Any:
    """A structlog logger writing one JSON object per event to the open file `events`."""
    return structlog.wrap_logger(
        structlog.WriteLogger(events),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(default=str, ensure_ascii=False),
        ],
    ).bind(plan=plan_name)


class Runner:
    def __init__(
        self,
        bound: BoundPlan,
        context: Context,
        run_dir: Path,
        *,
        until: str | None = None,
        only: set[str] | None = None,
        cleanup: bool = True,
        report: Reporter | None = None,
        debug: bool = False,
    ) -> None:
        """until: run that stage and what it depends on; only: run just these stages (and the always-stages);
        cleanup False: run the always-stages only when the run fails (a resident plan keeps what it loaded)."""
        self.bound = bound
        self.ctx = context
        self.run_dir = run_dir
        self.graph = build_graph(bound.stages)
        self.order = execution_order(self.graph)
        if until is not None:
            keep = upstream(self.graph, until)
            self.order = [s for s in self.order if s in keep]
        if only is not None:
            self.order = [s for s in self.order if s in only or self.graph.nodes[s]["stage"].cls.always]
        self.cleanup = cleanup
        self.report = report or (lambda record: None)
        self.debug = debug
        self.records: dict[str, StageRecord] = {}

    # --- the run ---------------------------------------------------------------------------------

    def run(self) -> RunResult:
        ctx = self.ctx
        ctx.plan = self.bound
        ctx.run_dir = self.run_dir
        try:  # `llmplan run` checked already; a Runner made elsewhere (a plugin, a server) is checked here
            check_run_dir(self.run_dir)
        except NotOurs as bad:
            return RunResult(self.run_dir, "failed", 1, str(bad), [], ctx)
        events_path = self.run_dir / EVENTS_FILE
        write_text_atomic(self.run_dir / "plan.resolved.yaml", self.bound.resolved_yaml())
        events = events_path.open("a", encoding="utf-8")
        claim(events_path, "log")  # a run killed before its end still leaves a log the next run may append to
        log = event_logger(events, self.bound.plan.name)
        ctx.log = log
        sampler = MemorySampler(self.bound.plan.observe.memory_interval_ms).start()
        load_before = _load_average()
        started_ns = time.perf_counter_ns()
        status, code, message = "ok", 0, "ok"
        ran: set[str] = set()
        previous: Any = None
        try:
            self._prepare()
            ctx.trace.add("prepare the stages", "engine", started_ns, time.perf_counter_ns())
            for stage_id in self.order:
                bound = self.graph.nodes[stage_id]["stage"]
                if bound.cls.always:
                    continue  # always-stages run last, in the finally block, whatever happened
                if not self._needed(stage_id, ran):
                    self._record(stage_id, "skipped", reason="outputs already available")
                    log.info("stage_skipped", stage=stage_id, reason="outputs already available")
                    continue
                self._run_stage(stage_id, sampler, log)
                ran.add(stage_id)
        except KeyboardInterrupt:
            status, code, message = "interrupted", 130, "interrupted (Ctrl-C); ran the cleanup stages"
            log.warning("run_interrupted")
            # The cleanup stages and the run's records must finish: a second Ctrl-C is not another
            # interrupt to handle half-way through them (restored when the run returns).
            previous = _ignore_sigint()
        except StageFailure as failure:
            status, code, message = "failed", 1, str(failure)
        except BrokenPipeError:  # `llmplan run … | head -1`: the reader left; not a bug, nothing to say
            status, code, message = "closed", EXIT_BROKEN_PIPE, "stdout was closed by the reader (broken pipe)"
            log.warning("stdout_closed")
        except Exception as bug:  # a stage's bug: one line for the user, the traceback in the run dir
            status, code = "failed", 1
            message = plain_error(bug)
            with contextlib.suppress(OSError, NotOurs):  # a full disk must not replace the failure's own message
                write_text_atomic(self.run_dir / "traceback.txt", traceback.format_exc())
            if self.debug:
                traceback.print_exc()
        finally:
            # A resident plan (cleanup False) keeps what it loaded unless the load failed.
            if self.cleanup or status != "ok":
                cleanup_error, cleanup_interrupted = self._run_always(sampler, log)
            else:
                cleanup_error, cleanup_interrupted = None, False
            if cleanup_interrupted and status != "interrupted":
                status, code, message = "interrupted", 130, "interrupted (Ctrl-C) during the cleanup stages"
                previous = _ignore_sigint()
            elif cleanup_error and status == "ok":
                status, code, message = "failed", 1, cleanup_error
            if status == "ok" and ctx.request_errors:
                # Everything ran, but some answers are errors: not a success a script may trust.
                status, code = "errors", EXIT_REQUEST_ERRORS
                listed = "; ".join(f"{rid}: {why}" for rid, why in list(ctx.request_errors.items())[:5])
                message = f"{len(ctx.request_errors)} request(s) ended in error ({listed})"
            finishing = time.perf_counter_ns()
            sampler.stop()
            failed = next((r for r in self.records.values() if r.status == "failed"), None)
            if failed is not None and status != "ok" and not message.startswith(f"stage {failed.id!r}"):
                message = f"stage {failed.id!r} ({failed.uses}): {message}"
            for stage_id in self.order:
                if stage_id not in self.records:
                    self._record(stage_id, "not_run")
            ended_ns = time.perf_counter_ns()
            ctx.trace.add("finish the run", "engine", finishing, ended_ns)
            total = (ended_ns - started_ns) / 1e9
            load = {"start": load_before, "end": _load_average(), "cpus": os.cpu_count()}
            log.info("run_finished", status=status, wall_s=round(total, 4), peak_rss=peak_rss_bytes())
            ctx.metrics.by_stage.setdefault("run", {}).update(
                {
                    "wall_s": total,
                    "status": status,
                    "peak_rss_bytes": peak_rss_bytes(),
                    "notices": ctx.notice_summary(),
                    "request_errors": dict(ctx.request_errors),
                    "load_average": load,
                }
            )
            ctx.trace.add(self.bound.plan.name, "run", started_ns, ended_ns, status=status)
            try:
                write_json(self.run_dir / "stages.json", [asdict(r) for r in self.records.values()])
                write_json(self.run_dir / "metrics.json", ctx.metrics.by_stage)
                write_json(self.run_dir / "memory.json", sampler.to_dict())
                write_json(
                    self.run_dir / "run.json",
                    {
                        "plan": self.bound.plan.name,
                        "status": status,
                        "message": message,
                        "wall_s": total,
                        "notices": len(ctx.notices),
                        "load_average": load,
                    },
                )
                trace = chrome_trace(
                    ctx.trace.spans, started_ns, f"llmplan run {self.bound.plan.name}", {"load_average": load}
                )
                write_json(self.run_dir / "trace.json", trace, indent=None)
                events.close()
                claim(events_path, "log")
            except OSError as unwritten:  # a full disk: said in one line, and never hiding the run's own failure
                said = f"the run's records were not written: {plain_error(unwritten)}"
                status, code = ("failed", 1) if status == "ok" else (status, code)
                message = said if message == "ok" else f"{message}; {said}"
                with contextlib.suppress(OSError):
                    events.close()
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        return RunResult(self.run_dir, status, code, message, list(self.records.values()), ctx)

    def _prepare(self) -> None:
        """Every stage of the plan, not only those --until keeps: a filter guards the stream either way."""
        for bound in self.bound.stages:
            self.ctx.metrics.current = bound.id
            try:
                bound.cls().prepare(self.ctx, bound.params)
            except StageFailure as bad:
                raise StageFailure(f"stage {bound.id!r} ({bound.spec.uses}): {bad}") from None

    # --- one stage -------------------------------------------------------------------------------

    def _run_stage(self, stage_id: str, sampler: MemorySampler, log: Any) -> None:
        span_start = time.perf_counter_ns()  # the trace's span includes the measuring around the stage
        bound = self.graph.nodes[stage_id]["stage"]
        ctx = self.ctx
        ctx.metrics.current = stage_id
        ctx.log = log.bind(stage=stage_id)
        record = StageRecord(stage_id, bound.spec.uses, str(bound.cls.phase), "failed")
        record.rss_before, record.device_before = rss_bytes(), device_bytes()
        self.records[stage_id] = record
        sampler.mark(stage_id, "start")
        log.info("stage_started", stage=stage_id, uses=bound.spec.uses)
        t0_ns = time.perf_counter_ns()
        try:
            bound.cls().run(ctx, bound.params)
            ctx.end_stream()  # a stage's stream ends with it: text a stream guard held back comes out now
            missing = [slot for slot in bound.cls.writes if not ctx.has(slot)]
            if missing:
                raise StageFailure(f"stage {stage_id!r} ({bound.spec.uses}) did not write {', '.join(missing)}")
            record.status = "ok"
        except BaseException as error:
            record.reason = failure_text(error)
            log.error("stage_failed", stage=stage_id, error=record.reason)
            raise
        finally:
            t1_ns = time.perf_counter_ns()
            record.wall_s = (t1_ns - t0_ns) / 1e9
            ctx.metrics.by_stage.setdefault(stage_id, {})["wall_s"] = record.wall_s
            record.rss_after, record.device_after = rss_bytes(), device_bytes()
            sampler.mark(stage_id, "end")
            if record.status == "ok":
                log.info(
                    "stage_finished",
                    stage=stage_id,
                    wall_s=round(record.wall_s, 6),
                    rss_before=record.rss_before,
                    rss_after=record.rss_after,
                    device_before=record.device_before,
                    device_after=record.device_after,
                )
            self.report(record)
            ctx.trace.add(
                stage_id,
                "stage",
                span_start,
                time.perf_counter_ns(),
                uses=bound.spec.uses,
                phase=record.phase,
                status=record.status,
                wall_s=record.wall_s,
            )

    def _run_always(self, sampler: MemorySampler, log: Any) -> tuple[str | None, bool]:
        """Run the `always` stages; (the first cleanup error, whether Ctrl-C hit one of them)."""
        error = None
        interrupted = False
        for stage_id in self.order:
            bound = self.graph.nodes[stage_id]["stage"]
            if not bound.cls.always:
                continue
            if any(not self.ctx.has(slot) for slot in bound.cls.reads):
                self._record(stage_id, "skipped", reason="inputs missing")
                continue
            try:
                self._run_stage(stage_id, sampler, log)
            except KeyboardInterrupt:  # an interrupt, not a failure of the stage: said as such
                interrupted = True
            except BaseException as bad:  # cleanup must not hide the original failure
                error = error or f"stage {stage_id!r}: {failure_text(bad)}"
        return error, interrupted

    def _needed(self, stage_id: str, ran: set[str]) -> bool:
        """Whether some remaining stage still needs this one's output (or it is a sink)."""
        return _needed(self.graph, stage_id, self.ctx, set(self.order), ran, {})

    def _record(self, stage_id: str, status: str, reason: str = "") -> None:
        bound = self.graph.nodes[stage_id]["stage"]
        record = StageRecord(stage_id, bound.spec.uses, str(bound.cls.phase), status, reason=reason)
        self.records[stage_id] = record
        if status == "skipped":
            self.report(record)


def failure_text(error: BaseException) -> str:
    """What a stage's failure says: its own message when it made one, else a plain sentence."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return str(error) if isinstance(error, StageFailure) else plain_error(error)


def _load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load average: a shared machine's timings are read against it."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _ignore_sigint() -> Any:
    """Ignore SIGINT (main thread only); returns the handler to restore, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.SIG_IGN)


def _needed(graph: nx.DiGraph, node: str, ctx: Context, active: set[str], ran: set[str], memo: dict[str, bool]) -> bool:
    if node in memo:
        return memo[node]
    bound = graph.nodes[node]["stage"]
    writes = set(bound.cls.writes)
    if writes and all(ctx.has(slot) for slot in writes) and node not in ran:
        memo[node] = False  # everything it would produce is already there
        return False
    consumers = [
        dst
        for dst in graph.successors(node)
        if dst in active
        and (graph.edges[node, dst]["kinds"] & {DATA, FILL})
        and not graph.nodes[dst]["stage"].cls.always
    ]
    if not consumers:
        memo[node] = True  # a sink: its effect is the point of the plan
        return True
    result = False
    for dst in consumers:
        slots = graph.edges[node, dst]["slots"]
        unfilled = any(not ctx.has(slot) for slot in slots) or not slots
        if unfilled and dst not in ran and _needed(graph, dst, ctx, active, ran, memo):
            result = True
            break
    memo[node] = result
    return result
