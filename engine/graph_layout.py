"""The plan graph as an SVG a person can read: a layered (Sugiyama-style) layout, top to bottom, no Graphviz.

1. Rank: each stage one rank below the deepest stage it depends on; `always` stages (release) in a band of
   their own at the bottom. Ranks are doubled: stages sit on even ranks, and every edge gets a virtual node
   on each odd and even rank it crosses; the first one carries the edge's label (the slots it passes), and
   on a long edge (across LONG ranks of stages or more) the last one too, just above the stage it reaches.
   Labels thus take room in the layout like boxes do, so none overlaps a box or another label.
2. Order each rank by the barycentre of its neighbours, sweeping down and up, keeping the order with the
   fewest crossings.
3. Place: x = least-squares closest to the neighbours' mean under "keep order, keep apart" (isotonic
   regression, pool-adjacent-violators), iterated; y by rank.
4. Draw: an edge runs straight down through its virtual nodes' reserved columns and curves only in the gaps
   between ranks, so it never passes through a box.

Sizes are in CSS pixels, the text at 12-14 px: the page shows the SVG at its own size (scrolling if wide),
never shrunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from html import escape

import networkx as nx

from .graph import DATA, FILL, ORDER, execution_order, phase_of

PHASE_COLORS = {
    "load": "#9ec5fe",
    "compute": "#ffc078",
    "output": "#8ce99a",
    "observe": "#d0bfff",
    "other": "#dee2e6",
}
TITLE_PX, TEXT_PX, EDGE_PX = 14, 12, 11
CHAR_EM = 0.6  # mean advance of a sans-serif character, in em (generous: boxes never clip their text)
PAD, GAP_X, GAP_Y, LINE = 10, 22, 16, 17
EDGE_COLORS = {DATA: "#495057", ORDER: "#adb5bd", FILL: "#ae3ec9"}
EDGE_KEYS = {DATA: "passes slots", ORDER: "order only (after)", FILL: "may fill (cache)"}
LONG = 3  # an edge across this many ranks of stages or more is labelled at its end as well as its start


def text_width(text: str, px: float) -> float:
    return max((len(line) for line in text.split("\n")), default=0) * px * CHAR_EM


@dataclass
class Item:
    """A box (stage) or a virtual node (part of an edge; `label` set on the first one of each edge)."""

    key: str
    rank: int
    width: float
    height: float
    stage: str | None = None
    label: str = ""
    x: float = 0.0
    y: float = 0.0
    band: tuple[float, float] = (0.0, 0.0)  # top and bottom of its rank: an edge crosses it straight down


@dataclass
class Layout:
    items: dict[str, Item]
    ranks: list[list[str]]
    edges: list[tuple[str, str, str, list[str]]] = field(default_factory=list)  # (src, dst, kind, chain of keys)
    width: float = 0.0
    height: float = 0.0
    always_rank: int | None = None


def _rank_stages(graph: nx.DiGraph) -> tuple[dict[str, int], int | None]:
    depth: dict[str, int] = {}
    always = [n for n in graph if graph.nodes[n]["stage"].cls.always]
    for node in execution_order(graph):
        if node in always:
            continue
        depth[node] = max((depth[p] + 1 for p in graph.predecessors(node) if p in depth), default=0)
    band = None
    if always:
        band = max(depth.values(), default=-1) + 1
        for node in always:
            depth[node] = max([band, *(depth[p] + 1 for p in graph.predecessors(node) if p in depth)])
        band = min(depth[n] for n in always)
    return depth, band


def _edge_kind(kinds: set[str]) -> str:
    return DATA if DATA in kinds else (FILL if FILL in kinds else ORDER)


def build_layout(graph: nx.DiGraph, lines: dict[str, list[str]]) -> Layout:
    """Items and their positions. lines[node]: the box's text lines (first one the title)."""
    depth, band = _rank_stages(graph)
    items: dict[str, Item] = {}
    for node in graph:
        text = lines[node]
        width = max(text_width(text[0], TITLE_PX), *(text_width(t, TEXT_PX) for t in text[1:])) + 2 * PAD
        items[node] = Item(node, 2 * depth[node], width, 2 * PAD + LINE * len(text), stage=node)
    layout = Layout(items, [], always_rank=None if band is None else 2 * band)
    for src, dst, data in graph.edges(data=True):
        kind = _edge_kind(data["kinds"])
        label = ", ".join(sorted(data["slots"]))
        chain = [src, *_virtual_nodes(items, f"{src}->{kind}:{label}", label, 2 * depth[src], 2 * depth[dst]), dst]
        layout.edges.append((src, dst, kind, chain))
    n_ranks = max(i.rank for i in items.values()) + 1 if items else 0
    order = {n: i for i, n in enumerate(execution_order(graph))}
    ranks: list[list[str]] = [[] for _ in range(n_ranks)]
    for key, item in items.items():
        ranks[item.rank].append(key)
    for rank in ranks:  # start in execution order; a virtual node follows its edge's source
        rank.sort(key=lambda k: order.get(k.split("->")[0], 0))
    layout.ranks = _order(ranks, layout.edges)
    _place(layout)
    return layout


