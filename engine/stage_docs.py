"""What `llmplan stages` says of a stage: its parameters with readable types, defaults and nested options.

Types read as a plan is written: `list[str]`, `int >= 1`, `"a" | "b"`, `Speculation | None`, never the
annotation's repr (`list[Annotated[str, StringConstraints(...)]]`). A parameter whose type is a settings
class (a pydantic model or a dataclass) lists that class's options beneath it, each with its own type,
default and description.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from .registry import Registry

_SIGNS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_MAX_DEPTH = 3  # nested options shown this deep (a settings class that names itself stops here)


def bounds(metadata: typing.Iterable[Any]) -> dict[str, Any]:
    """The numeric bounds (ge/gt/le/lt) among pydantic / annotated-types metadata or a `Limit`."""
    found: dict[str, Any] = {}
    for item in metadata:
        for name in _SIGNS:
            value = getattr(item, name, None)
            if value is not None and not isinstance(value, bool):
                found[name] = value
        inner = getattr(item, "metadata", None)  # a FieldInfo inside Annotated carries its own
        if isinstance(inner, list):
            found.update(bounds(inner))
    return found


def _bounded(base: str, limits: dict[str, Any]) -> str:
    low = next(((_SIGNS[k], limits[k]) for k in ("ge", "gt") if k in limits), None)
    high = next(((_SIGNS[k], limits[k]) for k in ("le", "lt") if k in limits), None)
    if low and high:
        return f"{low[1]} {'<=' if low[0] == '>=' else '<'} {base} {high[0]} {high[1]}"
    if low or high:
        sign, value = low or high  # type: ignore[misc]
        return f"{base} {sign} {value}"
    return base


def _literal(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | bool) or value is None else str(value)


def type_text(annotation: Any, metadata: typing.Iterable[Any] = ()) -> str:
    """A readable type; `metadata` (a field's constraints) adds bounds: `int >= 1`, `0 <= float <= 2`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0], [*annotation.__metadata__, *metadata])
    if origin is typing.Literal:
        return " | ".join(_literal(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a, metadata) for a in args]
        bounded = ("<", ">")  # a bounded member is parenthesized: (int >= 1) | null
        return " | ".join(f"({p})" if any(b in p for b in bounded) and len(parts) > 1 else p for p in parts)
    if annotation is type(None):
        return "null"  # as a plan writes it
    if origin is not None:
        inner = ", ".join(type_text(a) for a in args)  # element constraints: see the description
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    name = getattr(annotation, "__name__", str(annotation).replace("typing.", ""))
    if annotation in (int, float):
        return _bounded(name, bounds(metadata))
    return name


def settings_class(annotation: Any) -> type | None:
    """The settings class (pydantic model or dataclass) a parameter's type names, if any."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return settings_class(args[0])
    if origin in (typing.Union, types.UnionType, list, dict, tuple):
        for arg in args:
            found = settings_class(arg)
            if found is not None:
                return found
        return None
    if isinstance(annotation, type) and (hasattr(annotation, "model_fields") or dataclasses.is_dataclass(annotation)):
        return annotation
    return None


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", by_alias=True)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def options(cls: type, depth: int = 0) -> list[dict[str, Any]]:
    """The options of a settings class: name, type, required, default, doc, and its own nested options."""
    rows: list[dict[str, Any]] = []
    if hasattr(cls, "model_fields"):
        for name, info in cls.model_fields.items():
            default = None if info.is_required() else info.get_default(call_default_factory=True)
            rows.append(_option(info.alias or name, info.annotation, info.metadata, info.is_required(), default,
                                info.description or "", depth))  # fmt: skip
    else:
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            limit = f.metadata.get("limit")
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = None if required else f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            meta = [limit] if limit is not None else []
            doc = getattr(limit, "description", "") or ""
            rows.append(_option(f.name, hints.get(f.name, f.type), meta, required, default, doc, depth))
    return rows


def _option(
    name: str, annotation: Any, metadata: Any, required: bool, default: Any, doc: str, depth: int
) -> dict[str, Any]:
    nested = settings_class(annotation)
    return {
        "name": name,
        "type": type_text(annotation, metadata or ()),
        "required": required,
        "default": _plain(default),
        "doc": doc,
        "options": options(nested, depth + 1) if nested is not None and depth < _MAX_DEPTH else [],
    }


def describe_stage(name: str, registry: Registry) -> dict[str, Any]:
    cls = registry.stages[name]
    return {
        "name": name,
        "phase": str(cls.phase),
        "doc": cls.summary(),
        "description": (cls.__doc__ or "").strip(),
        "reads": list(cls.reads) + [f"{s}?" for s in cls.optional_reads],
        "writes": list(cls.writes),
        "fills": list(cls.fills),
        "edits": list(cls.edits),
        "always": cls.always,
        "params": options(cls.Params),
        "module": cls.__module__,
    }


def default_text(value: Any) -> str:
    """A default as a plan writes it: JSON (strings quoted, null, true), else as Python shows it."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def option_lines(rows: list[dict[str, Any]], indent: str = "    ") -> list[str]:
    """`• name: type = default  — description`, nested options indented beneath their parameter."""
    lines = []
    for row in rows:
        default = "  (required)" if row["required"] else f" = {default_text(row['default'])}"
        doc = f"  — {row['doc']}" if row["doc"] else ""
        lines.append(f"{indent}• {row['name']}: {row['type']}{default}{doc}")
        lines += option_lines(row["options"], indent + "    ")
    return lines
