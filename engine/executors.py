"""Executors: where a plan's requests run. `local` is the Runner in this process; any other kind (`ray`)
is a plugin found through the entry-point group `llmplan.executors`, so the engine never imports Ray.

An executor is an object with `check()` (raise ExecutorMissing when it cannot run here: a missing package;
called before the run directory is made) and `__call__(job)`: it receives the validated plan and the run
directory, and returns the exit code `llmplan run` documents (0 every request answered, 3 some ended in
error, 1 failed, 130 interrupted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol

from .plan import BoundPlan
from .registry import Registry

EXECUTOR_GROUP = "llmplan.executors"


@dataclass
class ExecutorJob:
    """One `llmplan run` handed to an executor."""

    bound: BoundPlan
    registry: Registry
    run_dir: Path
    overrides: list[str] = field(default_factory=list)  # the --set (and --prompts) the plan was bound with
    json_mode: bool = False
    quiet: bool = False
    debug: bool = False


class ExecutorMissing(Exception):
    """No installed package provides this executor kind; the message says what to install."""


class Executor(Protocol):
    def check(self) -> None: ...

    def __call__(self, job: ExecutorJob) -> int: ...


def find_executor(kind: str) -> Executor:
    for point in entry_points(group=EXECUTOR_GROUP):
        if point.name == kind:
            return point.load()  # type: ignore[no-any-return]
    raise ExecutorMissing(f"executor {kind!r}: no installed package provides it (pip install 'llmplan[{kind}]')")
