"""The stage graph as a picture: the layered layout of engine/graph_layout.py as SVG, or rasterized to PNG by
matplotlib; no Graphviz needed. PHASE_COLORS is stated once, in graph_layout, and shared with the report."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import networkx as nx

from llmplan.ownership import write_file

from .graph import DATA, phase_of
from .graph_layout import (
    EDGE_COLORS,
    EDGE_PX,
    LINE,
    PAD,
    PHASE_COLORS,
    TEXT_PX,
    TITLE_PX,
    Item,
    Layout,
    build_layout,
    edge_points,
    graph_svg,
    stage_lines,
)


def draw_graph(graph: nx.DiGraph, out: Path, labels: dict[str, str] | None = None, title: str = "") -> Path:
    """SVG (text as text) or PNG (the same layout, rasterized by matplotlib at 2x) of the plan graph."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".svg":
        return write_file(out, graph_svg(graph, labels, title or "stage graph"), "-o")
    from llmplan.cache_home import settle_matplotlib_home

    settle_matplotlib_home()  # before matplotlib's import: its font cache in llmplan's cache home, not $HOME
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines, dimmed = stage_lines(graph, labels)
    layout = build_layout(graph, lines)
    margin, head = 16.0, 34.0
    width, height = layout.width + 2 * margin, layout.height + head + 2 * margin
    px = 1 / 72  # draw in points: 1 layout px = 1 pt, so the fonts' px sizes carry over
    fig = plt.figure(figsize=(width * px, height * px))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)  # y grows downwards, as in the SVG
    ax.axis("off")
    origin = (margin, head + margin)
    ax.text(margin, margin + 14, title or "stage graph", fontsize=16, weight="bold")
    if layout.always_rank is not None:  # the always-stages' band, as in the SVG
        _always_band(ax, layout, origin, width, margin)
    _edges(ax, layout, origin)
    for item in layout.items.values():
        if item.stage is None:
            _edge_label(ax, item, origin)
        else:
            _stage_box(ax, item, origin, lines[item.stage], phase_of(graph, item.stage), item.stage in dimmed)
    picture = io.BytesIO()  # drawn in memory, written atomically and only onto a path llmplan owns
    fig.savefig(picture, format="png", dpi=144)
    plt.close(fig)
    return write_file(out, picture.getvalue(), "-o")


def _always_band(ax: Any, layout: Layout, origin: tuple[float, float], width: float, margin: float) -> None:
    from matplotlib.patches import FancyBboxPatch

    band = [i for i in layout.items.values() if i.rank >= (layout.always_rank or 0) and i.stage]
    top = min(i.y - i.height / 2 for i in band) + origin[1] - 24
    bottom = max(i.y + i.height / 2 for i in band) + origin[1] + 8
    ax.add_patch(
        FancyBboxPatch(
            (margin / 2, top),
            width - margin,
            bottom - top,
            boxstyle="round,pad=0,rounding_size=8",
            facecolor="#f8f9fa",
            edgecolor="#868e96",
            linestyle="--",
        )
    )
    ax.text(
        margin,
        top + 12,
        "always run, last (after a failure or Ctrl-C too): cleanup",
        fontsize=TEXT_PX,
        color="#495057",
        va="center",
    )


def _edges(ax: Any, layout: Layout, origin: tuple[float, float]) -> None:
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path as MplPath

    ox, oy = origin
    for _src, _dst, kind, chain in layout.edges:
        points = [(x + ox, y + oy) for x, y in edge_points(layout, chain)]
        verts, codes = [points[0]], [MplPath.MOVETO]
        for i in range(1, len(points)):
            (x0, y0), (x1, y1) = points[i - 1], points[i]
            if i % 2 == 0:
                mid = (y0 + y1) / 2
                verts += [(x0, mid), (x1, mid), (x1, y1)]
                codes += [MplPath.CURVE4] * 3
            else:
                verts.append((x1, y1))
                codes.append(MplPath.LINETO)
        style = "-" if kind == DATA else "--"
        ax.add_patch(PathPatch(MplPath(verts, codes), fill=False, edgecolor=EDGE_COLORS[kind], linestyle=style, lw=1.2))
        ax.plot([points[-1][0]], [points[-1][1]], marker="v", color=EDGE_COLORS[kind], markersize=6)


def _edge_label(ax: Any, item: Item, origin: tuple[float, float]) -> None:
    if item.label:
        ax.text(
            item.x + origin[0],
            item.y + origin[1],
            item.label,
            fontsize=EDGE_PX,
            ha="center",
            va="center",
            color="#1864ab",
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
        )


def _stage_box(ax: Any, item: Item, origin: tuple[float, float], lines: list[str], phase: str, dimmed: bool) -> None:
    from matplotlib.patches import FancyBboxPatch

    x, y = item.x + origin[0], item.y + origin[1]
    fill = "#f1f3f5" if dimmed else PHASE_COLORS.get(phase, PHASE_COLORS["other"])
    ax.add_patch(
        FancyBboxPatch(
            (x - item.width / 2, y - item.height / 2),
            item.width,
            item.height,
            boxstyle="round,pad=0,rounding_size=7",
            facecolor=fill,
            edgecolor="#343a40",
            linestyle="--" if dimmed else "-",
        )
    )
    top = y - item.height / 2
    for i, text in enumerate(lines):
        ax.text(
            x,
            top + PAD + LINE * i + LINE / 2,
            text,
            ha="center",
            va="center",
            fontsize=TITLE_PX if i == 0 else TEXT_PX,
            weight="bold" if i == 0 else "normal",
        )
