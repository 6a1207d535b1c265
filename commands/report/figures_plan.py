"""The plan's stage graph, rebuilt from plan.resolved.yaml, each stage labelled with its time and memory.

Drawn by the engine's layered layout (engine/graph_layout.py) as inline SVG markup: real text at 11-14 px,
shown at its own size (the section scrolls sideways on a narrow window rather than shrink the text).
"""

from __future__ import annotations

from pathlib import Path

from llmplan.ownership import write_file

from .common import Figure, mib
from .run_data import RunData


def stage_label(record: dict | None, replayed: bool = False) -> str:
    if record is None:
        return "not run"
    status = record.get("status", "?")
    if status == "skipped" and replayed:
        return "skipped: answers replayed\nfrom the results cache"
    if status != "ok":
        return status
    delta = (record.get("rss_after") or 0) - (record.get("rss_before") or 0)
    text = f"{record.get('wall_s', 0.0):.3f} s, RSS {'+' if delta >= 0 else '-'}{mib(abs(delta))}"
    if record.get("device_before") is not None and record.get("device_after") is not None:
        ddev = record["device_after"] - record["device_before"]
        text += f"\ndevice {'+' if ddev >= 0 else '-'}{mib(abs(ddev))}"
    return text


def draw_plan_graph(run: RunData, out_dir: Path) -> list[Figure]:
    from llmplan.engine.findings import PlanError
    from llmplan.engine.graph_layout import graph_svg
    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover

    title = "Plan graph"
    plan_path = run.run_dir / "plan.resolved.yaml"
    if not plan_path.is_file():
        return [Figure("plan", title, None, notes=["plan.resolved.yaml is missing from the run directory"])]
    try:
        bound = load_plan(plan_path, discover())
    except PlanError as bad:
        why = "; ".join(str(f) for f in bad.findings[:3])
        return [Figure("plan", title, None, warnings=[f"the plan no longer validates here: {why}"])]
    graph = bound.graph.dag
    labels = {node: stage_label(run.record(node), run.replayed is not None) for node in graph.nodes}
    svg = graph_svg(graph, labels, title=f"plan {bound.plan.name}")
    write_file(out_dir / "plan_graph.svg", svg)  # the same picture as a file of its own
    caption = (
        "Stages top to bottom in dependency order, coloured by phase, each with its wall time and the change of "
        "host memory (RSS) while it ran. Solid arrows carry the named slots; dashed ones only order stages or "
        "may fill a slot (a cache hit). Dashed grey boxes did not run. Click to open full size."
    )
    inline = svg.replace(' xmlns="http://www.w3.org/2000/svg"', "", 1)  # HTML needs no namespace: no URL on the page
    return [Figure("plan", title, None, caption, html=f"<figure>{inline}</figure>")]
