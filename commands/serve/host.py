"""A model kept loaded for requests as they come: the resident part of a plan, its engine loop, and its life.

`ModelHost` runs a plan's resident stages once (`ResidentPlan.load`), hands the KV cache's slots to one
engine loop, which it puts into the resident context (`engine_loop`), and runs each request's stages on a
context of its own (every request's generate stage submits to that loop, so requests in flight share the
decode steps). After `keep_alive` seconds without a request
it runs the release stage (the weights and cache are freed); the next request loads them again.

One thread owns the model: it loads, steps the engine loop and unloads (`serve_forever`, or `pump` one round at
a time); other threads ask it to. That thread should be the main thread. Measured here, the native decode
step is 2.5x slower from any other thread: a second thread running OpenMP regions gets a thread pool of its
own, libgomp then counts more pool threads than CPUs and throttles its spin-waits to almost nothing, so
each of the ~150 fork/joins of a token pays a futex wake-up. `llmplan serve` therefore runs the HTTP server
in a thread and the model in the main one; `llmplan chat` steps the loop from its main thread while
the answer's stages run in a worker.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmplan.engine.findings import InputRefused, StageFailure
from llmplan.engine.plan import BoundPlan
from llmplan.engine.runner import make_run_dir
from llmplan.engine.serving import RequestRun, ResidentPlan, ServeError

if TYPE_CHECKING:  # torch comes with these: imported when a model is loaded, not when the CLI starts
    from llmplan.llm.generation import EngineLoop, Scheduler

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
        uses = {}
        for stage in bound.stages:
            uses.setdefault(stage.spec.uses, stage)
        if GENERATE not in uses or TOKENIZE not in uses:
            raise ServeError(f"{bound.source.file}: a plan that serves needs a {TOKENIZE} and a {GENERATE} stage")
        generate = uses[GENERATE]
        if generate.params.num_beams > 1:  # refused before anything is created (no run directory)
            line, col = bound.source.position(("stages", generate.index, "with", "num_beams"))
            raise ServeError(
                f"{bound.source.file}:{line}:{col}: stages[{generate.index}].with.num_beams: beam search "
                f"({generate.params.num_beams} beams) runs as a static batch over the whole cache and cannot be served"
            )
        self.run_dir = run_dir or make_run_dir(bound.plan.runs_dir, bound.plan.name)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.plan = ResidentPlan(bound, new_context, self.run_dir)
        self.generate_id = self.plan.stage_by_use(GENERATE)
        self.tokenize_id = self.plan.stage_by_use(TOKENIZE)
        if self.generate_id is None or self.tokenize_id is None:  # present, but not downstream of a request
            self.plan.close()
            raise ServeError(f"{bound.source.file}: {GENERATE} does not follow the plan's {TOKENIZE} stage")
        self.write_id = self.plan.stage_by_use(WRITE)
        self.keep_alive_s = keep_alive_s
        self.report = report
        self.loop: EngineLoop | None = None
        self._lock = threading.RLock()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._wake = threading.Event()  # set by a submit, a cancel or a call: the model thread has work
        self._owner: int | None = None  # the thread running serve_forever / pump, while it does
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
    def scheduler(self) -> Scheduler | None:
        """The served loop's scheduler (its submissions, stats and load), while loaded."""
        return self.loop.scheduler if self.loop is not None else None

    @property
    def generate_params(self) -> Any:
        return self.plan.params(self.generate_id)  # type: ignore[arg-type]

    @property
    def context(self) -> Any:
        return self.plan.context

    # --- the model thread ---------------------------------------------------------------------------

    def serve_forever(self, stop: threading.Event) -> None:
        """Be the model thread until `stop` is set: run what other threads ask, step the engine loop."""
        while not stop.is_set():
            self.pump()

    def pump(self, wait_s: float = 0.05) -> None:
        """One round of the model thread: pending calls, then one loop step (or a short wait for work)."""
        self._owner = threading.get_ident()
        self._wake.clear()
        while True:
            try:
                call, done = self._calls.get_nowait()
            except queue.Empty:
                break
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(call())
                except BaseException as bad:
                    done.set_exception(bad)
        loop = self.loop
        if loop is None or not loop.step():
            self._wake.wait(wait_s)

    def release_thread(self) -> None:
        """The model thread stops pumping: later calls run on their caller's thread."""
        self._owner = None

    def _on_model_thread(self, call: Callable[[], Any]) -> Any:
        """Run `call` on the model thread (directly when this is it, or when none is pumping)."""
        if self._owner is None or self._owner == threading.get_ident():
            return call()
        done: Future[Any] = Future()
        self._calls.put((call, done))
        self._wake.set()
        return done.result()

    def load(self) -> None:
        """Load the resident stages and serve the engine loop (no-op when loaded); on the model thread."""
        self._on_model_thread(self._load)

    def _load(self) -> None:
        # torch: only once a model is loaded
        from llmplan.llm.generation import CannotRun, ModelRunner, serving_loop
        from llmplan.stages.compute_generate import loop_options, stage_failure

        with self._lock:
            if self.plan.state == "ready":
                return
            result = self.plan.load(report=self.report)
            if result.exit_code:
                raise StageFailure(result.message)
            ctx = self.plan.context
            assert ctx.model is not None and ctx.kv_cache is not None
            runner = ctx.model_runner or ModelRunner(ctx.model, ctx.kv_cache)
            try:
                self.loop = serving_loop(runner, ctx.kv_cache, loop_options(self.generate_params), ctx.draft_model)
            except CannotRun as bad:
                raise stage_failure(bad) from None
            self.loop.scheduler.on_work = self._wake.set
            ctx.engine_loop = self.loop  # every request's context is made from this one
            self.loads += 1
            self.last_request = time.monotonic()

    def unload(self) -> dict[str, Any] | None:
        """Cancel what runs, stop serving, run the release stage (on the model thread); its report, if any."""
        return self._on_model_thread(self._unload)

    def _unload(self) -> dict[str, Any] | None:
        with self._lock:
            if self.plan.state != "ready":
                return None
            loop, ctx = self.loop, self.plan.context
            if loop is not None:
                loop.cancel_all()
                while loop.pending:  # this is the model thread: end them here
                    loop.step()
            if ctx is not None:
                ctx.engine_loop = None
            self.loop = None
            result = self.plan.unload()
            report = ctx.get("release_report") if ctx is not None and ctx.is_slot("release_report") else None
            if result is not None and result.exit_code:
                raise StageFailure(result.message)
            return report

    def close(self) -> None:
        try:
            self.unload()
        finally:
            self.plan.close()

    def idle_for(self) -> float:
        return time.monotonic() - self.last_request

    def maybe_unload(self) -> bool:
        """Unload when idle past keep-alive with nothing in flight; True when it did."""
        if self.keep_alive_s is None or self.state != "ready" or self._in_flight or self.idle_for() < self.keep_alive_s:
            return False
        return bool(self._on_model_thread(self._maybe_unload))

    def _maybe_unload(self) -> bool:
        assert self.keep_alive_s is not None
        with self._lock:  # checked again on the model thread: a request may have come meanwhile
            if self.state != "ready" or self._in_flight or self.idle_for() < self.keep_alive_s:
                return False
            self._unload()
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

    def embed(self, inputs: list[tuple[list[int], int]]) -> list[list[float]]:
        """One vector per (token ids, leading ids left out of the pooling: a BOS the tokenizer added): the
        model's final hidden states (after the final norm), mean-pooled over the input's tokens and
        L2-normalized, as OpenAI's are. On the model thread, between two engine steps (loading first if
        unloaded): the pass uses no KV cache, so requests in flight keep their slots."""
        with self._lock:
            self._in_flight += 1
            self.last_request = time.monotonic()
        try:
            self.load()
            return self._on_model_thread(lambda: self._embed(inputs))
        finally:
            with self._lock:
                self._in_flight -= 1
                self.last_request = time.monotonic()

    def _embed(self, inputs: list[tuple[list[int], int]]) -> list[list[float]]:
        import torch  # with the model, not when the CLI starts

        model = self.plan.context.model
        vectors = []
        with torch.inference_mode():
            for ids, skip in inputs:  # one at a time: no padding, each exactly as it would be alone
                hidden = model.hidden(torch.tensor([ids], device=model.device))[0, skip:].float()
                pooled = hidden.mean(0)
                vectors.append((pooled / pooled.norm().clamp(min=1e-12)).cpu().tolist())
        return vectors
