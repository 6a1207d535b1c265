"""`llmplan compare`'s picture: a Pareto view of what each plan buys (speed, fewer bytes) for what it costs
(KL-divergence from the reference), one labelled point per plan, the frontier drawn through the plans no
other plan beats on both axes. KL is drawn on a symmetric log axis: the reference itself sits at 0."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from llmplan.commands.report.common import plt, save_as

FRONTIER = "#d9480f"
POINT = "#1864ab"


def frontier(points: list[tuple[float, float]], more_is_better: bool) -> list[int]:
    """Indexes of the points no other point beats: lower x, and higher y (or lower, when not more_is_better);
    sorted by x. A point equal to another on both counts stays (neither beats it)."""
    sign = 1.0 if more_is_better else -1.0
    kept = []
    for i, (x, y) in enumerate(points):
        beaten = any(
            (ox <= x and sign * oy >= sign * y) and (ox < x or sign * oy > sign * y)
            for j, (ox, oy) in enumerate(points)
            if j != i
        )
        if not beaten:
            kept.append(i)
    return sorted(kept, key=lambda i: (points[i][0], -sign * points[i][1]))


def draw(result: dict[str, Any], path: Path) -> Path:
    rows = result["plans"]
    batch = result["batches"][0]
    kl = [float(r["kl_mean"]) for r in rows]
    held = [((r["weights_bytes"] or 0) + (r["kv_cache_bytes"] or 0)) / 2**20 for r in rows]
    panels = (
        (f"decode tok/s, batch {batch}", [float(r.get(f"decode_tok_s_b{batch}") or 0.0) for r in rows], True),
        ("weights + KV cache, MiB", held, False),
    )
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    positive = [k for k in kl if k > 0]
    linthresh = 10 ** math.floor(math.log10(min(positive))) if positive else 1e-6
    for ax, (label, values, more) in zip(axes, panels, strict=True):
        points = list(zip(kl, values, strict=True))
        best = frontier(points, more)
        ax.plot([points[i][0] for i in best], [points[i][1] for i in best], color=FRONTIER, lw=1.5,
                drawstyle="steps-post", label="frontier", zorder=1)  # fmt: skip
        ax.scatter(kl, values, color=POINT, zorder=2)
        _labels(ax, rows, points)
        ax.set_xscale("symlog", linthresh=linthresh)
        ax.set_xlabel("KL-divergence from the reference (mean, nats per token)")
        ax.set_ylabel(label + (" (higher is better)" if more else " (lower is better)"))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    ref = result["reference"]
    fig.suptitle(f"What each plan buys for its divergence from {ref['plan']} {ref['change']}".strip())
    return save_as(fig, path, "--picture")


def _labels(ax: Any, rows: list[dict[str, Any]], points: list[tuple[float, float]]) -> None:
    """Each point's plan name; points at (nearly) the same place stack their labels instead of overlapping."""
    ys = [y for _, y in points]
    span = (max(ys) - min(ys)) or 1.0
    seen: dict[tuple[str, int], int] = {}
    for row, (x, y) in zip(rows, points, strict=True):
        spot = (f"{x:.2g}", round((y - min(ys)) / span * 25))  # within 4 % of the axis: the same spot
        stacked = seen.get(spot, 0)
        seen[spot] = stacked + 1
        ax.annotate(row["plan"], (x, y), xytext=(6, 4 + 11 * stacked), textcoords="offset points", fontsize=8)
