"""The run context: one typed object shared by all stages.

The engine knows only this base: run bookkeeping (plan, run directory, logger, metrics, progress)
and the rule that slots are the dataclass fields a subclass declares. The inference slots
(tokenizer, weights, KV cache, …) are declared by the stages package in its own subclass, found
through the `llmplan.context` entry point, so the engine stays a small, generic workflow engine.
A third-party plugin that needs a slot of its own uses a name starting with `ext.`; those live in
`ctx.ext`.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from .observing import ObserveSettings

EXT_PREFIX = "ext."
_BOOKKEEPING = {
    "plan",
    "run_dir",
    "log",
    "metrics",
    "progress",
    "ext",
    "device",
    "stream",
    "json_mode",
    "notices",
    "request_errors",
    "cancel",
}
MAX_LISTED_NOTICES = 100  # metrics.json lists this many notices in full; all are counted


@dataclasses.dataclass
class Metrics:
    """Numbers a run produces, grouped by stage id; written to `metrics.json`."""

    by_stage: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    current: str = "run"

    def set(self, key: str, value: Any) -> None:
        self.by_stage.setdefault(self.current, {})[key] = value

    def add(self, key: str, value: float) -> None:
        bucket = self.by_stage.setdefault(self.current, {})
        bucket[key] = bucket.get(key, 0) + value

    def get(self, stage: str, key: str, default: Any = None) -> Any:
        return self.by_stage.get(stage, {}).get(key, default)


class Progress:
    """A progress hook the runner wires to rich; a no-op by default (tests, --json)."""

    @contextmanager
    def task(self, description: str, total: float | None = None) -> Iterator[Callable[[float], None]]:
        yield lambda _advance: None


def _noop_stream(text: str) -> None:
    pass


@dataclasses.dataclass
class Context:
    # What a plan's `observe:` block may hold; a plugin's subclass adds its own fields (engine/observing.py).
    Observe: ClassVar[type[ObserveSettings]] = ObserveSettings

    plan: Any = None
    run_dir: Path | None = None
    log: Any = None
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    progress: Progress = dataclasses.field(default_factory=Progress)
    ext: dict[str, Any] = dataclasses.field(default_factory=dict)
    device: str = "cpu"
    stream: Callable[[str], None] = _noop_stream
    json_mode: bool = False
    notices: list[dict[str, str]] = dataclasses.field(default_factory=list)
    request_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    # Set by whoever no longer wants the result (a client that went away); long stages check it.
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    started: float = dataclasses.field(default_factory=time.perf_counter)

    @classmethod
    def slot_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - _BOOKKEEPING - {"started"}

    @classmethod
    def is_slot(cls, name: str) -> bool:
        return name.startswith(EXT_PREFIX) or name in cls.slot_names()

    def has(self, slot: str) -> bool:
        return self.get(slot) is not None

    def get(self, slot: str) -> Any:
        if slot.startswith(EXT_PREFIX):
            return self.ext.get(slot)
        return getattr(self, slot)

    def put(self, slot: str, value: Any) -> None:
        if slot.startswith(EXT_PREFIX):
            self.ext[slot] = value
        else:
            setattr(self, slot, value)

    def clear(self, slot: str) -> None:
        self.put(slot, None)

    def notice(self, kind: str, message: str) -> None:
        """An input was dropped or changed on its way (a skipped line, replaced bytes, a cut prompt).

        Never only a log event: one line on stderr now (`message` names file:line where there is
        one), and counted in the run's summary and metrics.json (`run.notices`).
        """
        self.notices.append({"kind": kind, "message": message, "stage": self.metrics.current})
        print(f"warning: {message}", file=sys.stderr, flush=True)
        if self.log is not None:
            self.log.warning("input_notice", kind=kind, message=message)

    def request_error(self, request_id: str, error: str | None) -> None:
        """A request ended in error (finish_reason `error`): the run then exits with status 3."""
        self.request_errors.setdefault(request_id, error or "error")

    def notice_summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for item in self.notices:
            kinds[item["kind"]] = kinds.get(item["kind"], 0) + 1
        return {"count": len(self.notices), "by_kind": kinds, "listed": self.notices[:MAX_LISTED_NOTICES]}

    def end_stream(self) -> None:
        """The streaming stage finished: a stream that holds text back (an output filter's guard) lets
        out what is safe. The runner calls it after every stage; a plain stream has nothing to end."""
        end = getattr(self.stream, "end", None)
        if callable(end):
            end()
