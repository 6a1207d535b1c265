"""A resident plan: what does not depend on a request runs once; the request stages run per request.

The split comes from the graph, not from stage names: a stage whose class says `per_request` (it turns one
request into context slots) and every stage downstream of it form the request part; the others (loading,
placing, allocating) form the resident part, run once by the ordinary `Runner` and kept. Each request then
runs on a context of its own — the resident slots shared, the request slots empty — so requests in flight
do not see each other's data, and its stages' parameters may be overridden for that request alone
(re-validated, so a request cannot pass what the plan's schema refuses). The always-stages (release) run
when the plan is unloaded.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llmplan.ownership import check_writable, claim

from .context import Context, Metrics
from .findings import StageFailure
from .graph import PlanGraph
from .messages import describe
from .plan import BoundPlan
from .runner import EVENTS_FILE, Runner, RunResult, event_logger
from .stage_loop import StageLoop, Timings


class ServeError(Exception):
    """The plan cannot serve requests; the message says why."""


class RequestError(ValueError):
    """A request's own values are wrong: `field` names the value (as the request spelled it, if known)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


@dataclasses.dataclass
class RequestRun:
    context: Context
    wall_s: float
    stages: dict[str, float]  # wall seconds per stage that ran


class ResidentPlan:
    def __init__(self, bound: BoundPlan, new_context: Callable[[], Context], run_dir: Path) -> None:
        self.bound = bound
        self._new_context = new_context
        self.run_dir = run_dir
        self.graph: PlanGraph = bound.graph  # the plan's one graph; the two parts below are parts of it
        entries = self.graph.where(lambda stage: stage.cls.per_request)
        if not entries:
            raise ServeError(f"{bound.source.file}: no stage takes requests (none is marked per_request)")
        downstream = self.graph.from_nodes(*entries)
        steps = self.graph.where(lambda stage: not stage.cls.always)
        self.request = steps.only(downstream)  # what runs per request
        self.resident = steps.without(downstream)  # what runs once, at load
        self.request_order = list(self.request.order)
        self.resident_ids = set(self.resident.order)
        self.request_slots = {slot for s in self.request for slot in self.request.stage(s).cls.writes}
        self.context: Context | None = None
        self.state = "unloaded"  # unloaded | loading | ready
        self._lock = threading.Lock()
        # Requests log to the run directory's events.jsonl for the plan's whole life (a load's Runner closes
        # its own handle when it ends); appends from two handles interleave whole lines.
        # Only a log llmplan wrote is appended to (llmplan/ownership.py); claimed so the Runner's check passes.
        events = run_dir / EVENTS_FILE
        check_writable(events, "log")
        self._events = events.open("a", encoding="utf-8", buffering=1)
        claim(events, "log")
        self.log = event_logger(self._events, bound.plan.name)

    def close(self) -> None:
        self._events.close()
        claim(Path(self._events.name), "log")

    def stage_by_use(self, uses: str) -> str | None:
        """The id of the first request stage that uses `uses` (e.g. "compute.generate"), if any."""
        return next((s for s in self.request if self.request.stage(s).spec.uses == uses), None)

    def params(self, stage_id: str) -> Any:
        return self.graph.stage(stage_id).params

    # --- the resident part ------------------------------------------------------------------------

    def load(self, report: Any = None) -> RunResult:
        """Run the resident stages (once; a second call while loaded does nothing)."""
        with self._lock:
            if self.state == "ready" and self.context is not None:
                return RunResult(self.run_dir, "ok", 0, "already loaded", [], self.context)
            self.state = "loading"
            ctx = self._new_context()
            result = Runner(self.bound, ctx, self.run_dir, only=self.resident_ids, cleanup=False, report=report).run()
            if result.exit_code:
                self.state = "unloaded"
                return result
            self.context, self.state = ctx, "ready"
            return result

    def unload(self) -> RunResult | None:
        """Run the always-stages (release) on the resident context and forget it."""
        with self._lock:
            ctx, self.context = self.context, None
            self.state = "unloaded"
            if ctx is None:
                return None
            always = set(self.graph.where(lambda stage: stage.cls.always))
            return Runner(self.bound, ctx, self.run_dir, only=always, cleanup=True).run()

    # --- one request ------------------------------------------------------------------------------

    def bind(self, overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """Per-request parameters: each stage's plan parameters updated by `overrides[stage_id]`, re-validated.

        Raises RequestError naming the stage's field on a value its schema refuses.
        """
        bound: dict[str, Any] = {}
        for stage_id, update in overrides.items():
            if stage_id not in self.request:
                raise RequestError("", f"stage {stage_id!r} is not a request stage of this plan")
            params = self.params(stage_id)
            try:
                bound[stage_id] = type(params).model_validate({**params.model_dump(), **update})
            except ValidationError as bad:
                first = bad.errors()[0]
                field = ".".join(str(p) for p in first["loc"])
                raise RequestError(field, describe(first)) from None
        return bound

    def run_request(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        stream: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        log: Any = None,
        skip: set[str] | frozenset[str] = frozenset(),
        given: Mapping[str, Any] | None = None,
    ) -> RequestRun:
        """Run the request stages (less `skip`) on a fresh request context. StageFailure and bugs propagate.

        `given`: request slots already made elsewhere (requests a driver tokenized for its replicas); the
        stages that would write only them are then not needed and do not run, as after a cache hit."""
        ctx = self._request_context(params, stream, cancel, log)
        for slot in self.request_slots:
            ctx.put(slot, None)
        for slot, value in (given or {}).items():
            ctx.put(slot, value)
        # a stage that will not run has nothing to guard (a skipped sink checks no target)
        part = self.request.without(skip)
        timings = Timings()
        loop = StageLoop(part, ctx, timings, params, end_stream_on_error=True)
        loop.prepare(part.stage(s) for s in part)  # e.g. an output filter guards this request's stream
        start = time.perf_counter()
        loop.run()  # a stage not needed (a results-cache hit filled what generation would write) does not run
        return RequestRun(ctx, time.perf_counter() - start, timings.seconds)

    def _request_context(
        self,
        params: Mapping[str, Any] | None,
        stream: Callable[[str], None] | None,
        cancel: threading.Event | None,
        log: Any,
    ) -> Context:
        """A request's context: the resident slots shared, its own metrics, notices, cancel and stream."""
        resident = self.context
        if resident is None:
            raise StageFailure("the model is not loaded")
        ctx = dataclasses.replace(
            resident,
            metrics=Metrics(),
            # the request's own: a stage's prepare appends to lists it keeps here (a filter's matchers)
            ext={k: list(v) if isinstance(v, list) else v for k, v in resident.ext.items()},
            notices=[],
            request_errors={},
            cancel=cancel or threading.Event(),
            log=log if log is not None else self.log,
        )
        if params:
            # The request's own plan: stages that read the plan (a results cache keying on the generation
            # parameters) see the parameters this request really runs with, not the plan's defaults.
            ctx.plan = self.bound.with_params(params)
        if stream is not None:
            ctx.stream = stream
        return ctx
