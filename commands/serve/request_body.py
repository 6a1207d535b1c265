"""A request body read as strictly as OpenAI reads it: UTF-8 JSON, one object, and every refusal naming the field.

Python's `json` lets through what the rest of the server cannot hold: a 5000-digit integer (`int()` then
raises past its 4300-digit limit), `NaN` and `Infinity` (not JSON at all), a lone surrogate such as `\\ud800`
(no UTF-8 encoding exists, so the tokenizer or the response fails later), duplicate keys (the last silently
wins, while a proxy in front may have checked the first) and nesting deep enough to exhaust the stack. Each
is refused here, while parsing, with the path of the value (`seed`, `messages.0.content`) as OpenAI's `param`.

Pydantic's messages are rewritten the same way: a type error says what was expected and what JSON kind came
(`max_tokens: expected an integer, got a string ('5')`), and a union's branch names never reach the client.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from llmplan.engine.messages import describe, shown

MAX_DEPTH = 32  # a chat request nests 5 levels deep; far more is an attack on the parser, not a request
MAX_INT_DIGITS = 32  # int64 needs 19; a longer integer is refused before `int()` spends time on it
_SURROGATE = re.compile("[\ud800-\udfff]")

_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "dict_type": "an object",
    "none_required": "null",
}


class BodyError(ValueError):
    """A body refused, with the request field it concerns (OpenAI's `param`) where there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Refused:
    """Stands in for a value the parser refused; the walk after parsing finds it and names its path."""

    def __init__(self, why: str, key: str | None = None) -> None:
        self.why, self.key = why, key


def json_kind(value: Any) -> str:
    """The JSON name of a parsed value's kind, as a message says it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _integer(text: str) -> int | _Refused:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Refused(f"an integer of {digits} digits is out of range")
    return int(text)


def _decimal(text: str) -> float | _Refused:
    value = float(text)  # no digit limit for floats; a huge exponent gives inf
    return value if math.isfinite(value) else _Refused(f"{shown(text)} is out of range for a number")


def _constant(name: str) -> _Refused:
    return _Refused(f"{name} is not valid JSON (JSON has no NaN or Infinity)")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Refused:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            return _Refused("a key given twice (send it once)", key)
        out[key] = value
    return out


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; anything else raises `BodyError`."""
    if not raw.strip():
        raise BodyError("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise BodyError(f"the request body is not UTF-8 (byte {bad.start} is invalid); send UTF-8 JSON") from None
    try:
        data = json.loads(
            text, parse_int=_integer, parse_float=_decimal, parse_constant=_constant, object_pairs_hook=_object
        )
    except json.JSONDecodeError as bad:
        raise BodyError(f"malformed JSON at line {bad.lineno} column {bad.colno}: {bad.msg}") from None
    except RecursionError:
        raise BodyError(f"the JSON nests deeper than {MAX_DEPTH} levels") from None
    if isinstance(data, _Refused):
        raise BodyError(f"{data.key}: {data.why}", data.key)
    if not isinstance(data, dict):
        raise BodyError(f"the body must be a JSON object, got {json_kind(data)}")
    _check(data)
    return data


def _check(data: dict[str, Any]) -> None:
    """Walk the parsed body (without recursion): depth, refused values, lone surrogates, each named by its path.

    Only containers go on the stack, each with a link to its parent's (the path's text is built only for a
    refusal), so a megabyte of small values costs a few megabytes to walk, not a tuple per value.
    """
    stack: list[tuple[Any, Any, int]] = [(data, None, 0)]
    while stack:
        container, link, depth = stack.pop()
        if depth > MAX_DEPTH:
            _refuse(link, f"the JSON nests deeper than {MAX_DEPTH} levels")
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                _refuse(link, "a key holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
            if isinstance(value, str):
                if _SURROGATE.search(value):
                    _refuse((link, key), "a lone UTF-16 surrogate (\\ud800-\\udfff) is not text")
            elif isinstance(value, dict | list):
                stack.append((value, (link, key), depth + 1))
            elif isinstance(value, _Refused):
                _refuse((link, key) if value.key is None else ((link, key), value.key), value.why)


def _refuse(link: Any, why: str) -> None:
    parts: list[str] = []
    while link is not None:
        link, key = link
        parts.append(str(key))
    param = ".".join(reversed(parts)) or None
    raise BodyError(f"{param or 'the body'}: {why}", param)


def validate(schema: type[BaseModel], data: dict[str, Any]) -> Any:
    """`schema` validated strictly against the parsed body; a refusal names the field."""
    try:
        return schema.model_validate(data)
    except ValidationError as bad:
        message, param = explain(bad, data)
        raise BodyError(message, param) from None


def explain(error: ValidationError, data: Any) -> tuple[str, str]:
    """One message for pydantic's errors: the first field's most specific error, its union branches merged."""
    found = [(_real_path(e, data), e) for e in error.errors()]
    first = found[0][0][:1]
    mine = [(path, e) for path, e in found if path[:1] == first]
    deepest = max(len(path) for path, _ in mine)
    at = [(path, e) for path, e in mine if len(path) == deepest]
    path, chosen = at[0]
    param = ".".join(str(p) for p in path) or "body"
    kinds = [_EXPECTED[e["type"]] for _, e in at if e["type"] in _EXPECTED]
    if len(kinds) == len(at):  # type errors only (one per union branch): say what would have been accepted
        expected = " or ".join(dict.fromkeys(kinds))
        got = chosen.get("input")
        detail = f" ({shown(got)})" if isinstance(got, str | int | float) and not isinstance(got, bool) else ""
        return f"{param}: expected {expected}, got {json_kind(got)}{detail}", param
    other = next(e for _, e in at if e["type"] not in _EXPECTED)
    return f"{param}: {describe(other)}", param


def _real_path(error: Any, data: Any) -> tuple[str | int, ...]:
    """The error's location in the body itself: union branch tags (`str`, `list[str]`) dropped, indices kept."""
    path: list[str | int] = []
    here = data
    loc = error["loc"]
    for i, part in enumerate(loc):
        in_object = isinstance(here, dict) and isinstance(part, str) and part in here
        in_array = isinstance(here, list) and isinstance(part, int) and 0 <= part < len(here)
        if in_object or in_array:
            here = here[part]
            path.append(part)
        elif error["type"] == "missing" and i == len(loc) - 1 and isinstance(part, str):
            path.append(part)  # the absent key itself is the field to name
    return tuple(path)
