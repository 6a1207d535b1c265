"""The plan graph's layered layout: nothing overlaps, every edge is drawn, edges cross no box."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from llmplan.engine.graph import build_graph
from llmplan.engine.graph_layout import build_layout, edge_points, graph_svg, stage_lines
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover

PLANS = sorted(Path(__file__).resolve().parents[2].joinpath("plans").glob("*.yaml"))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.stem)
def test_layout_has_no_overlaps_and_every_edge(plan: Path) -> None:
    graph = build_graph(load_plan(plan, discover()).stages)
    lines, _ = stage_lines(graph, None)
    layout = build_layout(graph, lines)
    boxes = {k: i for k, i in layout.items.items() if i.stage is not None}
    assert set(boxes) == set(graph.nodes)
    assert {(s, d) for s, d, _, _ in layout.edges} == set(graph.edges)
    rects = {
        k: (i.x - i.width / 2, i.y - i.height / 2, i.x + i.width / 2, i.y + i.height / 2)
        for k, i in layout.items.items()
        if i.stage is not None or i.label
    }
    for (a, ra), (b, rb) in itertools.combinations(rects.items(), 2):  # boxes and edge labels
        disjoint = ra[2] <= rb[0] or rb[2] <= ra[0] or ra[3] <= rb[1] or rb[3] <= ra[1]
        assert disjoint, f"{a} overlaps {b}"
    for src, dst, _, chain in layout.edges:  # straight parts run down columns that no other box takes
        points = edge_points(layout, chain)
        for (x0, y0), (_x1, y1) in zip(points[::2], points[1::2], strict=True):
            for key, (left, top, right, bottom) in rects.items():
                if key in (src, dst) or layout.items[key].stage is None:
                    continue
                inside_x = left < x0 < right
                assert not (inside_x and max(y0, y1) > top and min(y0, y1) < bottom), f"{src}->{dst} crosses {key}"


def test_svg_text_is_at_least_11_px() -> None:
    graph = build_graph(load_plan(PLANS[0], discover()).stages)
    svg = graph_svg(graph, {n: "0.123 s, RSS +1.0 MiB" for n in graph.nodes}, "plan")
    sizes = [float(x) for x in __import__("re").findall(r'font-size="([\d.]+)"', svg)]
    assert sizes and min(sizes) >= 11
