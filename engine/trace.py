"""The run as a Chrome trace (`trace.json`): the format Perfetto, chrome://tracing and PyTorch's profiler use.

Every span is a complete event ("ph": "X") with its start `ts` and length `dur` in microseconds since the
run started, on one process (the run) and named threads (tracks). Spans come from the runner (the run, each
stage) and from stages through `ctx.trace.add` (load sub-steps, prefill chunks, decode steps, per-layer
time). Times are `time.perf_counter_ns` values (CLOCK_MONOTONIC on Linux), the clock the native decode step
reads too, so spans measured in C and in Python nest as they happened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

MAIN_TRACK = 1  # the thread that runs the stages
TRACK_NAMES = {MAIN_TRACK: "stages"}


@dataclass(frozen=True)
class Span:
    name: str
    cat: str  # run | stage | load | prefill | decode | step | layer | …
    start_ns: int
    end_ns: int
    args: dict[str, Any] = field(default_factory=dict)
    track: int = MAIN_TRACK


@dataclass
class Trace:
    """Spans a run collects; cheap to add to (one small object each)."""

    spans: list[Span] = field(default_factory=list)
    limit: int = 2_000_000  # a runaway producer must not eat the machine's memory

    def add(self, name: str, cat: str, start_ns: int, end_ns: int, track: int = MAIN_TRACK, **args: Any) -> None:
        if len(self.spans) < self.limit and end_ns >= start_ns:
            self.spans.append(Span(name, cat, int(start_ns), int(end_ns), args, track))

    def add_seconds(self, name: str, cat: str, start_s: float, end_s: float, **args: Any) -> None:
        """A span measured with time.perf_counter() (seconds)."""
        self.add(name, cat, round(start_s * 1e9), round(end_s * 1e9), **args)


def chrome_trace(
    spans: list[Span], origin_ns: int, process: str, other: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON object format of the trace-event spec: {"traceEvents": [...], "displayTimeUnit": "ms", ...}.

    Events are sorted by start, longer first on ties, so a parent precedes the spans it contains.
    """
    pid = os.getpid()
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": MAIN_TRACK, "args": {"name": process}},
    ]
    for track in sorted({s.track for s in spans} | {MAIN_TRACK}):
        name = TRACK_NAMES.get(track, f"track {track}")
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": track, "args": {"name": name}})
    for span in sorted(spans, key=lambda s: (s.start_ns, -(s.end_ns - s.start_ns))):
        events.append(
            {
                "name": span.name,
                "cat": span.cat,
                "ph": "X",
                "ts": (span.start_ns - origin_ns) / 1000,
                "dur": (span.end_ns - span.start_ns) / 1000,
                "pid": pid,
                "tid": span.track,
                "args": span.args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other or {}}
