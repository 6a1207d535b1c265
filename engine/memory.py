"""Process and device memory readings, without importing torch (we only look if it is loaded)."""

from __future__ import annotations

import bisect
import os
import resource
import sys
from collections.abc import Iterable
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; falls back to the peak where /proc is absent)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except OSError:
        return peak_rss_bytes()


def resident_split() -> tuple[int, int] | None:
    """(file-backed, anonymous) resident bytes now: statm's `shared` is the resident pages that belong to files
    (mapped weights, the page cache's, shared and evictable) and shared memory; the rest is the process's own.
    None where /proc is absent."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            fields = handle.read().split()
    except OSError:
        return None
    resident, shared = int(fields[1]) * _PAGE, int(fields[2]) * _PAGE
    return shared, resident - shared


def mapped_resident(paths: Iterable[str]) -> int | None:
    """Resident bytes of this process's mappings of these files (their pages touched so far), from
    /proc/self/smaps; None where /proc is absent."""
    wanted = {str(Path(p).resolve()) for p in paths}
    total, inside = 0, False
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                head = line.split(maxsplit=5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                    inside = len(head) == 6 and head[5].rstrip("\n") in wanted
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return None
    return total


def file_backed_split(spans: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
    """Of these (address, bytes) spans (tensors' storage), the bytes that lie in a mapped file's range and the
    bytes that do not (the process's own memory), from /proc/self/maps; None where /proc is absent."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[4] != "0" and parts[5].startswith("/"):
                    low, high = (int(x, 16) for x in parts[0].split("-"))
                    ranges.append((low, high))
    except OSError:
        return None
    ranges.sort()
    starts = [low for low, _ in ranges]
    inside = outside = 0
    for address, size in spans:
        at = bisect.bisect_right(starts, address) - 1
        if at >= 0 and address + size <= ranges[at][1]:
            inside += size
        else:
            outside += size
    return inside, outside


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


def _resident() -> tuple[int, int | None]:
    """(RSS, of which file-backed) in one read of statm, for a sample."""
    split = resident_split()
    return (rss_bytes(), None) if split is None else (split[0] + split[1], split[0])


class MemorySampler:
    """Samples RSS and device memory on a background thread, with stage boundaries marked.

    The samples feed the "memory over time" picture; the thread sleeps between samples, so its
    cost is a few microseconds per interval.
    """

    def __init__(self, interval_ms: int) -> None:
        import threading
        import time

        self.interval = interval_ms / 1000
        self.samples: list[tuple[float, int, int | None, int | None]] = []  # (t, rss, file-backed, device)
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
        self.samples.append((now, *_resident(), device_bytes()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((self._clock() - self._t0, *_resident(), device_bytes()))

    def to_dict(self) -> dict[str, object]:
        return {
            "interval_ms": int(self.interval * 1000),
            "samples": [{"t": t, "rss": r, "device": d, "file": f} for t, r, f, d in sorted(self.samples)],
            "marks": [{"t": t, "stage": s, "edge": e} for t, s, e in self.marks],
        }
