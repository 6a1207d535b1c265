"""A tool whose parameters use `$ref` into their own root (`#/$defs/...`, `#`): the call's grammar nests the
parameters under "arguments", so the references are moved with them (commands/serve/tool_calls.py), and the grammar
compiles and holds the same arguments as the parameters alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llmplan.commands.serve.tool_calls import Tool, ToolMode
from llmplan.llm.sampling import compile_format
from llmplan.llm.text import Tokenizer
from tests.stages.tiny_run import make_tokenizer

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
DEFS: dict[str, Any] = {
    "type": "object",
    "$defs": {"point": POINT},
    "properties": {"at": {"$ref": "#/$defs/point"}, "path": {"type": "array", "items": {"$ref": "#/$defs/point"}}},
    "required": ["at", "path"],
}
TREE: dict[str, Any] = {  # "#": the parameters themselves, recursively
    "type": "object",
    "properties": {"label": {"type": "string"}, "child": {"$ref": "#"}},
    "required": ["label"],
}


def _tool(name: str, parameters: dict[str, Any]) -> Tool:
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


@pytest.mark.parametrize("parallel", [False, True])
def test_references_move_with_the_parameters(tmp_path: Path, parallel: bool) -> None:
    make_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    mode = ToolMode((_tool("route", DEFS), _tool("tree", TREE)), "required", parallel=parallel)
    compile_format(mode.format, tok, frozenset([tok.eos_id]), tok.vocab_size)  # was: "Pointer ... does not exist"
    schema = json.loads(mode.format.spec.split("%json ", 1)[1].splitlines()[0])
    one = {**schema["items"], "$defs": schema["$defs"]} if parallel else schema
    good = [{"name": "route", "arguments": {"at": {"x": 1}, "path": [{"x": 2}]}},
            {"name": "tree", "arguments": {"label": "a", "child": {"label": "b", "child": {"label": "c"}}}}]  # fmt: skip
    bad = [{"name": "route", "arguments": {"at": {"x": "1"}, "path": []}},
           {"name": "tree", "arguments": {"label": "a", "child": {"child": {"label": "c"}}}}]  # fmt: skip
    for value in good:
        jsonschema.validate(value, one)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, one)
