"""What every figure module shares: the Figure record, number formatting, and saving a PNG (Agg)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt

MISSING = "not recorded"
PHASE_COLORS = {"load": "#9ec5fe", "compute": "#ffc078", "output": "#8ce99a", "observe": "#d0bfff"}
DPI = 110


@dataclass
class Figure:
    """One picture of the report (or the reason it could not be drawn: `path` is None)."""

    key: str
    title: str
    path: Path | None
    caption: str = ""
    notes: list[str] = field(default_factory=list)


def mib(nbytes: float | None) -> str:
    if nbytes is None:
        return MISSING
    if abs(nbytes) >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def seconds(value: float | None) -> str:
    if value is None:
        return MISSING
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def rate(count: float | None, wall: float | None, unit: str) -> str:
    if count is None or not wall:
        return MISSING
    return f"{count / wall:,.1f} {unit}/s"


def save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path
