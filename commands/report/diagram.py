"""Boxes and labelled arrows for the data-flow pictures (matplotlib patches, no Graphviz)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from .common import plt, save

WIDTH, GAP, LINE = 2.7, 1.7, 0.32


@dataclass
class Box:
    title: str
    lines: list[str] = field(default_factory=list)
    color: str = "#e9ecef"
    missing: bool = False  # the stage is not in the plan (or did not run): drawn hatched, numbers not invented

    @property
    def height(self) -> float:
        return 0.55 + LINE * (1 + len(self.lines))


@dataclass
class Below:
    """A box under column `column`, joined to it by a down arrow and an up arrow (e.g. the KV cache)."""

    column: int
    box: Box
    down: str
    up: str


def _draw_box(ax: object, box: Box, x: float, y: float) -> tuple[float, float, float, float]:
    h = box.height
    patch = FancyBboxPatch(
        (x, y - h / 2),
        WIDTH,
        h,
        boxstyle="round,pad=0.05,rounding_size=0.15",
        facecolor="#f8f9fa" if box.missing else box.color,
        edgecolor="#868e96" if box.missing else "#343a40",
        linestyle="--" if box.missing else "-",
        hatch="//" if box.missing else None,
        linewidth=1.2,
    )
    ax.add_patch(patch)  # type: ignore[attr-defined]
    ax.text(x + WIDTH / 2, y + h / 2 - 0.3, box.title, ha="center", va="top", fontsize=9, weight="bold")  # type: ignore[attr-defined]
    body = "\n".join(box.lines)
    if body:
        ax.text(
            x + WIDTH / 2, y + h / 2 - 0.3 - LINE * 1.15, body, ha="center", va="top", fontsize=7.5, linespacing=1.35
        )  # type: ignore[attr-defined]
    return x, y - h / 2, x + WIDTH, y + h / 2


def _arrow(ax: object, start: tuple[float, float], end: tuple[float, float], label: str, rad: float = 0.0) -> None:
    ax.add_patch(  # type: ignore[attr-defined]
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=14,
            linewidth=1.3,
            color="#495057",
            connectionstyle=f"arc3,rad={rad}",
        )
    )
    if label:
        mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
        ax.text(
            mx,
            my + 0.12,
            label,
            ha="center",
            va="bottom",
            fontsize=7,
            color="#1c7ed6",  # type: ignore[attr-defined]
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
        )


def draw_flow(
    title: str,
    columns: list[list[Box]],
    arrows: list[str],
    path: Path,
    below: list[Below] | None = None,
    footer: str = "",
) -> Path:
    """Columns of boxes left to right; arrows[i] labels the step from column i to column i+1."""
    below = below or []
    fig, ax = plt.subplots(figsize=(max(8.0, len(columns) * (WIDTH + GAP) * 0.95), 5.2 if below else 4.0))
    extents: list[list[tuple[float, float, float, float]]] = []
    for i, column in enumerate(columns):
        x = i * (WIDTH + GAP)
        heights = [b.height for b in column]
        total = sum(heights) + 0.4 * (len(column) - 1)
        y = total / 2
        placed = []
        for box, h in zip(column, heights, strict=True):
            placed.append(_draw_box(ax, box, x, y - h / 2))
            y -= h + 0.4
        extents.append(placed)
    for i, label in enumerate(arrows[: len(columns) - 1]):
        for j, (_, y0, x1, y1) in enumerate(extents[i]):
            for k, (x2, y2, _, y3) in enumerate(extents[i + 1]):
                first = j == 0 and k == 0
                _arrow(ax, (x1 + 0.07, (y0 + y1) / 2), (x2 - 0.07, (y2 + y3) / 2), label if first else "")
    low = min(e[1] for col in extents for e in col)
    for extra in below:
        x = extra.column * (WIDTH + GAP)
        top_box = extents[extra.column][-1]
        y = low - 1.0 - extra.box.height / 2
        _, by0, _, by1 = _draw_box(ax, extra.box, x, y)
        _arrow(ax, (x + WIDTH * 0.3, top_box[1] - 0.07), (x + WIDTH * 0.3, by1 + 0.07), "")
        _arrow(ax, (x + WIDTH * 0.7, by1 + 0.07), (x + WIDTH * 0.7, top_box[1] - 0.07), "")
        mid = (top_box[1] + by1) / 2
        ax.text(x + WIDTH * 0.3 - 0.08, mid, extra.down, ha="right", va="center", fontsize=7, color="#1c7ed6")
        ax.text(x + WIDTH * 0.7 + 0.08, mid, extra.up, ha="left", va="center", fontsize=7, color="#1c7ed6")
        low = min(low, by0)
    high = max(e[3] for col in extents for e in col)
    ax.set_xlim(-0.3, len(columns) * (WIDTH + GAP) - GAP + 0.3)
    ax.set_ylim(low - (0.7 if footer else 0.3), high + 0.5)
    if footer:
        ax.text(-0.2, low - 0.45, footer, ha="left", va="center", fontsize=7.5, color="#868e96")
    ax.set_title(title, fontsize=11)
    ax.set_aspect("equal")
    ax.axis("off")
    return save(fig, path)
