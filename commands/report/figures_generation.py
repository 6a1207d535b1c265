"""Decode over time (steps.json) and the generation view (generations.json).

* Decode speed: tokens/s of every scheduler step's decode pass over the run, prefill chunks marked where they
  ran (a chunk shares its step with the decode rows, so it shows as a slower step).
* Generation view (HTML, not a picture): each request's prompt and answer, the answer token by token coloured
  by the probability the model gave it, the best alternatives on hover, the finish reason; a few requests
  per page.
"""

from __future__ import annotations

import itertools
import math
import statistics
from html import escape
from pathlib import Path
from typing import Any

from llmplan.llm.generation import shown_finish

from .common import Figure, plt, save
from .run_data import RunData
from .tokens import TokenText, alternative_text, token_texts

PER_PAGE = 3
BUCKETS = [  # (lowest probability, background, legend)
    (0.9, "#d3f9d8", "p ≥ 0.9"),
    (0.5, "#fff3bf", "0.5 – 0.9"),
    (0.2, "#ffe8cc", "0.2 – 0.5"),
    (0.0, "#ffc9c9", "< 0.2"),
]


def step_rates(step_times: list[float]) -> list[float]:
    """Tokens per second of each decode step: 1 / the time between consecutive tokens."""
    return [1.0 / (b - a) if b > a else float("nan") for a, b in itertools.pairwise(step_times)]


def draw_decode_steps(run: RunData, out_dir: Path) -> list[Figure]:
    title = "Decode speed over the run"
    steps = (run.steps or {}).get("steps") or []
    decode = [s for s in steps if s.get("decode")]
    if not decode:
        why = (
            "steps.json was not written: the answers were replayed, or generation ran as a static batch "
            "(beam search, the slide cache policy), which records no per-step times"
            if not steps
            else "no decode steps (every request ended at its first token)"
        )
        return [Figure("decode", title, None, notes=[why])]
    times = [s["decode"]["start"] for s in decode]
    rates = [s["decode"]["rows"] / max(s["decode"]["end"] - s["decode"]["start"], 1e-9) for s in decode]
    rows = [s["decode"]["rows"] for s in decode]
    fig, ax = plt.subplots(figsize=(12, 4.2), layout="constrained")
    ax.plot(times, rates, marker="o", markersize=2.5, linewidth=0.9, color="#1c7ed6", label="decode pass tokens/s")
    median = statistics.median(rates)
    ax.axhline(median, color="#495057", linestyle="--", linewidth=1, label=f"median {median:,.1f} tok/s")
    chunks = [c for s in steps for c in s.get("prefill") or []]
    for i, chunk in enumerate(chunks):
        ax.axvspan(
            chunk["start"],
            chunk["end"],
            color="#ff922b",
            alpha=0.35,
            linewidth=0,
            label="prefill chunk" if i == 0 else None,
        )
    if max(rows) > 1:
        twin = ax.twinx()
        twin.step(times, rows, where="post", color="#2f9e44", linewidth=0.9, alpha=0.7)
        twin.set_ylabel("rows decoding", color="#2f9e44")
        twin.set_ylim(0, max(rows) * 1.1)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("tokens / s (rows ÷ pass time)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{len(decode)} decode steps, {len(chunks)} prefill chunk(s)", fontsize=10)
    path = save(fig, out_dir / "decode_steps.svg")
    caption = (
        "Every scheduler step's decode pass: rows decoded ÷ the pass's time (one token per running row). "
        "Orange: prefill chunks, which run in the same step as the decode rows and delay their next token."
    )
    return [Figure("decode", title, path, caption)]


def _colour(p: float) -> str:
    return next(colour for low, colour, _ in BUCKETS if p >= low)


def _alternative(alt: list[Any], pending: bytes) -> str:
    """One alternative as text: decoded after the bytes the chosen tokens before it left pending (its token's
    spelling, recorded since #57), else its own piece; a piece that is only bytes (U+FFFD) by its id."""
    piece = alt[2] if len(alt) > 2 and isinstance(alt[2], str) else ""
    token = alt[3] if len(alt) > 3 and isinstance(alt[3], str) else None
    if token is None and (not piece or "\ufffd" in piece):
        return f"#{alt[0]} (bytes of a character)"
    return alternative_text(token, piece, pending)


