"""What every figure module shares: the Figure record, number formatting, and saving a figure as SVG (Agg).

Pictures are vector (SVG with real <text>), so they stay crisp at any width; colours of the phases and
the byte formatting are the engine's (one definition for the graph command, the console and this page).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmplan.cache_home import settle_matplotlib_home
from llmplan.engine import memory
from llmplan.engine.graph_layout import PHASE_COLORS
from llmplan.ownership import write_file

settle_matplotlib_home()  # before matplotlib's import: its font cache goes to llmplan's cache home, not $HOME

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only: no display, no GUI toolkit

import matplotlib.pyplot as plt  # noqa: E402

from .fonts import with_cjk_fallbacks  # noqa: E402

MISSING = "not recorded"
plt.rcParams["svg.fonttype"] = "none"  # text stays text: selectable, measurable, sharp
plt.rcParams["svg.hashsalt"] = "llmplan"  # stable ids: the same run draws the same file
# every text's font-family ends in CJK fonts: the browser draws what the drawing machine has no glyphs for
plt.rcParams["font.sans-serif"] = with_cjk_fallbacks(list(plt.rcParams["font.sans-serif"]))
__all__ = ["MISSING", "PHASE_COLORS", "Figure", "mib", "plt", "rate", "save", "save_as", "seconds"]


@dataclass
class Figure:
    """One section of the report: a picture (`path`, SVG) and/or an HTML block, or the reason neither could be
    drawn. `notes` are neutral remarks; `warnings` are things that make the numbers less trustworthy."""

    key: str
    title: str
    path: Path | None
    caption: str = ""
    notes: list[str] = field(default_factory=list)
    html: str = ""  # markup of its own (the generation view, the inline plan graph)
    warnings: list[str] = field(default_factory=list)

    @property
    def drawn(self) -> bool:
        return self.path is not None or bool(self.html)


def mib(nbytes: float | None) -> str:
    return memory.mib(nbytes, MISSING)


def seconds(value: float | None) -> str:
    if value is None:
        return MISSING
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def rate(count: float | None, wall: float | None, unit: str) -> str:
    if count is None or not wall:
        return MISSING
    return f"{count / wall:,.1f} {unit}/s"


def save(fig: Any, path: Path) -> Path:
    """Write `fig` as SVG (whatever suffix `path` has); returns the .svg path."""
    path = path.with_suffix(".svg")
    path.parent.mkdir(parents=True, exist_ok=True)
    picture = io.BytesIO()  # drawn in memory, written atomically and only onto a path llmplan owns
    _savefig(fig, picture, "svg")
    return write_file(path, picture.getvalue())


def save_as(fig: Any, path: Path, what: str = "") -> Path:
    """Write `fig` as SVG or PNG (by the suffix, 144 dpi) onto a path llmplan may write; returns `path`."""
    kind = "png" if path.suffix.lower() == ".png" else "svg"
    path.parent.mkdir(parents=True, exist_ok=True)
    picture = io.BytesIO()
    _savefig(fig, picture, kind, dpi=144)
    return write_file(path, picture.getvalue(), what)


def _savefig(fig: Any, picture: io.BytesIO, kind: str, **options: Any) -> None:
    """Draw `fig` into `picture`, then close it. A glyph the drawing machine's fonts lack is measured as a box
    and left to the browser (SVG text names CJK fallbacks): matplotlib's warning about it is not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font", category=UserWarning)
        fig.savefig(picture, format=kind, bbox_inches="tight", **options)
    plt.close(fig)


MOST_PANELS = 6  # requests drawn one panel each; the rest are counted in the caption


@dataclass
class RequestPanels:
    """A figure of one panel per request, for the run's requests whose record carries `key` (the first
    MOST_PANELS of them); `axes` pairs with `shown`."""

    records: list[dict[str, Any]]
    fig: Any
    axes: Any

    @classmethod
    def of(cls, generations: list[dict[str, Any]] | None, key: str, panel_height: float) -> RequestPanels | None:
        records = [r for r in generations or [] if r.get(key)]
        if not records:
            return None  # nothing of that kind ran: nothing to show
        count = min(len(records), MOST_PANELS)
        size = (12, panel_height * count + 0.6)
        fig, axes = plt.subplots(count, 1, figsize=size, layout="constrained", squeeze=False)
        return cls(records, fig, axes)

    @property
    def shown(self) -> list[dict[str, Any]]:
        return self.records[:MOST_PANELS]

    def panels(self) -> list[tuple[Any, dict[str, Any]]]:
        return list(zip(self.axes[:, 0], self.shown, strict=True))

    def not_drawn(self, did: str) -> str:
        """The caption's last sentence: how many more requests `did` (e.g. "speculated") and are not drawn."""
        left = len(self.records) - len(self.shown)
        return f" {left} more request(s) {did} and are not drawn." if left else ""

