"""Formatting of completions: text, Markdown, and JSON in the versioned schema "llmplan.result/v2".

A result object (one per request; one line each on stdout under `llmplan run --json`):

    {
      "schema": "llmplan.result/v2",
      "id": str,                    # the request id
      "plan": str | null,           # plan name
      "model": str | null,          # model fingerprint (ModelSource.fingerprint)
      "prompt": str,                # the prompt text as sent (after the chat template)
      "text": str,                  # the answer: special tokens removed, filtered if a filter ran
      "tokens": [int],              # generated ids as produced (aligned with "logprobs")
      "finish_reason": "stop" | "length" | "content_filter" | "error",   # OpenAI's (llm/generation/ending.py)
      "finish_detail": "eos" | "stop_string" | "cancelled" | "length" | "cache_full" | "error",
      "usage": {"prompt_tokens": int, "completion_tokens": int, "total_tokens": int},
      "logprobs": [float|null] | null,  # per generated token when recorded (null: not finite)
      "token_logprobs": [           # with `logprobs: N` (OpenAI's shape); null otherwise
        {"token": str, "id": int, "logprob": float|null,
         "top_logprobs": [{"token": str, "id": int, "logprob": float|null}]}
      ] | null,
      "candidates": [               # beam search: every returned beam, best first; [] otherwise
        {"text": str, "tokens": [int], "score": float | null, "finish_reason": str, "finish_detail": str}
      ],
      "timings": {"load_s": float|null, "ttft_s": float|null, "prefill_tokens_per_s": float|null,
                  "decode_tokens_per_s": float|null, ...other timings of the generator},
      "error": str | null,
      "from_cache": bool,
      "flagged": [str],             # what the output filter withheld, and how much (never the entries matched)
      "speculative": {"guessed": int, "accepted": int} | null,  # speculative decoding's guesses; null: off
      "format": {                   # the constraint that ran (`format`); null: free text
        "kind": "json" | "json_schema" | "regex" | "grammar" | "choice",
        "sha256": str,              # of the kind and its canonical text (the schema as JSON, the regex, ...)
        "summary": str,             # a short line: "object {name, tags}", the regex, "yes | no"
        "complete": bool | null     # the answer is whole under it; false: the length limit cut it short and
      } | null                      # it may not parse (finish_reason "length"); null: not known (replayed)
    }

A JSON file holds {"schema": "llmplan.result/v2", "plan", "model", "created", "results": [result objects]}.
Adding keys is a compatible change; removing or retyping one bumps the version (v2: finish_reason took
OpenAI's words, server and database alike; v1's values, eos and stop_string among them, are finish_detail).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

from llmplan.llm.generation import shown_finish

from .types import Result, candidate_records

SCHEMA = "llmplan.result/v2"
TIMING_KEYS = ("load_s", "ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s")
RESULT_KEYS = (
    "schema",
    "id",
    "plan",
    "model",
    "prompt",
    "text",
    "tokens",
    "finish_reason",
    "finish_detail",
    "usage",
    "logprobs",
    "candidates",
    "timings",
    "error",
    "from_cache",
    "flagged",
    "token_logprobs",
    "speculative",
    "format",
)


def result_object(
    completion: Result, *, plan: str | None = None, model: str | None = None, load_s: float | None = None
) -> dict[str, Any]:
    """The v1 result object of one completion."""
    c = completion
    timings: dict[str, Any] = dict.fromkeys(TIMING_KEYS)
    timings.update({k: _finite(v) if isinstance(v, float) else v for k, v in c.timings.items()})
    timings["load_s"] = load_s
    return {
        "schema": SCHEMA,
        "id": c.request_id,
        "plan": plan,
        "model": model,
        "prompt": c.prompt,
        "text": c.text,
        "tokens": list(c.tokens),
        "finish_reason": c.finish_reason,
        "finish_detail": c.finish_detail,
        "usage": {
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
        },
        "logprobs": None if not c.logprobs else [_finite(x) for x in c.logprobs],
        "candidates": [{**cand, "score": _finite(cand["score"])} for cand in candidate_records(c)],
        "timings": timings,
        "error": c.error,
        "from_cache": c.from_cache,
        "flagged": list(c.flagged),
        "token_logprobs": None
        if c.token_logprobs is None
        else [
            {
                "token": t["token"],
                "id": t["id"],
                "logprob": _finite(t["logprob"]),
                "top_logprobs": [
                    {"token": a["token"], "id": a["id"], "logprob": _finite(a["logprob"])} for a in t["top_logprobs"]
                ],
            }
            for t in c.token_logprobs
        ],
        "speculative": c.speculative,
        "format": None if c.format_record is None else dict(c.format_record),
    }


def _finite(value: Any) -> float | None:
    """JSON has no NaN/Infinity: a -inf beam score or logprob becomes null instead of invalid JSON."""
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def json_line(result: dict[str, Any]) -> str:
    """One line: json.dumps escapes newlines inside strings, so a result never spans lines."""
    return json.dumps(result, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=str)


def json_document_chunks(results: list[dict[str, Any]], *, plan: str | None, model: str | None) -> Iterator[str]:
    """The JSON file, in pieces, so a writer can stream it (and an interrupted write is testable)."""
    document = {
        "schema": SCHEMA,
        "plan": plan,
        "model": model,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "results": results,
    }
    encoder = json.JSONEncoder(ensure_ascii=False, indent=2, allow_nan=False, default=str)
    yield from encoder.iterencode(document)
    yield "\n"


def candidate_lines(c: Result) -> list[str]:
    """Beam search's candidates as the terminal shows them, best first: `1. (score -0.4211 · finish length) …`;
    a text of several lines goes on indented under its number."""
    lines = []
    for rank, cand in enumerate(candidate_records(c), start=1):
        finish = shown_finish(cand["finish_reason"], cand["finish_detail"])
        score = float(cand["score"]) if cand["score"] is not None else float("nan")
        text = "\n   ".join(str(cand["text"]).splitlines()) or "(empty)"
        lines.append(f"{rank}. (score {score:.4f} · finish {finish}) {text}")
    return lines


def text_chunks(completions: Iterable[Result]) -> Iterator[str]:
    """Plain text: the answers; with several requests each is headed by `[id]`."""
    items = list(completions)
    for index, c in enumerate(items):
        if len(items) > 1:
            yield ("\n" if index else "") + f"[{c.request_id}]\n"
        yield c.text if c.error is None or c.text else f"(error: {c.error})"
        yield "\n"


def markdown_chunks(
    completions: Iterable[Result], *, plan: str | None = None, model: str | None = None
) -> Iterator[str]:
    """A Markdown report: per request the prompt (quoted), the answer (as the model wrote it), and stats."""
    title = f"# {plan}" if plan else "# Results"
    yield title + "\n"
    if model:
        yield f"\nmodel `{model}`\n"
    for c in completions:
        yield f"\n## {c.request_id}\n\n"
        yield "\n".join(f"> {line}" for line in (c.prompt or "").splitlines() or [""]) + "\n\n"
        yield (c.text if c.text else "_(empty)_") + "\n\n"
        for rank, cand in enumerate(candidate_records(c), start=1):
            yield f"{rank}. (score {float(cand['score'] or 0.0):.4f}) {cand['text']}\n"
        if c.candidates:
            yield "\n"
        yield f"_{stats_text(c)}_\n"
        if c.error:
            yield f"\n**error:** {c.error}\n"
        if c.flagged:
            yield f"\n**flagged:** {', '.join(c.flagged)}\n"


def finish_text(c: Result) -> str:
    """`stop (eos)`; when a format ran, which, or that the length limit cut the answer short (it may not parse)."""
    said = shown_finish(c.finish_reason, c.finish_detail)
    record = c.format_record
    if record is None:
        return said
    if record.get("complete") is False:
        return f"{said} (the {record['kind']} answer was cut short: it may not parse)"
    return f"{said} · format {record['kind']} ({record['summary']})"


def stats_text(c: Result, load_s: float | None = None) -> str:
    """`12 prompt + 64 generated tokens · finish stop (eos) · TTFT 0.120 s · 45.1 tok/s decode`."""
    finish = finish_text(c)
    parts = [f"{c.prompt_tokens} prompt + {c.completion_tokens} generated tokens", f"finish {finish}"]
    if load_s is not None:
        parts.append(f"load {load_s:.2f} s")
    ttft = c.timings.get("ttft_s")
    if ttft is not None:
        parts.append(f"TTFT {float(ttft):.3f} s")
    prefill = c.timings.get("prefill_tokens_per_s")
    if prefill is not None:
        parts.append(f"{float(prefill):.1f} tok/s prefill")
    decode = c.timings.get("decode_tokens_per_s")
    if decode is not None:
        parts.append(f"{float(decode):.1f} tok/s decode")
    if c.from_cache:
        parts.append("from cache")
    return " · ".join(parts)
