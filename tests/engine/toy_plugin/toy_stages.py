"""A plugin package that knows nothing of llmplan's repo: it only uses the public stage contract."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import Params, Phase, Stage

CALLS: list[str] = []


class Numbers(Stage):
    """Produce the numbers 1..count."""

    name = "toy.numbers"
    phase = Phase.LOAD
    writes = ("ext.numbers",)

    class Params(Params):
        count: int = Field(3, ge=1, le=1000, description="how many numbers")
        mode: Literal["up", "down"] = "up"

    def run(self, ctx, params):
        CALLS.append("numbers")
        values = list(range(1, params.count + 1))
        ctx.put("ext.numbers", values if params.mode == "up" else values[::-1])


class Square(Stage):
    """Square each number."""

    name = "toy.square"
    phase = Phase.COMPUTE
    reads = ("ext.numbers",)
    writes = ("ext.squares",)

    class Params(Params):
        offset: float = Field(0.0, ge=-10, le=10)

    def run(self, ctx, params):
        CALLS.append("square")
        ctx.put("ext.squares", [n * n + params.offset for n in ctx.get("ext.numbers")])


class Total(Stage):
    """Sum the squares and write them to a file."""

    name = "toy.total"
    phase = Phase.OUTPUT
    reads = ("ext.squares",)
    writes = ("ext.total",)

    class Params(Params):
        out: str | None = None
        fail: bool = False

    def run(self, ctx, params):
        CALLS.append("total")
        if params.fail:
            raise StageFailure(f"{params.out}: refused to write (fail: true)")
        total = sum(ctx.get("ext.squares"))
        ctx.put("ext.total", total)
        ctx.metrics.set("total", total)
        if params.out:
            Path(params.out).write_text(json.dumps({"total": total}))


class Cleanup(Stage):
    """Always runs, like release."""

    name = "toy.cleanup"
    phase = Phase.OUTPUT
    always = True

    class Params(Params):
        marker: str | None = None

    def run(self, ctx, params):
        CALLS.append("cleanup")
        if params.marker:
            Path(params.marker).write_text("cleaned")


class Lookup(Stage):
    """A cache: when `hit`, fills the squares so that squaring (and its inputs) are skipped."""

    name = "toy.lookup"
    phase = Phase.COMPUTE
    fills = ("ext.squares",)

    class Params(Params):
        hit: bool = False

    def run(self, ctx, params):
        CALLS.append("lookup")
        if params.hit:
            ctx.put("ext.squares", [100.0])


class Liar(Stage):
    """Promises a slot and does not write it."""

    name = "toy.liar"
    writes = ("ext.numbers",)

    def run(self, ctx, params):
        CALLS.append("liar")


class Interrupt(Stage):
    """Simulates Ctrl-C in the middle of a run."""

    name = "toy.interrupt"
    reads = ("ext.numbers",)
    writes = ("ext.squares",)

    def run(self, ctx, params):
        CALLS.append("interrupt")
        raise KeyboardInterrupt


class Crash(Stage):
    """A bug: an unexpected exception."""

    name = "toy.crash"
    reads = ("ext.numbers",)
    writes = ("ext.squares",)

    def run(self, ctx, params):
        CALLS.append("crash")
        raise ZeroDivisionError("division by zero")


class Sleep(Stage):
    """Waits (for a Ctrl-C from outside)."""

    name = "toy.sleep"
    reads = ("ext.numbers",)
    writes = ("ext.squares",)

    class Params(Params):
        seconds: float = Field(30, ge=0, le=600)
        ready: str | None = None

    def run(self, ctx, params):
        import time

        if params.ready:
            Path(params.ready).write_text("sleeping")
        time.sleep(params.seconds)


class Ask(Stage):
    """A request stage (a served plan runs it per request): the squares, each times `times`."""

    name = "toy.ask"
    phase = Phase.COMPUTE
    per_request = True
    reads = ("ext.numbers",)
    writes = ("ext.squares",)

    class Params(Params):
        times: float = Field(1.0, ge=0, le=100)

    def run(self, ctx, params):
        CALLS.append("ask")
        ctx.put("ext.squares", [n * n * params.times for n in ctx.get("ext.numbers")])