def _token_title(p: float, token: int, alternatives: list[Any], pending: bytes = b"") -> str:
    lines = [f"p = {p:.3f}   (id {token})"]
    if alternatives:
        lines.append("most likely here:")
        lines += [f"  {_alternative(alt, pending)!r}  {math.exp(alt[1]):.3f}" for alt in alternatives]
    return "\n".join(lines)


def _spans(tokens: list[int], logprobs: list[Any], alternatives: list[Any], texts: list[TokenText]) -> str:
    """The answer token by token: coloured by probability, the alternatives on hover; a token that begins a
    character shows nothing (the token that completes it shows the character)."""
    spans = []
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        p = math.exp(lp) if lp is not None and lp > -1e30 else 0.0
        alts = alternatives[i] if i < len(alternatives) else []
        title = _token_title(p, token, alts, texts[i].pending)
        spans.append(
            f'<span class="tok" style="background:{_colour(p)}" title="{escape(title)}">{escape(texts[i].text)}</span>'
        )
    return "".join(spans)


def request_html(rec: dict[str, Any]) -> str:
    tokens = rec.get("tokens") or []
    logprobs = rec.get("logprobs") or []
    texts = token_texts(tokens, rec.get("pieces"), rec.get("token_strings"))
    alternatives = rec.get("alternatives") or []
    head = [
        f"finish: <b>{escape(shown_finish(rec.get('finish_reason'), rec.get('finish_detail')))}</b>",
        f"{rec.get('prompt_tokens')} prompt tokens",
        f"{len(tokens)} generated",
    ]
    if rec.get("temperature") is not None:
        head.append(f"T = {rec.get('temperature')}")
    if rec.get("from_cache"):
        head.append("replayed from the results cache")
    parts = [f'<div class="request"><h3>{escape(str(rec.get("request_id")))}</h3><p>{" · ".join(head)}</p>']
    prompt = rec.get("prompt")
    if prompt is not None:
        parts.append(f'<details open><summary>prompt</summary><div class="prompt">{escape(prompt)}</div></details>')
    if rec.get("redacted"):
        parts.append('<p class="note">the plan\'s output filter flagged this answer: its tokens are not kept</p>')
    elif len(logprobs) == len(tokens) and tokens:
        parts.append(f'<div class="answer">{_spans(tokens, logprobs, alternatives, texts)}</div>')
    else:
        text = rec.get("text") or "".join(t.text for t in texts)
        parts.append(f'<div class="answer">{escape(text)}</div>')
        parts.append('<p class="note">no per-token probabilities (beam search, or a replayed answer)</p>')
    parts.append("</div>")
    return "".join(parts)


def draw_generation(run: RunData, out_dir: Path) -> list[Figure]:
    records = run.generations
    if not records:
        return [
            Figure(
                "generation",
                "Generation",
                None,
                notes=["generations.json was not written (no generate stage ran in this run)"],
            )
        ]
    legend = "".join(f'<span style="background:{colour}">{escape(text)}</span>' for _, colour, text in BUCKETS)
    pages = []
    for first in range(0, len(records), PER_PAGE):
        group = records[first : first + PER_PAGE]
        label = f"{first + 1}–{first + len(group)}" if len(group) > 1 else f"{first + 1}"
        pages.append(f'<div class="page" data-label="{label}">{"".join(request_html(r) for r in group)}</div>')
    html = (
        f'<p class="legend">probability of each generated token: {legend} (hover a token for its best '
        f"alternatives)</p>"
        f'<div class="pages"><div class="pager"></div>{"".join(pages)}</div>'
    )
    caption = (
        f"All {len(records)} request(s), {PER_PAGE} per page. Colours: the probability of the chosen token "
        "under the model's raw distribution (before penalties and sampling filters)."
    )
    return [Figure("generation", "Generation", None, caption, html=html)]
