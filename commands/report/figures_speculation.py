"""Speculative decoding over the answer (generations.json's `speculation`), drawn only where it ran.

Each verify pass is recorded as (tokens generated before it, guesses verified, guesses accepted)
(llm/generation/speculative.py). One panel per request that speculated: the guesses of each pass (light) and those
accepted (dark) at the answer position where the pass ran, and the acceptance over the last WINDOW passes'
guesses as a line. Gaps are stretches decoded plainly: where a row's matches were not worth guessing.
"""

from __future__ import annotations

from pathlib import Path

from .common import Figure, RequestPanels, save
from .run_data import RunData

WINDOW = 8  # verify passes in the running acceptance


def running_acceptance(steps: list[list[int]], window: int = WINDOW) -> list[float]:
    """Accepted / guessed over each pass and the `window - 1` before it."""
    out = []
    for i in range(len(steps)):
        recent = steps[max(0, i - window + 1) : i + 1]
        guessed = sum(s[1] for s in recent)
        out.append(sum(s[2] for s in recent) / guessed if guessed else 0.0)
    return out


def draw_speculation(run: RunData, out_dir: Path) -> list[Figure]:
    drawn = RequestPanels.of(run.generations, "speculation", 2.4)
    if drawn is None:
        return []  # no request speculated: nothing to show
    fig, axes = drawn.fig, drawn.axes
    for ax, rec in drawn.panels():
        steps = rec["speculation"]
        at = [s[0] for s in steps]
        ax.bar(at, [s[1] for s in steps], width=0.9, color="#ffd8a8", label="guessed")
        ax.bar(at, [s[2] for s in steps], width=0.9, color="#e8590c", label="accepted")
        ax.set_xlim(-0.5, max(len(rec.get("tokens") or []), at[-1] + 1) + 0.5)
        ax.set_ylabel("guesses / pass")
        twin = ax.twinx()
        twin.plot(at, running_acceptance(steps), color="#1c7ed6", linewidth=1.2, label=f"accepted, last {WINDOW}")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("acceptance", color="#1c7ed6")
        guessed, accepted = sum(s[1] for s in steps), sum(s[2] for s in steps)
        ax.set_title(
            f"{rec.get('request_id', '?')}: {len(steps)} verify passes, {accepted} of {guessed} guesses accepted "
            f"({accepted / guessed:.0%}), {len(rec.get('tokens') or [])} tokens",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="upper left")
    axes[-1, 0].set_xlabel("answer position (tokens generated before the pass)")
    path = save(fig, out_dir / "speculation.svg")
    more = drawn.not_drawn("speculated")
    caption = (
        "Speculative decoding, pass by pass: the guesses each verify pass checked (light) and those accepted "
        f"(dark), at the answer position where it ran; blue: the share accepted over the last {WINDOW} passes. "
        "Gaps: tokens decoded plainly, where the row's prompt-lookup matches were not worth guessing." + more
    )
    return [Figure("speculation", "Speculative decoding over the answer", path, caption)]
