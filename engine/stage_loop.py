"""The one stage loop: prepare the stages, then run each one still needed, in order, checking its writes.

`llmplan run` (the Runner) and each served request (ResidentPlan.run_request) go through it, each over a
part of the plan's one graph; what is measured around a stage is the caller's (a `StageWatch`: the Runner
records, logs and traces; a request only times). A stage runs only while something still needs it: when
a slot is already filled (a cache hit, or a request slot made elsewhere), its writer and whatever only
that writer needed are skipped. The always-stages (release) run last, even after a failure.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from llmplan.plain_errors import plain_error

from .context import Context
from .findings import StageFailure
from .graph import DATA, FILL, PlanGraph

if TYPE_CHECKING:
    from .stage_spec import BoundStage

NOT_NEEDED = "outputs already available"
INPUTS_MISSING = "inputs missing"


class StageWatch(Protocol):
    """What a loop's owner does around each stage."""

    def skipped(self, stage_id: str, reason: str) -> None: ...

    def running(self, stage_id: str) -> contextlib.AbstractContextManager[object]: ...


class Timings:
    """A request's watch: the wall seconds of each stage that ran to its end."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def skipped(self, stage_id: str, reason: str) -> None:
        pass

    @contextlib.contextmanager
    def running(self, stage_id: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[stage_id] = time.perf_counter() - start


class StageLoop:
    """Runs `part` of a plan on `ctx`; `params` replaces some stages' plan parameters (a request's own).

    `end_stream_on_error`: a served request lets out the text its stream guard judged safe even when the
    stage fails (its client sees the text up to the error); a run's failure ends with the run's own line.
    """

    def __init__(
        self,
        part: PlanGraph,
        ctx: Context,
        watch: StageWatch,
        params: Mapping[str, Any] | None = None,
        *,
        end_stream_on_error: bool = False,
    ) -> None:
        self.part = part
        self.ctx = ctx
        self.watch = watch
        self.params = params or {}
        self.end_stream_on_error = end_stream_on_error
        self.ran: set[str] = set()

    def params_of(self, stage: BoundStage) -> Any:
        return self.params.get(stage.id, stage.params)

    def prepare(self, stages: Iterable[BoundStage]) -> None:
        """Each stage's `prepare` (an output filter guards the stream); a refusal names the stage."""
        for stage in stages:
            self.ctx.metrics.current = stage.id
            try:
                stage.cls().prepare(self.ctx, self.params_of(stage))
            except StageFailure as bad:
                raise StageFailure(f"stage {stage.id!r} ({stage.spec.uses}): {bad}") from None

    def run(self) -> None:
        """The part's stages in order, less the always-stages (`run_always` runs those) and those not needed."""
        for stage_id in self.part.order:
            if self.part.stage(stage_id).cls.always:
                continue
            if not self.needed(stage_id):
                self.watch.skipped(stage_id, NOT_NEEDED)
                continue
            self.run_stage(stage_id)
            self.ran.add(stage_id)

    def run_always(self) -> tuple[str | None, bool]:
        """The always-stages whose inputs are there; (the first error, whether Ctrl-C hit one of them)."""
        error, interrupted = None, False
        for stage_id in self.part.order:
            stage = self.part.stage(stage_id)
            if not stage.cls.always:
                continue
            if any(not self.ctx.has(slot) for slot in stage.cls.reads):
                self.watch.skipped(stage_id, INPUTS_MISSING)
                continue
            try:
                self.run_stage(stage_id)
            except KeyboardInterrupt:  # an interrupt, not a failure of the stage: said as such
                interrupted = True
            except BaseException as bad:  # cleanup must not hide the original failure
                error = error or f"stage {stage_id!r}: {failure_text(bad)}"
        return error, interrupted

    def run_stage(self, stage_id: str) -> None:
        stage = self.part.stage(stage_id)
        ctx = self.ctx
        ctx.metrics.current = stage_id
        with self.watch.running(stage_id):
            try:
                stage.cls().run(ctx, self.params_of(stage))
            except BaseException:
                if self.end_stream_on_error:
                    ctx.end_stream()
                raise
            ctx.end_stream()  # a stage's stream ends with it: text a stream guard held back comes out now
            missing = [slot for slot in stage.cls.writes if not ctx.has(slot)]
            if missing:
                raise StageFailure(f"stage {stage_id!r} ({stage.spec.uses}) did not write {', '.join(missing)}")

    def needed(self, stage_id: str) -> bool:
        """Whether some stage of the part still needs this one's output (or it is a sink)."""
        return still_needed(self.part, stage_id, self.ctx, self.ran, {})


def still_needed(part: PlanGraph, node: str, ctx: Context, ran: set[str], memo: dict[str, bool]) -> bool:
    if node in memo:
        return memo[node]
    graph = part.dag
    writes = set(part.stage(node).cls.writes)
    if writes and all(ctx.has(slot) for slot in writes) and node not in ran:
        memo[node] = False  # everything it would produce is already there
        return False
    consumers = [
        dst
        for dst in graph.successors(node)
        if (graph.edges[node, dst]["kinds"] & {DATA, FILL}) and not part.stage(dst).cls.always
    ]
    if not consumers:
        memo[node] = True  # a sink: its effect is the point of the plan
        return True
    result = False
    for dst in consumers:
        slots = graph.edges[node, dst]["slots"]
        unfilled = any(not ctx.has(slot) for slot in slots) or not slots
        if unfilled and dst not in ran and still_needed(part, dst, ctx, ran, memo):
            result = True
            break
    memo[node] = result
    return result


def failure_text(error: BaseException) -> str:
    """What a stage's failure says: its own message when it made one, else a plain sentence."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return str(error) if isinstance(error, StageFailure) else plain_error(error)
