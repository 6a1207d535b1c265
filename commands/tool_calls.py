"""OpenAI's function calling over constrained decoding: `tools`, `tool_choice`, `parallel_tool_calls`.

The tools are described to the model in the system turn (the request's own, else the plan's, with the
description after it), and the answer is held to a format that only admits calls of those tools:

    tool_choice       the answer's format (a Lark grammar; the calls' JSON is compact, as any schema's)
    "required"        MARKER, then a JSON list of 1 .. 8 calls {"name", "arguments"} (one call, not a list,
                      when parallel_tool_calls is false); each call's arguments follow its tool's parameters
    {"function": ..}  MARKER, then one call of that function
    "auto" (default)  free text (not starting with "<"), or MARKER and the calls as for "required"
    "none"            free text; the tools are not described

The answer's text is then read back into `message.tool_calls` (ids `call_...`, `arguments` as a JSON string)
with `finish_reason: "tool_calls"`; an answer the token limit cut short stays text, with "length". A parameter
schema keyword that cannot be enforced is a 400 naming `tools[i].function.parameters` and the keyword.

The models' templates differ: one that renders `tool_calls` itself (Qwen2.5's) gets the history's calls as
they came; one that does not (SmolLM2's) gets them as the text the model would have written (MARKER and the
calls' JSON), so a later turn still sees what was called.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from llmplan.llm.output_format import JSON_OPTIONS, OutputFormat, UnsupportedFormat

from .structured_output import NAME, STRICT, ShapeError, refusal

MARKER = "<tool_call>"
MAX_CALLS = 8  # calls in one parallel answer, at most
MAX_TOOLS = 128  # OpenAI's limit
EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: no parameters


class FunctionSpec(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


class Tooled(BaseModel):
    """The request fields of function calling (mixed into the chat request)."""

    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class ToolMode:
    """How one request may call its tools, once checked: the format that holds the answer to them."""

    tools: tuple[Tool, ...]
    choice: str  # "auto", "required" or a function's name (a named choice)
    parallel: bool
    format: OutputFormat

    @property
    def free_text(self) -> bool:
        return self.choice == "auto"

    def describe(self) -> str:
        """The tools, told to the model (the system turn's end)."""
        listed = [
            {"name": t.function.name, "description": t.function.description or "", "parameters": _params(t)}
            for t in self.tools
            if self.choice in ("auto", "required") or t.function.name == self.choice
        ]
        calls = "a JSON list of calls" if self.parallel and self.choice in ("auto", "required") else "one call"
        how = f'{MARKER} followed by {calls}, each {{"name": <function name>, "arguments": {{...}}}}, and nothing else'
        when = f"To call functions, answer with {how}; otherwise answer." if self.free_text else f"Answer with {how}."
        return f"You can call these functions:\n{json.dumps(listed, ensure_ascii=False)}\n{when}"

    def read(self, text: str) -> list[dict[str, Any]] | None:
        """The calls in an answer, as OpenAI's `tool_calls`; None when it is text (or was cut short)."""
        if not text.startswith(MARKER):
            return None
        text = text[len(MARKER) :]
        try:
            made = json.loads(text)
        except ValueError:
            return None  # cut short by the token limit: the finish reason says so
        calls = made if isinstance(made, list) else [made]
        if not calls or not all(isinstance(c, dict) and "name" in c and "arguments" in c for c in calls):
            return None
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
            }
            for c in calls
        ]


def tool_mode(tools: list[Tool] | None, choice: Any, parallel: bool | None) -> ToolMode | None:
    """The request's tool mode (None: plain text), checked; ShapeError naming the field otherwise."""
    if choice is not None and not tools:
        raise ShapeError("tool_choice", "only allowed when tools are given")
    if not tools:
        return None
    names = [t.function.name for t in tools]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise ShapeError("tools", f"the function {twice!r} is given twice")
    for i, tool in enumerate(tools):
        prefix = f"tools[{i}].function.parameters"
        try:
            OutputFormat.from_json_schema(_params(tool)).check()
        except UnsupportedFormat as bad:
            raise ShapeError(prefix, refusal(bad, prefix)) from None
    picked = choice.function.name if isinstance(choice, NamedChoice) else (choice or "auto")
    if picked == "none":
        return None
    if isinstance(choice, NamedChoice) and picked not in names:
        raise ShapeError("tool_choice", f"no tool is named {picked!r} (the tools: {', '.join(names)})")
    chosen = tuple(t for t in tools if picked in ("auto", "required") or t.function.name == picked)
    wide = (parallel is None or parallel) and not isinstance(choice, NamedChoice)
    schema = _calls_schema(chosen, wide)
    # The marker, then the calls; with "auto", free text instead (which then may not start with "<")
    calls = f'"{MARKER}" calls\ncalls: %json {json.dumps(schema)}'
    grammar = f"start: TEXT | {calls}\nTEXT: /([^<][\\s\\S]*)?/" if picked == "auto" else f"start: {calls}"
    fmt = OutputFormat("grammar", grammar)
    try:
        fmt.check()
    except UnsupportedFormat as bad:  # each tool passed alone: only their union can be refused here
        raise ShapeError("tools", refusal(bad, "tools")) from None
    return ToolMode(tuple(tools), picked, wide, fmt)


def _params(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY


def _calls_schema(tools: tuple[Tool, ...], parallel: bool) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _params(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_CALLS} if parallel else one
    return schema | {"x-guidance": JSON_OPTIONS}  # compact, as a schema's own answer is (no free whitespace)


def history_turn(turn: dict[str, Any], template_renders_calls: bool) -> dict[str, Any]:
    """An assistant turn of tool calls for a template that ignores `tool_calls`: the calls as the text the
    model would have written (a template that renders them gets the turn as it came)."""
    calls = turn.get("tool_calls")
    if not calls or template_renders_calls:
        return turn
    written = []
    for call in calls:
        arguments = call["function"]["arguments"]
        with contextlib.suppress(ValueError):  # else a client's own text: kept as the string it sent
            arguments = json.loads(arguments)
        written.append({"name": call["function"]["name"], "arguments": arguments})
    text = MARKER + json.dumps(written, ensure_ascii=False, separators=(", ", ": "))
    return turn | {"content": (turn.get("content") or "") + text, "tool_calls": None}


@dataclass
class CallStream:
    """One streamed choice under a tool mode: which text is shown as content as it comes. The calls are sent
    whole when the answer ends (their JSON is read then); text is held only while it could still be the
    marker (auto) or always (a call is required)."""

    mode: ToolMode
    held: str = ""
    text: bool | None = None  # None: not known yet

    def push(self, piece: str) -> str:
        """The part of `piece` to show now as content."""
        if self.text:
            return piece
        self.held += piece
        if not self.mode.free_text or self.text is False:
            return ""
        if self.held.startswith(MARKER):
            self.text = False
            return ""
        if MARKER.startswith(self.held):
            return ""  # may still become the marker
        self.text, out, self.held = True, self.held, ""
        return out
