"""Whether a plan's predicted memory fits, and the largest KV-cache setting that does (`validate --deep`).

The stages predict the regions (weights, KV cache, work buffers) and the peak while converting; the
KV-cache stage hands over how its bytes grow with context and slots (`KVSizing`), so the search for the
largest `max_tokens` and `max_batch` that fit needs no knowledge of models here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .memory import mib

_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(ib|i|b)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`8G`, `8GiB`, `512MiB`, `512M` (powers of 1024), `8GB` (powers of 1000), or plain bytes."""
    match = _SIZE.fullmatch(text.strip())
    unit = (match.group(3) or "").lower() if match else ""
    if match is None or (unit in ("i", "ib") and not match.group(2)):
        raise ValueError(f"{text!r} is not a size (e.g. 8G, 512MiB, 1000000)")
    power = _POWERS[match.group(2).lower()]
    base = 1000 if unit == "b" else 1024
    value = int(float(match.group(1)) * base**power)
    if value <= 0:
        raise ValueError(f"{text!r}: the memory must be more than 0 bytes")
    return value


@dataclass
class KVSizing:
    """What the KV-cache stage knows: its settings, their limits, and the bytes (KV cache + work buffers)
    any other setting would take."""

    stage: str
    max_batch: int
    max_tokens: int
    token_limit: int  # the model's context
    batch_limit: int
    bytes_for: Callable[[int, int], int]  # (max_batch, max_tokens) -> bytes
    min_tokens: int = 8
    min_batch: int = 1


@dataclass
class MemoryPlan:
    regions: dict[str, int]
    peaks: dict[str, int]
    available: int
    available_from: str  # "--memory", "available host memory", "free memory on cuda:0"
    max_tokens: int | None = None  # the largest that fit at the plan's max_batch (None: none does)
    max_batch: int | None = None  # the largest that fit at the plan's max_tokens
    kv_stage: str | None = None
    batch: int = 0  # the plan's own max_batch and max_tokens, which the fixes above keep
    tokens: int = 0
    file_backed: dict[str, int] = field(default_factory=dict)  # of each region, the bytes a file's pages hold
    disk: dict[str, int] = field(default_factory=dict)  # bytes the run writes to disk (a conversion cache entry)

    @property
    def anonymous(self) -> int:
        """Steady bytes that are this process's own memory (not a mapped file's pages, shared and evictable)."""
        return self.steady - sum(self.file_backed.values())

    @property
    def steady(self) -> int:
        return sum(self.regions.values())

    @property
    def peak(self) -> int:
        return max([self.steady, *self.peaks.values()])

    @property
    def fits(self) -> bool:
        return self.peak <= self.available

    def transient(self) -> str | None:
        """The moment of the load that does not fit (e.g. "converting"), when that is the cause."""
        moment, biggest = max(self.peaks.items(), key=lambda item: item[1], default=("", 0))
        return moment if biggest > self.available and biggest >= self.steady else None

    def verdict(self) -> str:
        """One line: why it does not fit, and the `--set` that makes it fit where the KV cache is the cause."""
        where = f"{self.available_from} ({mib(self.available)})"
        moment = self.transient()
        if moment is not None:
            return f"predicted peak {mib(self.peaks[moment])} while {moment} does not fit {where}"
        parts = " + ".join(f"{k} {mib(v)}" for k, v in self.regions.items())
        line = f"predicted peak {mib(self.steady)} ({parts}) does not fit {where}"
        fixes = []
        if self.kv_stage and self.max_tokens is not None:
            fixes.append(f"--set {self.kv_stage}.kv_cache.max_tokens={self.max_tokens} (at max_batch {self.batch})")
        if self.kv_stage and self.max_batch is not None:
            fixes.append(f"--set {self.kv_stage}.max_batch={self.max_batch} (at max_tokens {self.tokens})")
        if fixes:
            return f"{line}; what fits: {' or '.join(fixes)}"
        return f"{line}; no KV-cache setting fits (weights alone: {mib(self.regions.get('weights', 0))})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "regions": self.regions,
            "peaks": self.peaks,
            "steady_bytes": self.steady,
            "peak_bytes": self.peak,
            "available_bytes": self.available,
            "available_from": self.available_from,
            "fits": self.fits,
            "fit_max_tokens": self.max_tokens,
            "fit_max_batch": self.max_batch,
            "kv_stage": self.kv_stage,
            "file_backed": self.file_backed,
            "anonymous_bytes": self.anonymous,
            "disk": self.disk,
        }


def plan_memory(
    regions: dict[str, int], peaks: dict[str, int], capacity: tuple[str, int], sizing: KVSizing | None
) -> MemoryPlan:
    """The plan's prediction against the memory it has; when it does not fit, the largest KV settings that do."""
    plan = MemoryPlan(dict(regions), dict(peaks), capacity[1], capacity[0])
    if plan.fits or sizing is None:
        return plan
    rest = plan.steady - sizing.bytes_for(sizing.max_batch, sizing.max_tokens)
    room = plan.available - rest
    if max(peaks.values(), default=0) > plan.available or room <= 0:
        return plan  # the KV cache is not what fails
    plan.kv_stage, plan.batch, plan.tokens = sizing.stage, sizing.max_batch, sizing.max_tokens
    batch, tokens = sizing.max_batch, sizing.max_tokens
    plan.max_tokens = _largest(sizing.min_tokens, sizing.token_limit, lambda t: sizing.bytes_for(batch, t) <= room)
    plan.max_batch = _largest(sizing.min_batch, sizing.batch_limit, lambda b: sizing.bytes_for(b, tokens) <= room)
    return plan


def _largest(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest n in [low, high] with fits(n), for a fits() true up to some n and false after."""
    if not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
