"""The stage graph as a picture: SVG from the layered layout (engine/graph_layout.py), PNG through matplotlib;
no Graphviz needed. PHASE_COLORS is stated once, in graph_layout, and shared with the report."""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from .graph import DATA, execution_order, layout_layers, phase_of
from .graph_layout import PHASE_COLORS, graph_svg


def draw_graph(graph: nx.DiGraph, out: Path, labels: dict[str, str] | None = None, title: str = "") -> Path:
    if out.suffix.lower() == ".svg":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(graph_svg(graph, labels, title or "stage graph"), encoding="utf-8")
        return out
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pos = layout_layers(graph)
    columns = max((x for x, _ in pos.values()), default=0) + 1
    rows = max((-y for _, y in pos.values()), default=0) + 1
    fig, ax = plt.subplots(figsize=(max(8.0, 2.6 * columns), max(3.0, 1.5 * rows + 1)))
    order = execution_order(graph)
    colors = [PHASE_COLORS.get(phase_of(graph, n), "#dee2e6") for n in order]
    data_edges = [(u, v) for u, v, d in graph.edges(data=True) if DATA in d["kinds"]]
    other_edges = [(u, v) for u, v, d in graph.edges(data=True) if DATA not in d["kinds"]]
    nx.draw_networkx_edges(graph, pos, edgelist=data_edges, ax=ax, arrows=True, node_size=3800, edge_color="#495057")
    nx.draw_networkx_edges(
        graph, pos, edgelist=other_edges, ax=ax, arrows=True, node_size=3800, style="dashed", edge_color="#adb5bd"
    )
    nx.draw_networkx_nodes(graph, pos, nodelist=order, node_color=colors, node_shape="s", node_size=3800, ax=ax)
    text = {}
    for node in order:
        uses = graph.nodes[node]["stage"].spec.uses
        extra = f"\n{labels[node]}" if labels and node in labels else ""
        text[node] = f"{node}\n{uses}{extra}"
    nx.draw_networkx_labels(graph, pos, labels=text, font_size=7, ax=ax)
    edge_text = {(u, v): ", ".join(sorted(d["slots"])) for u, v, d in graph.edges(data=True) if d["slots"]}
    nx.draw_networkx_edge_labels(graph, pos, edge_labels=edge_text, font_size=6, ax=ax, label_pos=0.5)
    phases = sorted({phase_of(graph, n) for n in order})
    ax.legend(
        handles=[Patch(color=PHASE_COLORS.get(p, "#dee2e6"), label=p) for p in phases]
        + ([Patch(color="#adb5bd", label="after / fill (order only)")] if other_edges else []),
        loc="upper left",
        fontsize=8,
    )
    ax.set_title(title or "stage graph")
    ax.axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