def _virtual_nodes(items: dict[str, Item], trunk: str, label: str, top: int, bottom: int) -> list[str]:
    """An edge's virtual nodes from rank `top` to `bottom` (its stages'), labelled at the first and, on a long
    edge, the last. Edges from one stage carrying the same slots share them: one trunk, branching off at each
    reader (a slot read by many stages is drawn once, not once per reader)."""
    keys = []
    long = bottom - top >= 2 * LONG
    for rank in range(top + 1, bottom):
        key = f"{trunk}#{rank}"
        labelled = bool(label) and (rank == top + 1 or (long and rank == bottom - 1))
        if key not in items or (labelled and not items[key].label):
            width = text_width(label, EDGE_PX) + 8 if labelled else 8
            items[key] = Item(key, rank, width, LINE if labelled else 0, label=label if labelled else "")
        keys.append(key)
    return keys


def _neighbours(edges: list[tuple[str, str, str, list[str]]]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    up: dict[str, list[str]] = {}
    down: dict[str, list[str]] = {}
    for _, _, _, chain in edges:
        for a, b in itertools.pairwise(chain):
            if b not in down.setdefault(a, []):
                down[a].append(b)
                up.setdefault(b, []).append(a)
    return up, down


def _crossings(ranks: list[list[str]], down: dict[str, list[str]]) -> int:
    total = 0
    for upper, lower in itertools.pairwise(ranks):
        pos = {k: i for i, k in enumerate(lower)}
        pairs = [(i, pos[b]) for i, a in enumerate(upper) for b in down.get(a, []) if b in pos]
        total += sum(1 for j, (a1, b1) in enumerate(pairs) for a2, b2 in pairs[j + 1 :] if (a1 - a2) * (b1 - b2) < 0)
    return total


def _order(ranks: list[list[str]], edges: list[tuple[str, str, str, list[str]]]) -> list[list[str]]:
    up, down = _neighbours(edges)
    best, best_cross = [list(r) for r in ranks], _crossings(ranks, down)
    current = [list(r) for r in ranks]
    for sweep in range(12):
        downward = sweep % 2 == 0
        indexes = range(1, len(current)) if downward else range(len(current) - 2, -1, -1)
        for r in indexes:
            ref = current[r - 1] if downward else current[r + 1]
            pos = {k: i for i, k in enumerate(ref)}
            links = up if downward else down

            here = {k: i for i, k in enumerate(current[r])}  # the list is empty while it sorts

            def bary(
                key: str, pos: dict[str, int] = pos, links: dict[str, list[str]] = links, here: dict[str, int] = here
            ) -> float:
                near = [pos[n] for n in links.get(key, []) if n in pos]
                return sum(near) / len(near) if near else float(here[key])

            current[r].sort(key=bary)
        cross = _crossings(current, down)
        if cross < best_cross:
            best, best_cross = [list(r) for r in current], cross
    return best


def _isotonic(targets: list[float], widths: list[float]) -> list[float]:
    """Centres closest (least squares) to `targets` with centre[i+1] - centre[i] >= (w_i + w_i+1)/2 + GAP_X."""
    offsets = [0.0]
    for a, b in itertools.pairwise(widths):
        offsets.append(offsets[-1] + (a + b) / 2 + GAP_X)
    values = [t - o for t, o in zip(targets, offsets, strict=True)]
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    fitted = [m for m, c in blocks for _ in range(int(c))]
    return [f + o for f, o in zip(fitted, offsets, strict=True)]


def _place(layout: Layout) -> None:
    items, ranks = layout.items, layout.ranks
    up, down = _neighbours(layout.edges)
    for rank in ranks:
        x = 0.0
        for key in rank:
            items[key].x = x + items[key].width / 2
            x += items[key].width + GAP_X
    for sweep in range(16):
        downward = sweep % 2 == 0
        order = ranks if downward else list(reversed(ranks))
        for rank in order:
            if not rank:
                continue
            targets = []
            for key in rank:
                near = [items[n].x for n in (up if downward else down).get(key, [])]
                near += [items[n].x for n in (down if downward else up).get(key, [])] if sweep > 8 else []
                targets.append(sum(near) / len(near) if near else items[key].x)
            for key, x in zip(rank, _isotonic(targets, [items[k].width for k in rank]), strict=True):
                items[key].x = x
    left = min((i.x - i.width / 2 for i in items.values()), default=0.0)
    y = 0.0
    for rank in ranks:
        height = max((items[k].height for k in rank), default=0.0)
        for key in rank:
            items[key].x -= left
            items[key].y = y + height / 2
            items[key].band = (y, y + height)
        y += height + GAP_Y
    layout.width = max((i.x + i.width / 2 for i in items.values()), default=0.0)
    layout.height = y - GAP_Y


def _edge_path(layout: Layout, chain: list[str]) -> str:
    """Straight down through each rank's band (at a column no box takes), a cubic curve across each gap."""
    points = edge_points(layout, chain)
    d = f"M{points[0][0]:.1f},{points[0][1]:.1f}"
    for i in range(1, len(points)):
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        if i % 2 == 0:  # from one band to the next: a curve in the gap, where there are no boxes
            mid = (y0 + y1) / 2
            d += f" C{x0:.1f},{mid:.1f} {x1:.1f},{mid:.1f} {x1:.1f},{y1:.1f}"
        else:
            d += f" L{x1:.1f},{y1:.1f}"
    return d


def stage_lines(graph: nx.DiGraph, labels: dict[str, str] | None) -> tuple[dict[str, list[str]], set[str]]:
    """Each box's text (id, uses, the caller's label lines), and the stages drawn dimmed (did not run)."""
    lines: dict[str, list[str]] = {}
    dimmed: set[str] = set()
    for node in graph:
        uses = graph.nodes[node]["stage"].spec.uses
        extra = (labels or {}).get(node, "")
        lines[node] = [node, uses, *[t for t in extra.split("\n") if t]]
        if extra.startswith(("not run", "skipped", "failed")):
            dimmed.add(node)
    return lines, dimmed


def edge_points(layout: Layout, chain: list[str]) -> list[tuple[float, float]]:
    """The polyline of an edge: pairs of points, straight within a rank's band, a curve between bands."""
    items = layout.items
    first, last = items[chain[0]], items[chain[-1]]
    points = [(first.x, first.y + first.height / 2), (first.x, first.band[1])]
    for key in chain[1:-1]:
        points += [(items[key].x, items[key].band[0]), (items[key].x, items[key].band[1])]
    points += [(last.x, last.band[0]), (last.x, last.y - last.height / 2)]
    return points


def graph_svg(graph: nx.DiGraph, labels: dict[str, str] | None = None, title: str = "") -> str:
    """The plan graph as a standalone SVG document (text as <text>, sizes in px)."""
    lines, dimmed = stage_lines(graph, labels)
    layout = build_layout(graph, lines)
    margin, head = 16.0, 34.0 if title else 8.0
    legend_h = 30.0
    phases = sorted({phase_of(graph, n) for n in graph})
    legend_w = sum(30 + text_width(p, TEXT_PX) for p in phases) + sum(
        44 + text_width(w, TEXT_PX) for w in EDGE_KEYS.values()
    )
    width = max(layout.width + 2 * margin, legend_w + 2 * margin, 520.0)
    height = layout.height + head + legend_h + 2 * margin + (26.0 if layout.always_rank is not None else 0.0)
    ox, oy = margin + (width - 2 * margin - layout.width) / 2, head + margin
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="plan-graph" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="system-ui, DejaVu Sans, sans-serif">',
        "<defs>",
        *(
            f'<marker id="arrow-{kind}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" markerHeight="8" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{color}"/></marker>'
            for kind, color in EDGE_COLORS.items()
        ),
        "</defs>",
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
    ]
    if title:
        out.append(f'<text x="{margin}" y="{margin + 14}" font-size="16" font-weight="bold">{escape(title)}</text>')
    if layout.always_rank is not None:
        out += _svg_always_band(layout, oy, width, margin)
    out += _svg_edges(graph, layout, ox, oy)
    for item in layout.items.values():
        x, y = item.x + ox, item.y + oy
        if item.stage is None:
            if item.label:
                out.append(
                    f'<text x="{x:.1f}" y="{y + 4:.1f}" font-size="{EDGE_PX}" text-anchor="middle" fill="#1864ab" '
                    f'stroke="white" stroke-width="4" paint-order="stroke">{escape(item.label)}</text>'
                )
            continue
        out += _svg_stage(item, x, y, lines[item.stage], phase_of(graph, item.stage), item.stage in dimmed)
    out += _svg_legend(phases, margin, height - margin - 8)
    out.append("</svg>")
    return "\n".join(out)


