"""A model kept loaded for requests as they come: the resident part of a plan, its scheduler, and its life.

`ModelHost` runs a plan's resident stages once (`ResidentPlan.load`), hands the KV cache's slots to one
scheduler stepped by a thread of its own (every request's generate stage submits to it, so requests in
flight share the decode steps), and runs each request's stages on a context of its own. After `keep_alive`
seconds without a request it runs the release stage (the weights and cache are freed); the next request
loads them again. `llmplan serve` and `llmplan chat` are both built on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmplan.engine.findings import InputRefused, StageFailure
from llmplan.engine.plan import BoundPlan
from llmplan.engine.runner import make_run_dir
from llmplan.engine.serving import RequestRun, ResidentPlan, ServeError
from llmplan.llm.scheduler import Scheduler
from llmplan.stages.compute_generate import serve_scheduler, unserve

GENERATE, TOKENIZE, WRITE = "compute.generate", "compute.tokenize", "output.write"


@dataclass
class RequestFailed(Exception):
    """A request's stage refused or failed; `client_error` when the request's own values were the cause."""

    message: str
    client_error: bool

    def __str__(self) -> str:
        return self.message


class ModelHost:
    def __init__(
        self,
        bound: BoundPlan,
        new_context: Callable[[], Any],
        *,
        run_dir: Path | None = None,
        keep_alive_s: float | None = None,
        report: Any = None,
    ) -> None:
        self.bound = bound
        self.run_dir = run_dir or make_run_dir(bound.plan.runs_dir, bound.plan.name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.plan = ResidentPlan(bound, new_context, self.run_dir)
        self.generate_id = self.plan.stage_by_use(GENERATE)
        self.tokenize_id = self.plan.stage_by_use(TOKENIZE)
        if self.generate_id is None or self.tokenize_id is None:
            raise ServeError(f"{bound.source.file}: a plan that serves needs a {TOKENIZE} and a {GENERATE} stage")
        gen = self.plan.params(self.generate_id)
        if gen.num_beams > 1:
            stage = bound.stage(self.generate_id)
            line, col = bound.source.position(("stages", stage.index, "with", "num_beams"))
            raise ServeError(
                f"{bound.source.file}:{line}:{col}: stages[{stage.index}].with.num_beams: beam search "
                f"({gen.num_beams} beams) runs as a static batch over the whole cache and cannot be served"
            )
        self.write_id = self.plan.stage_by_use(WRITE)
        self.keep_alive_s = keep_alive_s
        self.report = report
        self.scheduler: Scheduler | None = None
        self._stepper: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._in_flight = 0
        self.last_request = time.monotonic()
        self.loads = 0

    # --- state ------------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        return self.plan.state

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def generate_params(self) -> Any:
        return self.plan.params(self.generate_id)  # type: ignore[arg-type]

    @property
    def context(self) -> Any:
        return self.plan.context

    def load(self) -> None:
        """Load the resident stages and start stepping the scheduler (no-op when loaded)."""
        with self._lock:
            if self.plan.state == "ready":
                return
            result = self.plan.load(report=self.report)
            if result.exit_code:
                raise StageFailure(result.message)
            ctx = self.plan.context
            self.scheduler = serve_scheduler(ctx.model, ctx.kv_cache, self.generate_params)
            self._stop = threading.Event()
            self._stepper = threading.Thread(
                target=self.scheduler.serve, args=(self._stop,), name="llmplan-scheduler", daemon=True
            )
            self._stepper.start()
            self.loads += 1
            self.last_request = time.monotonic()

    def unload(self) -> dict[str, Any] | None:
        """Cancel what runs, stop the scheduler, run the release stage. Returns its report, if any."""
        with self._lock:
            if self.plan.state != "ready":
                return None
            self._stop_scheduler()
            ctx = self.plan.context
            result = self.plan.unload()
            report = ctx.get("release_report") if ctx is not None and ctx.is_slot("release_report") else None
            if result is not None and result.exit_code:
                raise StageFailure(result.message)
            return report

    def _stop_scheduler(self) -> None:
        scheduler, ctx = self.scheduler, self.plan.context
        if scheduler is not None:
            scheduler.cancel_all()
            deadline = time.monotonic() + 10
            while scheduler.pending and time.monotonic() < deadline:
                time.sleep(0.01)
        self._stop.set()
        if self._stepper is not None:
            self._stepper.join(timeout=30)
        if ctx is not None and ctx.kv_cache is not None:
            unserve(ctx.kv_cache)
        self.scheduler, self._stepper = None, None

    def close(self) -> None:
        try:
            self.unload()
        finally:
            self.plan.close()

    def idle_for(self) -> float:
        return time.monotonic() - self.last_request

    def maybe_unload(self) -> bool:
        """Unload when idle past keep-alive with nothing in flight; True when it did."""
        if self.keep_alive_s is None or self.state != "ready" or self._in_flight:
            return False
        if self.idle_for() < self.keep_alive_s:
            return False
        with self._lock:
            if self._in_flight or self.idle_for() < self.keep_alive_s:
                return False
            self.unload()
            return True

    # --- requests ---------------------------------------------------------------------------------

    def run(
        self,
        overrides: Mapping[str, Mapping[str, Any]],
        *,
        stream: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        skip_stdout_sinks: bool = True,
    ) -> RequestRun:
        """Run one request's stages with these per-stage overrides (loading first if unloaded)."""
        with self._lock:
            self._in_flight += 1
            self.last_request = time.monotonic()
        try:
            self.load()
            overrides = dict(overrides)
            skip: set[str] = set()
            if skip_stdout_sinks and self.write_id is not None:
                files = [s for s in self.plan.params(self.write_id).to if not isinstance(s, str)]
                if files:  # the answer goes back to the client; files still get theirs
                    overrides[self.write_id] = {**overrides.get(self.write_id, {}), "to": files}
                else:
                    skip.add(self.write_id)
            params = self.plan.bind(overrides)
            try:
                return self.plan.run_request(params, stream=stream, cancel=cancel, skip=skip)
            except StageFailure as failure:
                raise RequestFailed(str(failure), client_error=isinstance(failure, InputRefused)) from None
        finally:
            with self._lock:
                self._in_flight -= 1
                self.last_request = time.monotonic()
