"""The format's mask over the answer (generations.json's `mask_allowed`), drawn only where a format ran.

One panel per request answered under a format: how many tokens the grammar's mask allowed at each step
(log scale, the vocabulary as the ceiling): wide inside free text (a string's characters), one or a few
at structural positions (a key, a closing brace), one (EOS) once the answer is complete.
"""

from __future__ import annotations

from pathlib import Path

from .common import Figure, RequestPanels, save
from .run_data import RunData


def draw_format_mask(run: RunData, out_dir: Path) -> list[Figure]:
    drawn = RequestPanels.of(run.generations, "mask_allowed", 2.2)
    if drawn is None:
        return []  # no format ran: nothing to show
    fig, axes = drawn.fig, drawn.axes
    for ax, rec in drawn.panels():
        allowed = rec["mask_allowed"]
        ax.bar(range(len(allowed)), allowed, width=0.9, color="#5c940d")
        ax.set_yscale("log")
        ax.set_ylabel("tokens allowed")
        fmt = rec.get("format") or {}
        single = sum(1 for n in allowed if n == 1)
        ax.set_title(
            f"{rec.get('request_id', '?')}: {fmt.get('kind', 'format')} ({fmt.get('summary', '')}), {len(allowed)} "
            f"steps, {single} with one token allowed",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("answer position (step)")
    path = save(fig, out_dir / "format_mask.svg")
    more = drawn.not_drawn("ran under a format")
    caption = (
        "The format's mask, step by step: how many tokens of the vocabulary the grammar allowed (log scale). "
        "One allowed token is a forced step (a key, a brace, the end); many is free text inside the shape." + more
    )
    return [Figure("format", "The format's mask over the answer", path, caption)]
