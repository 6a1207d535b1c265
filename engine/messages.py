"""Pydantic validation errors rewritten as short, plan-author-friendly messages.

`Input should be less than or equal to 1` becomes `must be <= 1 (got 1.5)`; an unknown key gets a
"did you mean" suggestion drawn from the model's own field names.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

_MAX_SHOWN = 60


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def describe(error: dict[str, Any], allowed_keys: Iterable[str] = ()) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    got = f" (got {shown(value)})"
    if kind == "extra_forbidden":
        known = sorted(allowed_keys)
        hint = suggest(str(error["loc"][-1]), known)
        listing = f"; allowed: {', '.join(known)}" if known and not hint else ""
        return f"unknown field{hint}{listing}"
    if kind == "missing":
        return "required field is missing"
    bounds = {
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
    }
    if kind in bounds:
        op, key = bounds[kind]
        return f"must be {op} {ctx.get(key)}{got}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}{got}"
    if kind == "enum":
        return f"must be one of {ctx.get('expected')}{got}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer{got}"
    if kind in ("float_type", "float_parsing"):
        return f"must be a number{got}"
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false{got}"
    if kind in ("string_type",):
        return f"must be a string{got}"
    if kind in ("list_type",):
        return f"must be a list{got}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping{got}"
    if kind == "string_pattern_mismatch":
        return f"must match {ctx.get('pattern')}{got}"
    if kind in ("string_too_short", "too_short"):
        return f"must have at least {ctx.get('min_length')} item(s){got}"
    if kind in ("string_too_long", "too_long"):
        return f"must have at most {ctx.get('max_length')} item(s)"
    if kind == "strict_number":  # engine/strict.py: the message already shows the value
        return str(error.get("msg", kind))
    if kind == "value_error":
        message = str(ctx.get("error") or error.get("msg", ""))
        return message.removeprefix("Value error, ")
    if kind == "union_tag_invalid":
        return f"must be one of {ctx.get('expected_tags')}{got}"
    message = str(error.get("msg", kind))
    return f"{message[0].lower()}{message[1:]}{got}" if message else kind