def _svg_always_band(layout: Layout, oy: float, width: float, margin: float) -> list[str]:
    band = [i for i in layout.items.values() if i.rank >= (layout.always_rank or 0) and i.stage]
    top = min(i.y - i.height / 2 for i in band) + oy - 24
    bottom = max(i.y + i.height / 2 for i in band) + oy + 8
    return [
        f'<rect x="{margin / 2:.1f}" y="{top:.1f}" width="{width - margin:.1f}" height="{bottom - top:.1f}" '
        'fill="#f8f9fa" stroke="#868e96" stroke-dasharray="6 4" rx="8"/>',
        f'<text x="{margin:.1f}" y="{top + 16:.1f}" font-size="{TEXT_PX}" fill="#495057">always run, last '
        "(after a failure or Ctrl-C too): cleanup</text>",
    ]


def _svg_edges(graph: nx.DiGraph, layout: Layout, ox: float, oy: float) -> list[str]:
    out = []
    for src, dst, kind, chain in layout.edges:
        dash = ' stroke-dasharray="5 4"' if kind != DATA else ""
        slots = ", ".join(sorted(graph.edges[src, dst]["slots"])) or kind
        out.append(
            f'<path d="{_edge_path(layout, chain)}" transform="translate({ox:.1f},{oy:.1f})" fill="none" '
            f'stroke="{EDGE_COLORS[kind]}" stroke-width="1.4"{dash} marker-end="url(#arrow-{kind})">'
            f"<title>{escape(src)} → {escape(dst)}: {escape(slots)}</title></path>"
        )
    return out


