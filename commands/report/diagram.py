"""Boxes and labelled arrows for the data-flow pictures (matplotlib patches, no Graphviz).

A box's text stays inside it: its lines are wrapped (at spaces, else after a path's `/`), never cut, and a text
still wider than its box once drawn is set smaller until it fits (measured by matplotlib's renderer, with room
for a browser's font, which draws the SVG's text)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from .common import plt, save

WIDTH, GAP, LINE = 2.7, 1.7, 0.32
CHARS = 30  # a body line's characters before it is wrapped (7.5 pt in a box WIDTH wide)
FILL = 0.92  # the share of a box's width its text may take (a browser's font may be a little wider)
SMALLEST = 4.5  # points: a text is never set smaller than this to fit


def wrap(line: str, width: int = CHARS) -> list[str]:
    """`line` as lines of at most `width` characters where it can be broken: at spaces, else after `/`, `:` or
    `,` (a sink's path), else anywhere. Nothing is dropped, and no space is put into a word."""
    out: list[str] = []
    current = ""
    for word in line.split(" "):
        joined = f"{current} {word}" if current else word
        if len(joined) <= width:
            current = joined
            continue
        if current:
            out.append(current)
        while len(word) > width:  # one long word (a path): broken after a separator where there is one
            cut = max(word.rfind(sep, 1, width) for sep in "/:,") + 1 or width
            out.append(word[:cut])
            word = word[cut:]
        current = word
    return [*out, current]


@dataclass
class Box:
    title: str
    lines: list[str] = field(default_factory=list)
    color: str = "#e9ecef"
    missing: bool = False  # the stage is not in the plan (or did not run): drawn hatched, numbers not invented

    @property
    def body(self) -> list[str]:
        return [part for line in self.lines for part in wrap(line)]

    @property
    def height(self) -> float:
        return 0.55 + LINE * (1 + len(self.body))


@dataclass
class Below:
    """A box under column `column`, joined to it by a down arrow and an up arrow (e.g. the KV cache)."""

    column: int
    box: Box
    down: str
    up: str


def _draw_box(ax: Any, box: Box, x: float, y: float) -> tuple[float, float, float, float]:
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
    ax.add_patch(patch)
    gid = f"box{len(ax.patches)}"
    patch.set_gid(gid)
    title = ax.text(x + WIDTH / 2, y + h / 2 - 0.3, box.title, ha="center", va="top", fontsize=9, weight="bold")
    title.set_gid(f"{gid}-title")
    body = "\n".join(box.body)
    if body:
        text = ax.text(
            x + WIDTH / 2, y + h / 2 - 0.3 - LINE * 1.15, body, ha="center", va="top", fontsize=7.5, linespacing=1.35
        )
        text.set_gid(f"{gid}-body")
    return x, y - h / 2, x + WIDTH, y + h / 2


def boxed_texts(fig: Any) -> list[tuple[Any, Any]]:
    """Each box's texts with the box: (text, patch) pairs, by the gids `_draw_box` gives them."""
    ax = fig.axes[0]
    patches = {p.get_gid(): p for p in ax.patches if p.get_gid()}
    return [(t, patches[t.get_gid().rsplit("-", 1)[0]]) for t in ax.texts if (t.get_gid() or "").startswith("box")]


def fit_texts(fig: Any) -> None:
    """Set each box's text smaller until it is no wider than FILL of its box (measured, not guessed)."""
    renderer = fig.canvas.get_renderer()
    for text, patch in boxed_texts(fig):
        room = patch.get_window_extent(renderer).width * FILL
        while text.get_window_extent(renderer).width > room and text.get_fontsize() > SMALLEST:
            text.set_fontsize(max(SMALLEST, text.get_fontsize() * 0.92))


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
    return save(flow_figure(title, columns, arrows, below, footer), path)


def flow_figure(
    title: str, columns: list[list[Box]], arrows: list[str], below: list[Below] | None = None, footer: str = ""
) -> Any:
    """The figure `draw_flow` saves (its texts fitted to their boxes)."""
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
    fit_texts(fig)
    return fig
