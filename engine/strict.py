"""Numbers are numbers: no bool -> int and no str -> number coercion in plan values.

Pydantic's lax mode turns `true` into 1 and `"3"` into 3, so `max_new_tokens: true` silently meant
one token. Full strict mode would also refuse a list where a tuple goes and other harmless shapes,
so the rule is applied where it matters: a field (or a list's items) whose type is numeric — int or
float, optionally with None — and that does not also accept bool or str.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import ValidationInfo
from pydantic_core import PydanticCustomError

_NUMERIC = (int, float)


def _members(annotation: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        out: tuple[Any, ...] = ()
        for arg in typing.get_args(annotation):
            out += _members(arg)
        return out
    return (annotation,)


def _numeric_kind(annotation: Any) -> str | None:
    """'an integer' / 'a number' when the type is purely numeric (None allowed), else None."""
    members = [m for m in _members(annotation) if m is not type(None)]
    if not members or not all(isinstance(m, type) and m in _NUMERIC for m in members):
        return None
    return "an integer" if all(m is int for m in members) else "a number"


def _item_kind(annotation: Any) -> str | None:
    """For list[int] (optionally | None): the items' numeric kind."""
    for member in _members(annotation):
        if typing.get_origin(member) in (list, tuple, set, frozenset):
            args = [a for a in typing.get_args(member) if a is not Ellipsis]
            if len(args) == 1:
                return _numeric_kind(args[0])
    return None


def _wrong(value: Any) -> bool:
    return isinstance(value, bool | str)


def strict_numbers(model: type[Any], value: Any, info: ValidationInfo) -> Any:
    """A `field_validator('*', mode='before')` body: refuse bools and strings for numeric fields."""
    field = model.model_fields.get(info.field_name or "")
    if field is None:
        return value
    kind = _numeric_kind(field.annotation)
    if kind is not None and _wrong(value):
        raise PydanticCustomError("strict_number", "must be {kind} (got {got})", {"kind": kind, "got": repr(value)})
    item = _item_kind(field.annotation)
    if item is not None and isinstance(value, list):
        for position, entry in enumerate(value):
            if _wrong(entry):
                raise PydanticCustomError(
                    "strict_number",
                    "item {position} must be {kind} (got {got})",
                    {"kind": item, "got": repr(entry), "position": position},
                )
    return value
