"""Process and device memory readings, without importing torch (we only look if it is loaded)."""

from __future__ import annotations

import os
import resource
import sys

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; falls back to the peak where /proc is absent)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def device_bytes() -> int | None:
    """Bytes allocated on the current CUDA device, or None when torch/CUDA is not in use."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.memory_allocated())


def device_peak_bytes() -> int | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


def mib(nbytes: float | None, missing: str = "-") -> str:
    """Bytes for a person: MiB, or GiB from 1 GiB on (the one formula the console, stages and report use)."""
    if nbytes is None:
        return missing
    if abs(nbytes) >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


class MemorySampler:
    """Samples RSS and device memory on a background thread, with stage boundaries marked.

    The samples feed the "memory over time" picture; the thread sleeps between samples, so its
    cost is a few microseconds per interval.
    """

    def __init__(self, interval_ms: int) -> None:
        import threading
        import time

        self.interval = interval_ms / 1000
        self.samples: list[tuple[float, int, int | None]] = []
        self.marks: list[tuple[float, str, str]] = []  # (t, stage id, "start" | "end")
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._clock = time.perf_counter
        self._thread = threading.Thread(target=self._loop, name="llmplan-memory", daemon=True)

    def start(self) -> MemorySampler:
        if self.interval > 0:
            self._thread.start()
        return self

    def mark(self, stage: str, edge: str) -> None:
        now = self._clock() - self._t0
        self.marks.append((now, stage, edge))
        self.samples.append((now, rss_bytes(), device_bytes()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((self._clock() - self._t0, rss_bytes(), device_bytes()))

    def to_dict(self) -> dict[str, object]:
        return {
            "interval_ms": int(self.interval * 1000),
            "samples": [{"t": t, "rss": r, "device": d} for t, r, d in sorted(self.samples)],
            "marks": [{"t": t, "stage": s, "edge": e} for t, s, e in self.marks],
        }
