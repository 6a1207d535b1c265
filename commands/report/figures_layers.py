"""Per-layer timings (layer_timings.json): attention and MLP per layer, the median over every pass and its
spread (10th to 90th percentile), prefill and decode apart, on the path the run really took.

The fused native decode step marks its own layers (llm/model/layer_clock.py), so an observed run decodes as an
unobserved one does; the page says which path ran the passes and how busy the machine was.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .common import Figure, plt, save
from .run_data import RunData

PATH_NAMES = {"fused": "the fused native decode step (C)", "torch": "the torch modules"}


def busy_warning(load: dict[str, Any] | None) -> str | None:
    """A warning when the machine ran other work: timings then include waiting for a core."""
    if not load:
        return None
    cpus = load.get("cpus") or os.cpu_count() or 1
    worst = max((x[0] for x in (load.get("start"), load.get("end")) if x), default=None)
    if worst is not None and worst > 0.75 * cpus:
        return (
            f"the machine was busy: load average {worst:.2f} on {cpus} CPUs during the run; "
            "times include waiting for a core (read the medians, and compare layers within this run only)"
        )
    return None


def load_line(load: dict[str, Any] | None) -> str:
    if not load:
        return "machine load not recorded"
    start, end = load.get("start") or [], load.get("end") or []
    fmt = "/".join
    return (
        f"machine load average (1/5/15 min) {fmt(f'{x:.2f}' for x in start)} at the start, "
        f"{fmt(f'{x:.2f}' for x in end)} at the end, on {load.get('cpus')} CPUs"
    )


def _spread(stats: list[dict[str, float]]) -> tuple[list[float], list[list[float]]]:
    medians = [s["median"] for s in stats]
    errors = [[s["median"] - s["p10"] for s in stats], [s["p90"] - s["median"] for s in stats]]
    return medians, errors


def _phase_panel(
    ax: Any, phase: str, bucket: dict[str, Any], n: int, paths_seen: list[str], mlp_kind: str = "SwiGLU"
) -> str | None:
    """One phase's bars (attention and MLP per layer, with their spread) on `ax`; the paths it ran on are
    added to `paths_seen`. Returns the phase's summary line, None when it had no passes."""
    passes = bucket.get("passes") or 0
    if not passes:
        ax.text(0.5, 0.5, f"no {phase} passes", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(phase)
        return None
    layers = list(range(n))
    attn, attn_err = _spread(bucket["attention_ms"])
    mlp, mlp_err = _spread(bucket["mlp_ms"])
    width = 0.4
    ax.bar(
        [x - width / 2 for x in layers],
        attn,
        width,
        yerr=attn_err,
        capsize=2,
        color="#4dabf7",
        label="attention (norm, QKV, RoPE, cache, attend, O, residual)",
    )
    ax.bar(
        [x + width / 2 for x in layers],
        mlp,
        width,
        yerr=mlp_err,
        capsize=2,
        color="#ff922b",
        label=f"MLP (norm, {mlp_kind}, residual)",
    )
    paths = bucket.get("paths") or {}
    paths_seen.extend([p for p in paths if p not in paths_seen])
    how = ", ".join(f"{count} on {PATH_NAMES.get(path, path)}" for path, count in paths.items())
    forward = bucket["forward_ms"]
    ax.set_title(
        f"{phase}: {passes} passes ({how})\nforward pass median {forward['median']:.2f} ms "
        f"(p10 {forward['p10']:.2f}, p90 {forward['p90']:.2f})",
        fontsize=9,
    )
    ax.set_xlabel("layer")
    ax.set_ylabel("ms per pass (median; bars: p10–p90)")
    ax.set_xticks(layers if n <= 16 else layers[:: max(2, n // 16)])
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(bottom=0)
    return (
        f"{phase}: per pass, attention {sum(attn):.2f} ms and MLP {sum(mlp):.2f} ms over all layers (medians), "
        f"embedding + final norm + head {bucket['outside_layers_ms']['median']:.2f} ms"
    )


def draw_layer_timings(run: RunData, out_dir: Path) -> list[Figure]:
    data = run.layer_timings
    if not data:
        why = (
            "not asked for (plan `observe: {layer_timings: true}`)"
            if not run.observe.get("layer_timings")
            else "asked for, but layer_timings.json was not written (observe wiring missing?)"
        )
        return [Figure("layers", "Per-layer timings", None, notes=[why])]
    n = data["n_layers"]
    if "attention_ms" not in (data.get("decode") or {}):
        return [Figure("layers", "Per-layer timings", None, notes=["layer_timings.json is of an older format"])]
    mlp_kind = ((run.model or {}).get("architecture") or {}).get("mlp", "SwiGLU")  # the family's (model.json)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    summary, paths_seen = [], []
    for ax, phase in zip(axes, ("prefill", "decode"), strict=True):
        line = _phase_panel(ax, phase, data.get(phase) or {}, n, paths_seen, mlp_kind)
        if line is not None:
            summary.append(line)
    handles = next((ax.get_legend_handles_labels() for ax in axes if ax.get_legend_handles_labels()[0]), None)
    if handles:  # one legend for both panels, under them: never over the bars
        fig.legend(*handles, loc="outside lower center", ncol=2, fontsize=9)
    fig.suptitle("Time per layer: median over every pass, with its spread", fontsize=11)
    path = save(fig, out_dir / "layer_timings.svg")
    sync = "GPU synchronized at each mark" if data.get("synchronized") else "CPU wall time (CLOCK_MONOTONIC)"
    caption = (
        f"Each pass's layers are timed where they run: {', '.join(PATH_NAMES.get(p, p) for p in paths_seen)}. "
        f"Observing needs no hooks (attention weights, when drawn, come from a pass after the run), so the run "
        f"took the path it takes unobserved; {sync}. "
        f"{load_line(run.load_average)}."
    )
    warning = busy_warning(run.load_average)
    return [Figure("layers", "Per-layer timings", path, caption, summary, warnings=[warning] if warning else [])]
