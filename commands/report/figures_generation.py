"""The generation view (generations.json): decode speed over the steps, and each token's probability."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from .common import Figure, plt, save
from .fonts import drawable, pick_font
from .run_data import RunData
from .tokens import token_labels

MAX_REQUESTS = 4


def step_rates(step_times: list[float]) -> list[float]:
    """Tokens per second of each decode step: 1 / the time between consecutive tokens."""
    return [1.0 / (b - a) if b > a else float("nan") for a, b in itertools.pairwise(step_times)]


def draw_generation(run: RunData, out_dir: Path) -> list[Figure]:
    records = run.generations
    if not records:
        return [
            Figure(
                "generation",
                "Generation",
                None,
                notes=["generations.json was not written (no generate stage, or the observe wiring is not in place)"],
            )
        ]
    shown = records[:MAX_REQUESTS]
    fig, axes = plt.subplots(len(shown), 2, figsize=(14, 3.4 * len(shown)), squeeze=False)
    notes = []
    for row, rec in enumerate(shown):
        ax_rate, ax_prob = axes[row]
        times = rec.get("step_times") or []
        if len(times) >= 2:
            rates = step_rates(times)
            steps = list(range(1, len(times)))
            ax_rate.plot(steps, rates, marker="o", markersize=2.5, linewidth=1, color="#1c7ed6")
            finite = [r for r in rates if not math.isnan(r)]
            if finite:
                mean = (len(times) - 1) / (times[-1] - times[0])
                ax_rate.axhline(mean, color="#e8590c", linestyle="--", linewidth=1, label=f"mean {mean:,.1f} tok/s")
                ax_rate.legend(fontsize=7)
            ax_rate.set_xlabel("decode step (generated token index)")
            ax_rate.set_ylabel("tokens / s")
            ax_rate.set_title(
                f"{rec['request_id']}: decode speed (first token after {times[0] * 1000:.0f} ms)", fontsize=9
            )
            ax_rate.set_ylim(bottom=0)
            ax_rate.grid(alpha=0.3)
        else:
            timing = rec.get("timings") or {}
            ax_rate.text(
                0.5,
                0.5,
                "per-step timestamps not recorded\n"
                f"(mean decode {timing.get('decode_tokens_per_s', float('nan')):,.1f} tok/s)",
                ha="center",
                va="center",
                transform=ax_rate.transAxes,
                fontsize=9,
            )
            ax_rate.set_axis_off()
            notes.append(f"{rec['request_id']}: no step_times in generations.json")
        logprobs = rec.get("logprobs") or []
        if logprobs:
            probs = [math.exp(lp) for lp in logprobs]
            labels = token_labels(rec["tokens"], rec.get("pieces"), rec.get("token_strings"))
            font = pick_font(labels)
            ax_prob.bar(range(len(probs)), probs, color="#51cf66")
            if len(labels) <= 64:
                ax_prob.set_xticks(
                    range(len(labels)),
                    [drawable(x, font) for x in labels],
                    rotation=90,
                    fontsize=max(4.0, min(8.0, 400 / len(labels))),
                    fontproperties=font.properties(),
                )
            ax_prob.set_ylim(0, 1.05)
            kind = "sampled" if (rec.get("temperature") or 0) > 0 else "greedy"
            ax_prob.set_title(f"probability of each chosen token ({kind}, T={rec.get('temperature')})", fontsize=9)
            ax_prob.set_ylabel("p(token)")
            ax_prob.grid(axis="y", alpha=0.3)
            if font.note and font.note not in notes:
                notes.append(font.note)
        else:
            ax_prob.text(
                0.5,
                0.5,
                "no logprobs (beam search or cached result)",
                ha="center",
                va="center",
                transform=ax_prob.transAxes,
            )
            ax_prob.set_axis_off()
    if len(records) > MAX_REQUESTS:
        notes.append(f"showing {MAX_REQUESTS} of {len(records)} requests")
    fig.tight_layout()
    path = save(fig, out_dir / "generation.png")
    return [
        Figure(
            "generation",
            "Generation",
            path,
            "Left: tokens/s of each decode step (1 / time between tokens). Right: exp(logprob) of each "
            "generated token under the raw model distribution.",
            notes,
        )
    ]
