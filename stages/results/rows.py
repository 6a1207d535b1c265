"""What a stored row must hold to be shown, and more to be replayed as an answer.

SQLite keeps whatever was written into a column (a blob in a text column, `{}` where a list was stored),
and a file can be edited or damaged after llmplan wrote it. So every row is decoded and typed here before
anyone uses it: `decode_row` for `history` and `show` (each JSON column decodes to its type), and
`decode_answer` for a replay, which also asks that the row be a complete answer — a finish reason that is
replayed, as many tokens as its usage says were generated, logprobs aligned with them, beams well formed.
A row that fails is `DamagedRow`: shown as damaged, and for the cache a miss, never an empty answer.

A row (or beam) written before the results database's v3 has no finish_detail: its finish_reason was the
detail, and is read as such, with OpenAI's word for it as the finish_reason (llm/generation/ending.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from llmplan.llm.generation import openai_finish

REPLAYED_FINISH = frozenset({"eos", "length", "stop_string", "cache_full"})
MAX_TOKEN_ID = 2**31 - 1
_LOGPROB_SLACK = 1e-3  # a log-probability is at most 0; float rounding may give a hair above


class DamagedRow(Exception):
    """A stored row that does not decode to what it should hold; the message says which column and why."""


def decode_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row with its JSON columns decoded and every column of the right type."""
    data = dict(row)
    for column in ("id", "run_id"):
        if not _is_int(data.get(column)):
            raise DamagedRow(f"its {column} is not a number")
    for column in ("request_id", "prompt_excerpt", "text", "finish_reason"):
        if not isinstance(data.get(column), str):
            raise DamagedRow(f"its {column} is not text")
    if data.get("error") is not None and not isinstance(data["error"], str):
        raise DamagedRow("its error is not text")
    _split_finish(data, "its")
    data["tokens"] = _token_ids(_json(data, "tokens"), "tokens")
    usage = _json(data, "usage")
    if not isinstance(usage, dict) or not all(_is_count(usage.get(k)) for k in ("prompt_tokens", "completion_tokens")):
        raise DamagedRow("its usage is not two token counts")
    data["usage"] = usage
    timings = _json(data, "timings")
    if not isinstance(timings, dict):
        raise DamagedRow("its timings are not a table")
    data["timings"] = timings
    data["logprobs"] = None if data.get("logprobs") is None else _logprobs(_json(data, "logprobs"))
    data["candidates"] = _candidates(_json(data, "candidates"))
    data["from_cache"] = bool(data.get("from_cache"))
    return data


def decode_answer(row: Mapping[str, Any]) -> dict[str, Any]:
    """`decode_row`, and the row is a whole answer that may be replayed."""
    data = decode_row(row)
    tokens = data["tokens"]
    if data["error"] is not None:
        raise DamagedRow("it records an error")
    if data["finish_detail"] not in REPLAYED_FINISH:
        raise DamagedRow(f"its finish reason {data['finish_detail'][:40]!r} is not one of a finished answer")
    if data["finish_reason"] != openai_finish(data["finish_detail"]):
        raise DamagedRow(f"its finish reason {data['finish_reason'][:40]!r} does not match {data['finish_detail']!r}")
    if data["usage"]["completion_tokens"] != len(tokens):
        raise DamagedRow(
            f"it holds {len(tokens)} tokens where its usage says {data['usage']['completion_tokens']} were generated"
        )
    if not tokens and data["finish_detail"] != "cache_full":
        raise DamagedRow(f"it holds no tokens, yet finished with {data['finish_detail']!r}")
    if data["logprobs"] is not None and len(data["logprobs"]) != len(tokens):
        raise DamagedRow(f"it holds {len(data['logprobs'])} logprobs for {len(tokens)} tokens")
    return data


def check_replay(data: Mapping[str, Any], *, vocab_size: int | None, max_new_tokens: int | None) -> None:
    """What only the run knows: every id is in this tokenizer's vocabulary, no more tokens than allowed."""
    ids = [*data["tokens"], *(t for c in data["candidates"] for t in c["tokens"])]
    if vocab_size is not None and any(t >= vocab_size for t in ids):
        raise DamagedRow(f"it holds token ids outside the vocabulary (size {vocab_size})")
    if max_new_tokens is not None and len(data["tokens"]) > max_new_tokens:
        raise DamagedRow(f"it holds {len(data['tokens'])} tokens, more than max_new_tokens ({max_new_tokens})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= MAX_TOKEN_ID


def _json(data: Mapping[str, Any], column: str) -> Any:
    text = data.get(column)
    if not isinstance(text, str):
        raise DamagedRow(f"its {column} column is not text")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise DamagedRow(f"its {column} column is not valid JSON") from None


def _token_ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise DamagedRow(f"its {what} are not a list of token ids")
    return value


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _logprobs(value: Any) -> list[float | None]:
    def fits(x: Any) -> bool:
        return x is None or (_number(x) and not math.isnan(x) and x <= _LOGPROB_SLACK)

    if not isinstance(value, list) or not all(fits(x) for x in value):
        raise DamagedRow("its logprobs are not a list of log-probabilities")
    return value


def _candidates(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise DamagedRow("its candidates are not a list")
    for cand in value:
        if not isinstance(cand, dict):
            raise DamagedRow("a candidate is not a table")
        _token_ids(cand.get("tokens", []), "candidate tokens")
        if not isinstance(cand.get("text", ""), str):
            raise DamagedRow("a candidate's text is not text")
        score = cand.get("score")
        if score is not None and not (_number(score) and not math.isnan(score)):
            raise DamagedRow("a candidate's score is not a number")
        reason = cand.get("finish_reason")
        if reason is not None and not isinstance(reason, str):
            raise DamagedRow("a candidate's finish reason is not text")
        if reason is not None:
            _split_finish(cand, "a candidate's")
    return value


def _split_finish(data: dict[str, Any], whose: str) -> None:
    """finish_reason (OpenAI's word) and finish_detail, from a row of any version (see the module's note)."""
    detail = data.get("finish_detail")
    if detail is None:  # written before v3: finish_reason was the detail
        data["finish_detail"] = data["finish_reason"]
        data["finish_reason"] = openai_finish(data["finish_reason"]) if data["finish_reason"] else ""
    elif not isinstance(detail, str):
        raise DamagedRow(f"{whose} finish_detail is not text")
