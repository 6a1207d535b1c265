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
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from llmplan.data_home import in_home
from llmplan.ownership import NotOurs, check_directory_ours, claim, write_file
from llmplan.plain_errors import plain_error

from .context import Context
from .findings import StageFailure
from .memory import MemorySampler, device_bytes, peak_rss_bytes, rss_bytes
from .plan import BoundPlan
from .stage_loop import NOT_NEEDED, StageLoop, failure_text
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
    """A fresh `<time>-<plan>` directory under `root` (a plan's `runs_dir`: relative ones are under the data home)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = in_home(root) / f"{stamp}-{plan_name}"
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
    import structlog  # here, not at the top: commands that never run a plan stay quick to start

    return structlog.wrap_logger(
        structlog.WriteLogger(events),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(default=str, ensure_ascii=False),
        ],
    ).bind(plan=plan_name)


@dataclass
class _Outcome:
    """How the run is ending, as it is learnt: the status, its exit code and its one line."""

    status: str = "ok"
    code: int = 0
    message: str = "ok"
    previous_sigint: Any = None  # the SIGINT handler to restore once the records are written

    def set(self, status: str, code: int, message: str) -> None:
        self.status, self.code, self.message = status, code, message


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
        part = bound.graph  # the plan's one graph; what this run runs is a part of it
        if until is not None:
            part = part.to_nodes(until)
        if only is not None:
            part = part.where(lambda stage: stage.id in only or stage.cls.always)
        self.part = part
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
        write_text_atomic(self.run_dir / "plan.resolved.yaml", self.bound.resolved_yaml())
        self._open_log()
        self.sampler = MemorySampler(self.bound.plan.observe.memory_interval_ms).start()
        load_before = _load_average()
        started_ns = time.perf_counter_ns()
        loop = StageLoop(self.part, ctx, self)
        outcome = _Outcome()
        try:
            self._steps(loop, outcome, started_ns)
        finally:
            self._clean_up(loop, outcome)
            self._finish(outcome, started_ns, load_before)
            if outcome.previous_sigint is not None:
                signal.signal(signal.SIGINT, outcome.previous_sigint)
        return RunResult(self.run_dir, outcome.status, outcome.code, outcome.message, list(self.records.values()), ctx)

    def _open_log(self) -> None:
        self.events_path = self.run_dir / EVENTS_FILE
        self.events = self.events_path.open("a", encoding="utf-8")
        claim(self.events_path, "log")  # a run killed before its end still leaves a log the next run may append to
        self.log = event_logger(self.events, self.bound.plan.name)
        self.ctx.log = self.log

    def _steps(self, loop: StageLoop, outcome: _Outcome, started_ns: int) -> None:
        """Prepare every stage, run the part; a failure becomes the outcome (the always-stages run after)."""
        try:
            loop.prepare(self.bound.stages)  # every stage, not only those --until keeps: a filter guards the stream
            self.ctx.trace.add("prepare the stages", "engine", started_ns, time.perf_counter_ns())
            loop.run()  # always-stages run last, in _clean_up, whatever happened
        except KeyboardInterrupt:
            outcome.set("interrupted", 130, "interrupted (Ctrl-C); ran the cleanup stages")
            self.log.warning("run_interrupted")
            # The cleanup stages and the run's records must finish: a second Ctrl-C is not another
            # interrupt to handle half-way through them (restored when the run returns).
            outcome.previous_sigint = _ignore_sigint()
        except StageFailure as failure:
            outcome.set("failed", 1, str(failure))
        except BrokenPipeError:  # `llmplan run … | head -1`: the reader left; not a bug, nothing to say
            outcome.set("closed", EXIT_BROKEN_PIPE, "stdout was closed by the reader (broken pipe)")
            self.log.warning("stdout_closed")
        except Exception as bug:  # a stage's bug: one line for the user, the traceback in the run dir
            outcome.set("failed", 1, plain_error(bug))
            with contextlib.suppress(OSError, NotOurs):  # a full disk must not replace the failure's own message
                write_text_atomic(self.run_dir / "traceback.txt", traceback.format_exc())
            if self.debug:
                traceback.print_exc()

    def _clean_up(self, loop: StageLoop, outcome: _Outcome) -> None:
        # A resident plan (cleanup False) keeps what it loaded unless the load failed.
        if self.cleanup or outcome.status != "ok":
            cleanup_error, cleanup_interrupted = loop.run_always()
        else:
            cleanup_error, cleanup_interrupted = None, False
        if cleanup_interrupted and outcome.status != "interrupted":
            outcome.set("interrupted", 130, "interrupted (Ctrl-C) during the cleanup stages")
            outcome.previous_sigint = _ignore_sigint()
        elif cleanup_error and outcome.status == "ok":
            outcome.set("failed", 1, cleanup_error)
        errors = self.ctx.request_errors
        if outcome.status == "ok" and errors:
            # Everything ran, but some answers are errors: not a success a script may trust.
            listed = "; ".join(f"{rid}: {why}" for rid, why in list(errors.items())[:5])
            outcome.set("errors", EXIT_REQUEST_ERRORS, f"{len(errors)} request(s) ended in error ({listed})")

    def _finish(self, outcome: _Outcome, started_ns: int, load_before: list[float] | None) -> None:
        """The records of the run: the failed stage named in the message, not_run stages, metrics, files."""
        ctx = self.ctx
        finishing = time.perf_counter_ns()
        self.sampler.stop()
        failed = next((r for r in self.records.values() if r.status == "failed"), None)
        if failed is not None and outcome.status != "ok" and not outcome.message.startswith(f"stage {failed.id!r}"):
            outcome.message = f"stage {failed.id!r} ({failed.uses}): {outcome.message}"
        for stage_id in self.part.order:
            if stage_id not in self.records:
                self._record(stage_id, "not_run")
        ended_ns = time.perf_counter_ns()
        ctx.trace.add("finish the run", "engine", finishing, ended_ns)
        total = (ended_ns - started_ns) / 1e9
        load = {"start": load_before, "end": _load_average(), "cpus": os.cpu_count()}
        self.log.info("run_finished", status=outcome.status, wall_s=round(total, 4), peak_rss=peak_rss_bytes())
        ctx.metrics.by_stage.setdefault("run", {}).update(
            {
                "wall_s": total,
                "status": outcome.status,
                "peak_rss_bytes": peak_rss_bytes(),
                "notices": ctx.notice_summary(),
                "request_errors": dict(ctx.request_errors),
                "load_average": load,
            }
        )
        ctx.trace.add(self.bound.plan.name, "run", started_ns, ended_ns, status=outcome.status)
        try:
            self._write_records(outcome, total, load, started_ns)
        except OSError as unwritten:  # a full disk: said in one line, and never hiding the run's own failure
            said = f"the run's records were not written: {plain_error(unwritten)}"
            if outcome.status == "ok":
                outcome.status, outcome.code = "failed", 1
            outcome.message = said if outcome.message == "ok" else f"{outcome.message}; {said}"
            with contextlib.suppress(OSError):
                self.events.close()

    def _write_records(self, outcome: _Outcome, total: float, load: dict[str, Any], started_ns: int) -> None:
        ctx, name = self.ctx, self.bound.plan.name
        write_json(self.run_dir / "stages.json", [asdict(r) for r in self.records.values()])
        write_json(self.run_dir / "metrics.json", ctx.metrics.by_stage)
        write_json(self.run_dir / "memory.json", self.sampler.to_dict())
        write_json(
            self.run_dir / "run.json",
            {
                "plan": name,
                "status": outcome.status,
                "message": outcome.message,
                "wall_s": total,
                "notices": len(ctx.notices),
                "load_average": load,
            },
        )
        trace = chrome_trace(ctx.trace.spans, started_ns, f"llmplan run {name}", {"load_average": load})
        write_json(self.run_dir / "trace.json", trace, indent=None)
        self.events.close()
        claim(self.events_path, "log")

    # --- around one stage (the StageLoop's watch) -------------------------------------------------

    def skipped(self, stage_id: str, reason: str) -> None:
        self._record(stage_id, "skipped", reason=reason)
        if reason == NOT_NEEDED:
            self.log.info("stage_skipped", stage=stage_id, reason=reason)

    @contextlib.contextmanager
    def running(self, stage_id: str) -> Iterator[None]:
        """Measure, log and trace one stage; its record says ok only when it ran to its end."""
        span_start = time.perf_counter_ns()  # the trace's span includes the measuring around the stage
        bound = self.part.stage(stage_id)
        ctx, log = self.ctx, self.log
        ctx.log = log.bind(stage=stage_id)
        record = StageRecord(stage_id, bound.spec.uses, str(bound.cls.phase), "failed")
        record.rss_before, record.device_before = rss_bytes(), device_bytes()
        self.records[stage_id] = record
        self.sampler.mark(stage_id, "start")
        log.info("stage_started", stage=stage_id, uses=bound.spec.uses)
        t0_ns = time.perf_counter_ns()
        try:
            yield
            record.status = "ok"
        except BaseException as error:
            record.reason = failure_text(error)
            log.error("stage_failed", stage=stage_id, error=record.reason)
            raise
        finally:
            self._stage_ended(record, t0_ns, span_start)

    def _stage_ended(self, record: StageRecord, t0_ns: int, span_start: int) -> None:
        ctx, stage_id = self.ctx, record.id
        record.wall_s = (time.perf_counter_ns() - t0_ns) / 1e9
        ctx.metrics.by_stage.setdefault(stage_id, {})["wall_s"] = record.wall_s
        record.rss_after, record.device_after = rss_bytes(), device_bytes()
        self.sampler.mark(stage_id, "end")
        if record.status == "ok":
            self.log.info(
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
            uses=record.uses,
            phase=record.phase,
            status=record.status,
            wall_s=record.wall_s,
        )

    def _record(self, stage_id: str, status: str, reason: str = "") -> None:
        bound = self.part.stage(stage_id)
        record = StageRecord(stage_id, bound.spec.uses, str(bound.cls.phase), status, reason=reason)
        self.records[stage_id] = record
        if status == "skipped":
            self.report(record)


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
