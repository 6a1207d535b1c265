"""Assemble the report of a run directory: every figure as a PNG in RUN_DIR/report/, and index.html."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

from .common import Figure
from .figures_attention import draw_attention
from .figures_flow import draw_flows
from .figures_generation import draw_generation
from .figures_layers import draw_layer_timings
from .figures_memory import draw_memory
from .figures_model import draw_model_graph
from .figures_plan import draw_plan_graph
from .html import render_page
from .run_data import RunData

REPORT_DIR, PAGE = "report", "index.html"
Drawer = Callable[[RunData, Path], list[Figure]]
DRAWERS: list[tuple[str, str, Drawer]] = [
    ("plan", "Plan graph", draw_plan_graph),
    ("flows", "Data flow", draw_flows),
    ("model", "Model graph", draw_model_graph),
    ("memory", "Memory over time", draw_memory),
    ("layers", "Per-layer timings", draw_layer_timings),
    ("attention", "Attention heatmaps", draw_attention),
    ("generation", "Generation", draw_generation),
]


def _summary(run: RunData) -> list[tuple[str, object]]:
    info = run.run or {}
    rows: list[tuple[str, object]] = [
        ("plan", run.name),
        ("status", f"{info.get('status', '?')} — {info.get('message', '')}"),
        ("wall time", f"{info.get('wall_s', 0.0):.2f} s"),
        ("run directory", str(run.run_dir)),
    ]
    generate = next((run.metrics.get(s, {}) for s in run.stage_ids("compute.generate")), {})
    if generate.get("generated_tokens") is not None:
        rows.append(
            ("generated", f"{generate['generated_tokens']} tokens, {generate.get('tokens_per_s', 0):.1f} tok/s")
        )
    return rows


def build_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Draw every figure the run's files allow into RUN_DIR/report/ (or `out_dir`); return the HTML page.

    A figure whose data is missing is listed with the reason; one that fails to draw is listed with
    its error, and the others are still drawn.
    """
    run = RunData.load(Path(run_dir))
    out = Path(out_dir) if out_dir is not None else run.run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.error.txt"):  # from an earlier build of this report
        stale.unlink()
    figures: list[Figure] = []
    for key, title, drawer in DRAWERS:
        try:
            figures += drawer(run, out)
        except Exception as bad:  # one broken figure must not cost the others
            (out / f"{key}.error.txt").write_text(traceback.format_exc(), encoding="utf-8")
            figures.append(Figure(key, title, None, notes=[f"could not draw: {type(bad).__name__}: {bad}"]))
    page = out / PAGE
    page.write_text(render_page(f"llmplan run: {run.name}", _summary(run), figures, run.problems), encoding="utf-8")
    return page