def _svg_stage(item: Item, x: float, y: float, lines: list[str], phase: str, dimmed: bool) -> list[str]:
    fill = "#f1f3f5" if dimmed else PHASE_COLORS.get(phase, PHASE_COLORS["other"])
    dash = ' stroke-dasharray="5 3"' if dimmed else ""
    left, top = x - item.width / 2, y - item.height / 2
    out = [f'<g class="stage"><title>{escape(" · ".join(lines))}</title>']
    out.append(
        f'<rect x="{left:.1f}" y="{top:.1f}" width="{item.width:.1f}" height="{item.height:.1f}" rx="7" '
        f'fill="{fill}" stroke="#343a40" stroke-width="1.2"{dash}/>'
    )
    for i, text in enumerate(lines):
        size, weight = (TITLE_PX, ' font-weight="bold"') if i == 0 else (TEXT_PX, "")
        colour = "#212529" if i < 2 else "#495057"
        out.append(
            f'<text x="{x:.1f}" y="{top + PAD + LINE * i + size - 2:.1f}" font-size="{size}"{weight} '
            f'text-anchor="middle" fill="{colour}">{escape(text)}</text>'
        )
    out.append("</g>")
    return out


def _svg_legend(phases: list[str], lx: float, ly: float) -> list[str]:
    out = []
    for phase in phases:
        colour = PHASE_COLORS.get(phase, PHASE_COLORS["other"])
        out.append(
            f'<rect x="{lx:.1f}" y="{ly - 11:.1f}" width="14" height="14" rx="3" fill="{colour}" '
            f'stroke="#343a40"/><text x="{lx + 20:.1f}" y="{ly:.1f}" font-size="{TEXT_PX}">{escape(phase)}</text>'
        )
        lx += 30 + text_width(phase, TEXT_PX)
    for kind, what in EDGE_KEYS.items():
        dash = ' stroke-dasharray="5 4"' if kind != DATA else ""
        out.append(
            f'<line x1="{lx:.1f}" y1="{ly - 4:.1f}" x2="{lx + 28:.1f}" y2="{ly - 4:.1f}" stroke="{EDGE_COLORS[kind]}" '
            f'stroke-width="1.4"{dash}/><text x="{lx + 34:.1f}" y="{ly:.1f}" font-size="{TEXT_PX}">{what}</text>'
        )
        lx += 44 + text_width(what, TEXT_PX)
    return out
