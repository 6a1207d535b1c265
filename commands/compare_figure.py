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
    return save_as(figure(result), path, "--picture")


def figure(result: dict[str, Any]) -> Any:
    """The two panels (speed, bytes held) against KL, before saving: every point labelled inside its panel."""
    rows = result["plans"]
    batch = result["batches"][0]
    kl = [float(r["kl_mean"]) for r in rows]
    held = [((r["weights_bytes"] or 0) + (r["kv_cache_bytes"] or 0)) / 2**20 for r in rows]
    panels = (
        (f"decode tok/s, batch {batch}", [float(r.get(f"decode_tok_s_b{batch}") or 0.0) for r in rows], True),
        ("weights + KV cache, MiB", held, False),
    )
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    for ax, (label, values, more) in zip(axes, panels, strict=True):
        points = list(zip(kl, values, strict=True))
        best = frontier(points, more)
        ax.plot([points[i][0] for i in best], [points[i][1] for i in best], color=FRONTIER, lw=1.5,
                drawstyle="steps-post", label="frontier", zorder=1)  # fmt: skip
        ax.scatter(kl, values, color=POINT, zorder=2)
        _kl_axis(ax, kl)
        ax.margins(y=0.18)  # room above and below the points for their labels
        _labels(ax, rows, points)
        ax.set_xlabel("KL-divergence from the reference (mean, nats per token)")
        ax.set_ylabel(label + (" (higher is better)" if more else " (lower is better)"))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    ref = result["reference"]
    fig.suptitle(f"What each plan buys for its divergence from {ref['plan']} {ref['change']}".strip())
    return fig


def _kl_axis(ax: Any, kl: list[float]) -> None:
    """A symmetric log axis from 0 (the reference) to the decade above the largest KL, a labelled tick at 0 and
    at every decade from the smallest KL's (so never fewer than three), minor ticks between."""
    from matplotlib.ticker import FuncFormatter  # after common's import: matplotlib's home settled first

    positive = [k for k in kl if k > 0]
    low = math.floor(math.log10(min(positive))) if positive else -6
    high = max(math.ceil(math.log10(max(positive))) if positive else low + 1, low + 1)
    linthresh = 10.0**low
    ax.set_xscale("symlog", linthresh=linthresh, linscale=0.5)
    ax.set_xlim(-0.15 * linthresh, 10.0**high)
    ax.set_xticks([0.0, *(10.0**e for e in range(low, high + 1))])
    ax.set_xticks([m * 10.0**e for e in range(low, high) for m in range(2, 10)], minor=True)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: "0" if v == 0 else f"{v:g}"))


def _labels(ax: Any, rows: list[dict[str, Any]], points: list[tuple[float, float]]) -> None:
    """Each point's plan name, to the left of points in the right half of the axis (never out of it); points at
    (nearly) the same place stack their labels instead of overlapping."""
    ys = [y for _, y in points]
    span = (max(ys) - min(ys)) or 1.0
    seen: dict[tuple[str, int], int] = {}
    left, right = ax.get_xlim()
    middle = ax.transData.inverted().transform(((ax.transData.transform((left, 0))[0]
                                                 + ax.transData.transform((right, 0))[0]) / 2, 0))[0]  # fmt: skip
    for row, (x, y) in zip(rows, points, strict=True):
        spot = (f"{x:.2g}", round((y - min(ys)) / span * 25))  # within 4 % of the axis: the same spot
        stacked = seen.get(spot, 0)
        seen[spot] = stacked + 1
        flip = x > middle
        ax.annotate(row["plan"], (x, y), xytext=(-6 if flip else 6, 4 + 11 * stacked), textcoords="offset points",
                    fontsize=8, ha="right" if flip else "left")  # fmt: skip
