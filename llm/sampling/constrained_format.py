"""The `format` setting: the shape an answer must have, enforced token by token, failing closed.

Public API (a plan's `format`, a JSONL line's, and the server's `response_format` all become one of these):

    fmt = OutputFormat.of({"json_schema": {...}})   # or {"json": True}, {"regex": "..."}, {"grammar": "..."},
                                                    # {"choice": ["a", "b"]}; a schema may be a file path
    fmt = OutputFormat.from_json_schema(schema)     # the same from a schema dict (a server's response_format)
    fmt.check()           # raises UnsupportedFormat before any model is loaded: no tokenizer needed
    fmt.record()          # {"kind": "json_schema", "sha256": "...", "summary": "object {name, tags}"}: what
                          # results and databases record (the summary: a short line to tell formats apart)

Compiled against a tokenizer (`compile_format`, `CompiledFormat`) in format_compiler.py.

`UnsupportedFormat` (a ValueError) carries `keyword` (the schema keyword, regex or grammar construct that
cannot be enforced), `path` (the keyword's JSON path inside the schema, () when unknown) and `detail`
(llguidance's own words); `field_path` is ("json_schema", *path), which the plan's validation appends to
the setting's location so `llmplan validate` names the keyword's own file:line:col.

Why llguidance (MIT, no Python dependencies): it compiles JSON Schema, regexes and Lark grammars (GBNF is
converted by its own `gbnf_to_lark`), it refuses (`lenient` off) every keyword it cannot enforce instead of
ignoring it, and it checks a grammar without a tokenizer, so validation needs no model. JSON output is
compact (", " and ": ", no free whitespace) unless the schema's own `x-guidance` asks otherwise, and then
bounded (at most 20 whitespace characters at a place): a small model left free whitespace can spend its whole
token budget on newlines.

JSON semantics, as the peers keep them (`kept_schema`; an answer to the kept schema is valid under the schema
given, as it only narrows): an object with `properties` is closed unless `additionalProperties` (or
`patternProperties`) opens it, as llama.cpp and vLLM's xgrammar close them (llguidance 1.9 has no option for
it, so the schema says it); integers and numbers keep at most 16 integer digits, as llama.cpp's grammar bounds
them, and a number at most 10 fraction digits (`multipleOf` 1e-10; llguidance refuses finer): an unbounded
field could run to the length cap. Nodes under `allOf` or beside a `$ref` are not closed (an intersection of
closed objects would refuse the other's keys), nor are nodes with `enum`/`const` bounded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    pass

__all__ = ["KINDS", "OutputFormat", "UnsupportedFormat", "explain", "kept_schema"]

FormatKind = Literal["json", "json_schema", "regex", "grammar", "choice"]
KINDS: tuple[str, ...] = ("json", "json_schema", "regex", "grammar", "choice")
MAX_SCHEMA_BYTES = 1 << 20  # a schema file is read bounded
MAX_CHOICES = 1024
SUMMARY_CHARS = 80
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BOUNDED_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"  # where a schema's x-guidance asks for free whitespace
INTEGER_BOUND = 10**16 - 1  # 16 digits, llama.cpp's integral part ([1-9][0-9]{0,15})
FRACTION_STEP = 1e-10  # at most 10 fraction digits (llguidance refuses a finer multipleOf)
JsonPath = tuple[str | int, ...]


class UnsupportedFormat(ValueError):
    """A format that cannot be enforced: the keyword (or construct), where it is, and llguidance's words."""

    def __init__(self, kind: str, keyword: str, path: JsonPath = (), detail: str = "") -> None:
        self.kind, self.keyword, self.path, self.detail = kind, keyword, tuple(path), detail
        where = f" at {_pointer(self.path)}" if self.path else ""
        said = f" ({detail})" if detail and detail != keyword else ""
        super().__init__(f"{kind}: {keyword!r}{where} cannot be enforced{said}")

    @property
    def field_path(self) -> JsonPath:
        """Where the keyword is, under the setting (a plan's finding appends it to `format`)."""
        return (self.kind, *self.path) if self.kind == "json_schema" else (self.kind,)


