"""Assemble the report of a run directory: every figure as an SVG in RUN_DIR/report/, and index.html.

A run whose answers were replayed from the results cache generated nothing itself: its page says so, names
the run that generated them, and shows that run's pictures of the generation (drawn from its directory)."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from html import escape
from pathlib import Path

from llmplan.ownership import NotOurs, check_directory_ours, remove_owned, write_file
from llmplan.plain_errors import error_detail

from .common import Figure
from .figures_attention import draw_attention
from .figures_flow import draw_flows
from .figures_format import draw_format_mask
from .figures_generation import draw_decode_steps, draw_generation
from .figures_layers import draw_layer_timings, load_line
from .figures_memory import draw_memory
from .figures_memory_plan import draw_memory_plan
from .figures_model import draw_model_graph
from .figures_plan import draw_plan_graph
from .figures_speculation import draw_speculation
from .html import render_page
from .run_data import RunData

REPORT_DIR, PAGE = "report", "index.html"
Drawer = Callable[[RunData, Path], list[Figure]]
DRAWERS: list[tuple[str, str, Drawer]] = [
    ("plan", "Plan graph", draw_plan_graph),
    ("flows", "Data flow", draw_flows),
    ("model", "Model graph", draw_model_graph),
    ("memory", "Memory over time", draw_memory),
    ("memory_plan", "Memory: predicted and measured", draw_memory_plan),
    ("layers", "Per-layer timings", draw_layer_timings),
    ("decode", "Decode speed over the run", draw_decode_steps),
    ("attention", "Attention heatmaps", draw_attention),
    ("generation", "Generation", draw_generation),
    ("speculation", "Speculative decoding over the answer", draw_speculation),
    ("format", "The format's mask over the answer", draw_format_mask),
]
# pictures of the generation itself
FROM_SOURCE = {"flows", "model", "layers", "decode", "attention", "generation", "speculation", "format"}


def _summary(run: RunData) -> list[tuple[str, object]]:
    info = run.run or {}
    rows: list[tuple[str, object]] = [
        ("plan", run.name),
        ("status", f"{info.get('status', '?')} — {info.get('message', '')}"),
        ("wall time", f"{info.get('wall_s', 0.0):.2f} s"),
        ("machine load", load_line(run.load_average)),
        ("run directory", str(run.run_dir)),
    ]
    generate = next((run.metrics.get(s, {}) for s in run.stage_ids("compute.generate")), {})
    if generate.get("generated_tokens") is not None:
        rows.append(
            ("generated", f"{generate['generated_tokens']} tokens, {generate.get('tokens_per_s', 0):.1f} tok/s")
        )
    if run.replayed is not None:
        rows.append(("generated", "nothing: every answer was replayed from the results cache"))
    return rows


def _warnings(run: RunData) -> list[str]:
    """What a reader must not miss: failures, requests that ended in error, inputs changed on their way."""
    info, metrics = run.run or {}, run.metrics.get("run") or {}
    found = list(run.problems)
    if info.get("status") not in (None, "ok"):
        found.append(f"the run ended {info.get('status')}: {info.get('message', '')}")
    for request, why in (metrics.get("request_errors") or {}).items():
        found.append(f"request {request} ended in error: {why}")
    for notice in ((metrics.get("notices") or {}).get("listed")) or []:
        found.append(str(notice.get("message")))
    return found


def _replay_banner(run: RunData) -> tuple[str, list[RunData]]:
    replayed = run.replayed
    if replayed is None:
        return "", []
    results = replayed.get("results") or []
    runs = sorted(
        {f"run {s.get('run_id')}" + (f" ({s.get('run_time')})" if s.get("run_time") else "") for s in results}
    )
    sources = [RunData.load(d) for d in run.source_runs()]
    links = "".join(
        f'<li><a href="{escape((d.run_dir / REPORT_DIR / PAGE).as_uri())}">{escape(str(d.run_dir))}</a></li>'
        for d in sources
    )
    where = (
        f"<p>The pictures of the generation below are that run's, drawn from its directory:</p><ul>{links}</ul>"
        if sources
        else "<p>That run's directory is no longer there: only this run's own pictures are shown.</p>"
    )
    banner = (
        f'<div class="replayed"><p><b>Replayed from the results cache.</b> Nothing was generated in this run: '
        f"{len(results)} answer(s) come from {escape(', '.join(runs))} of {escape(str(replayed.get('db')))}. "
        "The load and generation stages were skipped because their outputs were already available, not "
        f"because the plan lacks them.</p>{where}</div>"
    )
    return banner, sources


def _draw(run: RunData, out: Path, key: str, title: str, drawer: Drawer) -> list[Figure]:
    try:
        return drawer(run, out)
    except Exception as bad:  # one broken figure must not cost the others
        with contextlib.suppress(OSError, NotOurs):  # the figure is listed with its error either way
            write_file(out / f"{key}.error.txt", traceback.format_exc())
        said = f"could not draw: {error_detail(bad) or 'no details'} (see {key}.error.txt)"
        return [Figure(key, title, None, warnings=[said])]


def build_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Draw every figure the run's files allow into RUN_DIR/report/ (or `out_dir`); return the HTML page.

    A figure whose data is missing is listed with the reason; one that fails to draw is listed with
    its error, and the others are still drawn.
    """
    run = RunData.load(Path(run_dir))
    out = Path(out_dir) if out_dir is not None else run.run_dir / REPORT_DIR
    check_directory_ours(out, "report directory")  # before drawing: a file of the user's is never replaced
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.error.txt"), *out.glob("*.png"), *out.glob("*.svg")]:  # an earlier build's
        remove_owned(stale)
    banner, sources = _replay_banner(run)
    figures: list[Figure] = []
    for key, title, drawer in DRAWERS:
        if sources and key in FROM_SOURCE:
            source = sources[0]
            drawn = _draw(source, out / "source", key, title, drawer)
            for fig in drawn:
                fig.title = f"{fig.title} (from {source.run_dir.name}, the run that generated the answers)"
            figures += drawn
        else:
            figures += _draw(run, out, key, title, drawer)
    page = out / PAGE
    write_file(page, render_page(f"llmplan run: {run.name}", _summary(run), figures, [], _warnings(run), banner))
    return page
