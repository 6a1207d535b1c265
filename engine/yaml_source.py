"""Safe YAML loading that remembers where every value came from.

PyYAML's composer gives nodes with marks; we build plain Python values from them ourselves so that
(1) no tag can construct an object (only the core schema's scalars, lists and mappings),
(2) aliases cannot expand without bound (a "billion laughs" plan is refused after a node budget),
(3) recursive aliases, duplicate keys and oversized files are errors, and
(4) each value's (line, column) is kept by its path, for error messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmplan.bounded_read import NotRegularFileError, TooLargeError, read_limited

from .findings import Finding, PlanError, format_path
from .findings import Path as FieldPath

MAX_FILE_BYTES = 1 << 20
MAX_NODES = 50_000
MAX_DEPTH = 64
_CORE_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:seq",
    "tag:yaml.org,2002:map",
}


@dataclass
class Source:
    """A loaded document: its data and the positions (1-based line, column) of each path."""

    file: str
    data: Any
    values: dict[FieldPath, tuple[int, int]] = field(default_factory=dict)
    keys: dict[FieldPath, tuple[int, int]] = field(default_factory=dict)

    def position(self, path: FieldPath, *, key: bool = False) -> tuple[int, int]:
        """The closest known position: the path itself, else its nearest ancestor."""
        table = self.keys if key else self.values
        probe = tuple(path)
        while probe:
            if probe in table:
                return table[probe]
            if probe in self.values:
                return self.values[probe]
            probe = probe[:-1]
        return self.values.get((), (1, 1))

    def finding(self, path: FieldPath, message: str, *, key: bool = False, field_text: str | None = None) -> Finding:
        line, column = self.position(path, key=key)
        return Finding(self.file, line, column, format_path(path) if field_text is None else field_text, message)


def load_file(path: str | Path) -> Source:
    path = Path(path)
    name = str(path)
    try:
        raw = read_limited(path, MAX_FILE_BYTES, "plan file")
    except FileNotFoundError:
        raise PlanError([Finding(name, 1, 1, "", "file not found")]) from None
    except TooLargeError as big:
        message = f"plan file is {big.size} bytes; the limit is {big.limit}"
        raise PlanError([Finding(name, 1, 1, "", message)]) from None
    except (NotRegularFileError, IsADirectoryError) as bad:
        raise PlanError([Finding(name, 1, 1, "", str(bad).removeprefix(f"{path}: "))]) from None
    except OSError as bad:
        raise PlanError([Finding(name, 1, 1, "", f"cannot read the plan ({bad.strerror or bad})")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise PlanError([Finding(name, 1, 1, "", f"not UTF-8 text ({bad.reason} at byte {bad.start})")]) from None
    return load_text(text, name)


def load_text(text: str, file: str = "<string>") -> Source:
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.MarkedYAMLError as bad:
        mark = bad.problem_mark or bad.context_mark
        line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = bad.problem or bad.context or "invalid YAML"
        raise PlanError([Finding(file, line, column, "", f"YAML syntax error: {problem}")]) from None
    except yaml.YAMLError as bad:
        raise PlanError([Finding(file, 1, 1, "", f"YAML error: {bad}")]) from None
    except RecursionError:
        # PyYAML's composer recurses once per nesting level: thousands of `[[[[` exhaust the stack
        # before our own MAX_DEPTH check ever sees the nodes.
        raise PlanError([Finding(file, 1, 1, "", f"nesting deeper than {MAX_DEPTH} levels; refused")]) from None
    if len(nodes) > 1:
        line = nodes[1].start_mark.line + 1
        raise PlanError([Finding(file, line, 1, "", "a plan file holds one YAML document, found several")])
    source = Source(file=file, data=None)
    if not nodes or nodes[0] is None:
        source.data = None
        return source
    builder = _Builder(source)
    source.data = builder.build(nodes[0], (), 0, frozenset())
    return source


class _Builder:
    def __init__(self, source: Source) -> None:
        self.source = source
        self.count = 0
        self.scalars = yaml.SafeLoader("")  # only its scalar constructors are used

    def fail(self, node: yaml.Node, path: FieldPath, message: str) -> PlanError:
        line, column = node.start_mark.line + 1, node.start_mark.column + 1
        return PlanError([Finding(self.source.file, line, column, format_path(path), message)])

    def build(self, node: yaml.Node, path: FieldPath, depth: int, active: frozenset[int]) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise self.fail(node, path, f"the plan expands to more than {MAX_NODES} values (an alias bomb?); refused")
        if depth > MAX_DEPTH:
            raise self.fail(node, path, f"nesting deeper than {MAX_DEPTH} levels; refused")
        if id(node) in active:
            raise self.fail(node, path, "recursive alias: a value that contains itself; refused")
        if node.tag not in _CORE_TAGS:
            raise self.fail(node, path, f"unsupported tag {node.tag!r}: plans hold plain values only")
        self.source.values.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        inner = active | {id(node)}
        if isinstance(node, yaml.ScalarNode):
            try:
                return self.scalars.construct_object(node, deep=True)
            except yaml.YAMLError as bad:
                raise self.fail(node, path, f"bad scalar: {bad}") from None
            except ValueError:  # int() past Python's digit limit: "Exceeds the limit (4300 digits)"
                digits = sum(c.isdigit() for c in str(node.value))
                raise self.fail(node, path, f"a number of {digits} digits is too long; use a shorter one") from None
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i), depth + 1, inner) for i, item in enumerate(node.value)]
        assert isinstance(node, yaml.MappingNode)
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise self.fail(key_node, path, "merge keys ('<<') are not supported in plans")
            if not isinstance(key_node, yaml.ScalarNode):
                raise self.fail(key_node, path, "mapping keys must be plain scalars")
            key = self.build(key_node, (*path, "<key>"), depth + 1, inner)
            if not isinstance(key, str | int):
                key = str(key)
            child = (*path, key)
            if key in result:
                raise self.fail(key_node, child, f"duplicate key {key!r}")
            self.source.keys[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            result[key] = self.build(value_node, child, depth + 1, inner)
        return result