@dataclass(frozen=True)
class OutputFormat:
    """One constraint: its kind and its canonical text (a schema as JSON, its key order kept, a regex, a grammar, the
    choices as a JSON list; "" for plain JSON). `source`: the schema file it was read from, if any."""

    kind: FormatKind
    spec: str
    source: str | None = field(default=None, compare=False)

    @classmethod
    def from_json_schema(cls, schema: Mapping[str, Any] | bool, source: str | None = None) -> OutputFormat:
        if not isinstance(schema, Mapping | bool):
            raise ValueError(f"json_schema: must be a mapping (a JSON Schema) or a file path (got {schema!r})")
        # no sort_keys: the order of `properties` is the order of the answer's keys
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), source)

    @classmethod
    def of(cls, value: Any, base: Path | None = None) -> OutputFormat | None:
        """A setting as given: a mapping with exactly one of the kinds, built already, or None (free text).
        A json_schema given as a string is a file, relative to `base` (the plan's folder) when relative."""
        if value is None or isinstance(value, OutputFormat):
            return value
        if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in KINDS:
            raise ValueError(f"must be a mapping with exactly one of {', '.join(KINDS)} (got {value!r})")
        kind, spec = next(iter(value.items()))
        if kind == "json":
            if spec is not True:
                raise ValueError(f"json: must be true (got {spec!r})")
            return cls("json", "")
        if kind == "json_schema":
            if isinstance(spec, str):
                return cls._schema_file(spec, base)
            return cls.from_json_schema(spec)
        if kind == "choice":
            if not isinstance(spec, list) or not spec or len(spec) > MAX_CHOICES:
                raise ValueError(f"choice: must be a list of 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in spec):
                raise ValueError("choice: every choice must be a non-empty string")
            return cls("choice", json.dumps(spec, ensure_ascii=False))
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"{kind}: must be a non-empty string")
        return cls(kind, spec)

    @classmethod
    def _schema_file(cls, name: str, base: Path | None) -> OutputFormat:
        from ..trust.files import FileProblem, read_text_limited

        path = Path(name).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        try:
            schema = json.loads(read_text_limited(path, MAX_SCHEMA_BYTES))
        except FileProblem as bad:
            raise ValueError(f"json_schema: {bad}") from None
        except ValueError as bad:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"json_schema: {path}: not JSON ({bad})") from None
        return cls.from_json_schema(schema, source=str(path))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(f"{self.kind}\n{self.spec}".encode()).hexdigest()

    def record(self) -> dict[str, Any]:
        """What a result records of the constraint that ran: its kind, a hash of its text, a short summary."""
        return {"kind": self.kind, "sha256": self.sha256, "summary": self.summary()}

    def summary(self, limit: int = SUMMARY_CHARS) -> str:
        """One short line saying what the format asks: `object {name, age, tags}`, the regex, the choices."""
        if self.kind == "json":
            text = "any JSON object"
        elif self.kind == "json_schema":
            text = _schema_summary(json.loads(self.spec))
        elif self.kind == "choice":
            text = " | ".join(json.loads(self.spec))
        else:
            text = next((line.strip() for line in self.spec.splitlines() if line.strip()), "")
        return text if len(text) <= limit else text[: limit - 1] + "…"

    def setting(self) -> dict[str, Any]:
        """Back to the setting's plain shape (a plan's resolved settings, a cache key)."""
        if self.kind == "json":
            return {"json": True}
        if self.kind in ("json_schema", "choice"):
            return {self.kind: json.loads(self.spec)}
        return {self.kind: self.spec}

    def grammar(self) -> str:
        """The llguidance grammar text; UnsupportedFormat for a GBNF grammar its converter cannot read."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if self.kind in ("json", "json_schema"):
            schema = json.loads(self.spec) if self.kind == "json_schema" else {"type": "object"}
            if isinstance(schema, dict):  # the schema's own x-guidance wins over these defaults
                return LLMatcher.grammar_from_json_schema(
                    kept_schema(schema),
                    defaults=JSON_OPTIONS,  # type: ignore[arg-type]
                    overrides=_whitespace_bound(schema),  # type: ignore[arg-type]
                )
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.spec))
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        try:
            lark = any_to_lark(self.spec)
        except Exception as bad:  # the converter raises its own error types and plain ones
            raise UnsupportedFormat("grammar", _first_line(str(bad)) or "GBNF", detail=str(bad)) from None
        return LLMatcher.grammar_from_lark(lark)

    def check(self) -> None:
        """Raise UnsupportedFormat if llguidance cannot enforce this format (no tokenizer needed)."""
        _checked(self)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONES = ("items", "additionalProperties", "additionalItems", "not", "contains", "propertyNames", "if", "then")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")


def kept_schema(schema: Any, merged: bool = False) -> Any:
    """The schema as the answer keeps it (the module's "JSON semantics"): a copy with objects closed and numbers
    bounded where the schema leaves them open. `merged`: the node is intersected with others (under allOf)."""
    if not isinstance(schema, dict):
        return schema
    node = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: kept_schema(child) for name, child in node[key].items()}
    for key in (*_SCHEMA_ONES, "else"):
        if isinstance(node.get(key), dict):
            node[key] = kept_schema(node[key])
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [kept_schema(child) for child in node[key]]
    if isinstance(node.get("allOf"), list):
        node["allOf"] = [kept_schema(child, merged=True) for child in node["allOf"]]
    open_ = merged or any(k in node for k in ("additionalProperties", "patternProperties", "allOf", "$ref"))
    # a key required but not listed could only be written to an open object: left open
    listed = node.get("properties")
    open_ = open_ or not isinstance(listed, dict) or any(k not in listed for k in node.get("required") or [])
    if not open_:
        node["additionalProperties"] = False
    if not any(k in node for k in ("enum", "const")):
        _bound_numbers(node)
    return node


def _bound_numbers(node: dict[str, Any]) -> None:
    """Integers and numbers bounded in digits where the schema leaves them open (in place); never past a bound
    the schema gives (that would leave nothing), nor a step beside a fractional bound (llguidance may refuse)."""
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" not in types and "number" not in types:
        return
    given = [node[k] for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum") if k in node]
    if not all(isinstance(v, int | float) and abs(v) < INTEGER_BOUND for v in given):
        return
    if not any(k in node for k in ("minimum", "exclusiveMinimum")):
        node["minimum"] = -INTEGER_BOUND
    if not any(k in node for k in ("maximum", "exclusiveMaximum")):
        node["maximum"] = INTEGER_BOUND
    if "number" in types and "multipleOf" not in node and all(float(v).is_integer() for v in given):
        node["multipleOf"] = FRACTION_STEP


def _whitespace_bound(schema: dict[str, Any]) -> dict[str, Any] | None:
    """Free whitespace a schema's x-guidance asks for, bounded (None: the defaults allow none)."""
    asked = schema.get("x-guidance")
    if isinstance(asked, dict) and asked.get("whitespace_flexible") and "whitespace_pattern" not in asked:
        return {"whitespace_pattern": BOUNDED_WHITESPACE}
    return None


_check_lock = threading.Lock()
_check_cache: OrderedDict[OutputFormat, UnsupportedFormat | None] = OrderedDict()


def _checked(fmt: OutputFormat) -> None:
    with _check_lock:
        if fmt in _check_cache:
            _check_cache.move_to_end(fmt)
            problem = _check_cache[fmt]
            if problem is not None:
                raise problem
            return
    problem = _problem(fmt)
    with _check_lock:
        _check_cache[fmt] = problem
        while len(_check_cache) > 256:
            _check_cache.popitem(last=False)
    if problem is not None:
        raise problem


def _problem(fmt: OutputFormat) -> UnsupportedFormat | None:
    from llguidance import LLMatcher

    try:
        grammar = fmt.grammar()
    except UnsupportedFormat as bad:
        return bad
    except ValueError as bad:
        return UnsupportedFormat(fmt.kind, fmt.kind, detail=str(bad))
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if not failed:
        return None
    return explain(fmt, messages[0] if messages else "refused")


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_LOOKAROUND = re.compile(r"error: (look-around|backreferences|[^\n]*not supported)")


def explain(fmt: OutputFormat, message: str) -> UnsupportedFormat:
    """llguidance's refusal as the keyword and where it is."""
    detail = _first_line(message)
    if fmt.kind not in ("json", "json_schema"):
        construct = _LOOKAROUND.search(message)
        return UnsupportedFormat(fmt.kind, construct.group(1) if construct else fmt.kind, detail=detail)
    schema = json.loads(fmt.spec) if fmt.kind == "json_schema" else {}
    keys = _UNIMPLEMENTED.search(message)
    if keys:
        names = json.loads(f"[{keys.group(1)}]")
        path = _find(schema, lambda node: any(name in node for name in names))
        keyword = next((n for n in names if path is not None and n in _at(schema, path)), names[0])
        return UnsupportedFormat(fmt.kind, keyword, (*(path or ()), keyword), detail)
    unknown = _UNKNOWN_FORMAT.search(message)
    if unknown:
        path = _find(schema, lambda node: node.get("format") == unknown.group(1))
        return UnsupportedFormat(fmt.kind, "format", (*(path or ()), "format"), detail)
    if "regex parse error" in message:
        path = _find(schema, lambda node: isinstance(node.get("pattern"), str) and _bad_regex(node["pattern"]))
        construct = _LOOKAROUND.search(message)
        keyword = "pattern" + (f" ({construct.group(1)})" if construct else "")
        return UnsupportedFormat(fmt.kind, keyword, (*(path or ()), "pattern"), detail)
    if "not present in a registry" in message or "retriev" in message:
        path = _find(schema, lambda node: isinstance(node.get("$ref"), str) and not node["$ref"].startswith("#"))
        return UnsupportedFormat(fmt.kind, "$ref", (*(path or ()), "$ref"), detail)
    return UnsupportedFormat(fmt.kind, fmt.kind, detail=detail)


def _schema_summary(schema: Any) -> str:
    """The schema's top level in a few words: its type, and an object's property names."""
    if not isinstance(schema, dict):
        return "anything" if schema is True else "nothing"
    for word in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(word), list):
            return f"{word} of {len(schema[word])}"
    if "enum" in schema and isinstance(schema["enum"], list):
        return f"one of {len(schema['enum'])} values"
    if "$ref" in schema:
        return f"$ref {schema['$ref']}"
    kind = schema.get("type", "object" if "properties" in schema else "any")
    kind = "/".join(map(str, kind)) if isinstance(kind, list) else str(kind)
    properties = schema.get("properties")
    if isinstance(properties, dict) and properties:
        return f"{kind} {{{', '.join(map(str, properties))}}}"
    items = schema.get("items")
    if kind == "array" and isinstance(items, dict):
        return f"array of {_schema_summary(items)}"
    return kind


def _bad_regex(pattern: str) -> bool:
    from llguidance import LLMatcher

    failed, _ = LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_regex(pattern))
    return failed


def _find(node: Any, wanted: Any, path: JsonPath = ()) -> JsonPath | None:
    """The first (depth-first) JSON path of a mapping inside `node` for which `wanted(mapping)` holds."""
    if isinstance(node, dict):
        if wanted(node):
            return path
        children: Any = node.items()
    elif isinstance(node, list):
        children = enumerate(node)
    else:
        return None
    for key, child in children:
        found = _find(child, wanted, (*path, key))
        if found is not None:
            return found
    return None


def _at(node: Any, path: JsonPath) -> Any:
    for part in path:
        node = node[part]
    return node


def _pointer(path: JsonPath) -> str:
    return "/" + "/".join(str(p) for p in path)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
