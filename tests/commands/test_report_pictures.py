"""Issue 57's picture fixes, measured on what is drawn: the output data-flow picture keeps its text inside its
boxes (a sink's path whole, wrapped, not cut), the Pareto picture of `compare` has labelled ticks on its log axis
and every plan's label inside its panel, the plan graph labels a long edge at both ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmplan.commands.compare_figure import figure
from llmplan.commands.report.common import plt
from llmplan.commands.report.diagram import Box, boxed_texts, flow_figure, wrap
from llmplan.engine.graph import build_graph
from llmplan.engine.graph_layout import LONG, build_layout, stage_lines
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover

PLANS = Path(__file__).resolve().parents[2] / "plans"
SINK = "json:/home/someone/.local/share/llmplan/out/llama-int8-with-a-long-name.json"


def _inside(inner: Any, outer: Any) -> bool:
    return outer.x0 <= inner.x0 and inner.x1 <= outer.x1 and outer.y0 <= inner.y0 and inner.y1 <= outer.y1


def test_the_output_flow_keeps_its_text_inside_its_boxes_and_the_sink_path_whole() -> None:
    release = ["freed 334.3 MiB", "RSS 661.7 MiB → 327.4 MiB", "released: model, model_runner, kv_cache, ext.observer"]
    columns = [[Box("text", ["1 completion(s)", "312 characters"])], [Box("sink", ["terminal"]), Box("sink", [SINK])]]
    fig = flow_figure("Output", [*columns, [Box("release", release)]], ["deliver", "then free memory"])
    renderer = fig.canvas.get_renderer()
    pairs = boxed_texts(fig)
    assert len(pairs) == 2 * 4  # a title and a body in each box
    for text, patch in pairs:
        assert _inside(text.get_window_extent(renderer), patch.get_window_extent(renderer)), text.get_text()
    bodies = [text.get_text() for text, _ in pairs]
    assert any(body.replace("\n", "") == SINK for body in bodies)  # wrapped, nothing cut
    plt.close(fig)


def test_wrap_breaks_at_spaces_then_after_a_paths_separators() -> None:
    assert wrap("released: model, model_runner, kv_cache", 20) == ["released: model,", "model_runner,", "kv_cache"]
    assert wrap("json:/tmp/qs/home/out/llama-int8.json", 24) == ["json:/tmp/qs/home/out/", "llama-int8.json"]


def test_the_pareto_picture_has_ticks_on_its_log_axis_and_no_label_out_of_its_panel() -> None:
    rows = [
        {"plan": "qwen2_5-0_5b-int8-with-a-long-name", "kl_mean": 0.0, "weights_bytes": 5e8, "kv_cache_bytes": 1e8},
        {"plan": "llama-int8", "kl_mean": 0.0042, "weights_bytes": 2.5e8, "kv_cache_bytes": 9e7},
        {"plan": "llama-int4-with-a-long-name", "kl_mean": 0.0061, "weights_bytes": 1.2e8, "kv_cache_bytes": 9e7},
    ]
    for row, speed in zip(rows, (30.0, 40.0, 44.0), strict=True):
        row["decode_tok_s_b1"] = speed
    fig = figure({"plans": rows, "batches": [1], "reference": {"plan": "llama-fp32", "change": ""}})
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert len(ticks) >= 3 and ticks[0] == "0", ticks
        panel = ax.get_window_extent(renderer)
        for label in ax.texts:
            assert _inside(label.get_window_extent(renderer), panel), label.get_text()
    plt.close(fig)


def test_the_plan_graph_labels_a_long_edge_at_both_ends() -> None:
    graph = build_graph(load_plan(PLANS / "llama-int8.yaml", discover()).stages)
    lines, _ = stage_lines(graph, None)
    layout = build_layout(graph, lines)
    long = [(src, dst, chain) for src, dst, _, chain in layout.edges if chain and len(chain) - 1 >= 2 * LONG]
    assert long, "llama-int8 has edges across several ranks"
    for src, dst, chain in long:
        slots = ", ".join(sorted(graph.edges[src, dst]["slots"]))
        labels = [layout.items[key].label for key in chain[1:-1]]
        assert labels[0] == slots and labels[-1] == slots, (src, dst, labels)
