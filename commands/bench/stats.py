"""Samples → median/min/max, and a background RSS sampler for the peak of a window."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from llmplan.engine.memory import rss_bytes


def summary(values: list[float]) -> dict[str, Any]:
    """Median with min/max (and the raw samples): the CPU may be shared, one sample proves nothing."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0, "samples": []}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "samples": list(values),
    }


class PeakRSS:
    """Peak RSS over a window, sampled every `interval` s on a thread (ru_maxrss never goes down)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
