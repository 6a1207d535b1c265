"""The stage contract: what a plugin declares and implements.

A stage is a class with a name (`uses:` in a plan), a phase, a Pydantic `Params` model that forbids
unknown keys, the context slots it `reads` and `writes`, and `run(ctx, params)`. The engine derives
the graph from reads/writes (Hamilton/Kedro style), so a plan never wires stages by hand.

- `writes` are promises: after `run`, each must be set on the context, or the run fails.
- `fills` are optional writes that can make another stage redundant (a cache hit fills
  `generations`, so generation and everything only it needs is skipped).
- `optional_reads` are used when present and never create a graph edge requirement.
- `edits` are slots a stage changes in place (an output filter edits `completions`): the graph puts
  it after the slot's writer and before EVERY other reader of the slot, whatever the plan's order,
  so no reader can see the slot unedited.
- `prepare(ctx, params)` runs for every stage of the plan before the first stage runs (even one
  that `--until` leaves out): the place to check inputs early or wrap `ctx.stream`.
- `always` stages (release) run even after a failure or Ctrl-C.
- `per_request` marks a stage that turns one request into context slots: a resident plan (`llmplan serve`)
  runs it and every stage downstream of it once per request, the rest once at start-up.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from .strict import strict_numbers

if TYPE_CHECKING:
    from .context import Context


class Phase(StrEnum):
    LOAD = "load"
    COMPUTE = "compute"
    OUTPUT = "output"
    OBSERVE = "observe"
    OTHER = "other"


class Params(BaseModel):
    """Base of every stage's parameters: unknown keys are errors, not silent defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return strict_numbers(cls, value, info)


class NoParams(Params):
    pass


class Stage:
    name: ClassVar[str]
    phase: ClassVar[Phase] = Phase.OTHER
    Params: ClassVar[type[Params]] = NoParams
    reads: ClassVar[tuple[str, ...]] = ()
    optional_reads: ClassVar[tuple[str, ...]] = ()
    writes: ClassVar[tuple[str, ...]] = ()
    fills: ClassVar[tuple[str, ...]] = ()
    edits: ClassVar[tuple[str, ...]] = ()
    always: ClassVar[bool] = False
    # A stage that may answer from stored results instead of generating: (its parameter, the value that replays,
    # the value that generates). `llmplan run --replay` and `--report` set it (engine/cli.py lookup_overrides).
    replay_setting: ClassVar[tuple[str, str, str] | None] = None
    per_request: ClassVar[bool] = False

    def run(self, ctx: Context, params: Any) -> None:
        raise NotImplementedError

    @classmethod
    def needs(cls, params: Any) -> tuple[str, ...]:
        """Slots among `optional_reads` that these parameters make required (checked like `reads`)."""
        return ()

    def prepare(self, ctx: Context, params: Any) -> None:
        """Before any stage of the plan runs; a StageFailure here stops the run before any work."""

    def check(self, params: Any, deep: DeepCheck) -> None:
        """`validate --deep`: look at files and the machine without loading a model."""

    @classmethod
    def prompt_params(cls, message: str | None, prompts_file: str | None) -> dict[str, Any] | None:
        """The parameters `llmplan run --prompt TEXT` / `--prompts FILE` set on this stage; None: takes no prompts."""
        return None

    @classmethod
    def draws_from_seed(cls, params: Any) -> bool:
        """Whether this stage, with these parameters, draws random numbers and pins no seed of its own: a run of a
        plan that pins no `seed:` then draws one (`llmplan run`), so a sampled answer is new each run."""
        return False

    @classmethod
    def model_params(cls, path: str) -> dict[str, Any] | None:
        """The parameters `--model PATH` sets on this stage (the plan's model source replaced); None: not a source."""
        return None

    @classmethod
    def summary(cls) -> str:
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


class DeepCheck:
    """What `validate --deep` hands each stage: a place to report problems and estimates.

    Stages run their checks in plan order and may share facts through `facts` (e.g. the model
    source puts the model directory there, the convert stage the weight bytes).
    """

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.facts: dict[str, Any] = {}
        self.problems: list[tuple[str, str, str]] = []  # (stage id, field path inside `with`, message)
        self.estimates: dict[str, int] = {}
        self.capacity: tuple[str, int] | None = None  # (what, bytes) the estimates must fit in
        self.peaks: dict[str, int] = {}  # transient peaks (e.g. while converting), beside the steady regions
        self.peak_stages: dict[str, str] = {}  # the stage each peak belongs to, where a finding about it points
        self.file_backed: dict[str, int] = {}  # of each region, the bytes that are a file's pages (mapped)
        self.disk: dict[str, int] = {}  # bytes the run will write to disk, by what (a conversion cache entry)
        self.current: str = ""

    def problem(self, message: str, field: str = "") -> None:
        self.problems.append((self.current, field, message))

    def estimate(self, region: str, nbytes: int) -> None:
        self.estimates[region] = self.estimates.get(region, 0) + int(nbytes)

    def peak(self, moment: str, nbytes: int) -> None:
        """Bytes held at once during one moment of the load (not added to the steady regions)."""
        self.peaks[moment] = max(self.peaks.get(moment, 0), int(nbytes))
        self.peak_stages[moment] = self.current
