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

The models' templates differ. One with a tool format of its own (Qwen2.5's, Hermes' style: it renders the
`tools` variable and asks for `<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>`) gets the tools
as that variable, and the answer is held to its format instead (`ToolMode.native`: one tagged call per
line). A template that renders `tool_calls` gets the history's calls with their arguments as mappings, as
HF's templates read them; one that does not (SmolLM2's) gets them as the text the model would have written
(MARKER and the calls' JSON), so a later turn still sees what was called.
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, Field

from llmplan.llm.sampling import JSON_OPTIONS, OutputFormat, UnsupportedFormat, kept_schema

from .call_reader import (
    MARKER,
    NATIVE_END,
    NATIVE_SEP,
    CallArguments,
    CallEvent,
    CallReader,
    CallStart,
    StreamedCall,
)
from .structured_output import NAME, STRICT, ShapeError, refusal

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
    """How one request may call its tools, once checked: the format that holds the answer to them, in this
    server's own style (MARKER and the calls' JSON) or, for a template that has its own, Hermes' style
    (`native`: each call `<tool_call>\n{json}\n</tool_call>`, as Qwen2.5's template asks)."""

    tools: tuple[Tool, ...]
    choice: str  # "auto", "required" or a function's name (a named choice)
    parallel: bool
    native: bool = False
    tag_tokens: bool = False  # the tags are tokens of the vocabulary (Qwen's): the grammar names them as such

    @property
    def free_text(self) -> bool:
        return self.choice == "auto"

    @property
    def chosen(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.choice in ("auto", "required") or t.function.name == self.choice)

    @property
    def format(self) -> OutputFormat:
        """The grammar of the answer: the calls, or (auto) free text that does not start with "<"."""
        one = _call_schema(self.chosen)
        compact = {"x-guidance": JSON_OPTIONS}  # as a schema's own answer is: no free whitespace
        if self.native:  # each call in its tags, one per line
            calls = f"call ({json.dumps(NATIVE_SEP)} call)~0..{MAX_CALLS - 1}" if self.parallel else "call"
            # A tag that is a token must be named as one: llguidance lets an answer write its text only as that
            # token, and refuses the token for a spelled-out literal (compile_format refuses such a grammar).
            tags = (
                (f"<{MARKER[1:-1]}>", f"<{NATIVE_END[1:-1]}>")
                if self.tag_tokens
                else (f'"{MARKER}"', f'"{NATIVE_END}"')
            )
            body = f'{calls}\ncall: {tags[0]} "\\n" body "\\n" {tags[1]}\nbody: %json {json.dumps(one | compact)}'
        else:
            if self.parallel:  # the parameters' moved definitions stay at the root (their references say so)
                defs = {"$defs": one.pop("$defs")} if "$defs" in one else {}
                listed = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_CALLS} | defs
            else:
                listed = one
            body = f'"{MARKER}" json\njson: %json {json.dumps(listed | compact)}'
        if self.free_text:
            return OutputFormat("grammar", f"start: TEXT | calls\ncalls: {body}\nTEXT: /([^<][\\s\\S]*)?/")
        return OutputFormat("grammar", f"start: calls\ncalls: {body}")

    def describe(self) -> str:
        """The tools, told to the model (the system turn's end) where its template has no tool format."""
        listed = [
            {"name": t.function.name, "description": t.function.description or "", "parameters": _params(t)}
            for t in self.chosen
        ]
        calls = "a JSON list of calls" if self.parallel else "one call"
        how = f'{MARKER} followed by {calls}, each {{"name": <function name>, "arguments": {{...}}}}, and nothing else'
        when = f"To call functions, answer with {how}; otherwise answer." if self.free_text else f"Answer with {how}."
        return f"You can call these functions:\n{json.dumps(listed, ensure_ascii=False)}\n{when}"

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the template's `tools` variable (OpenAI's shape, as HF's templates read it)."""
        return [t.model_dump(exclude_none=True) for t in self.chosen]

    def read(self, text: str) -> list[dict[str, Any]] | None:
        """The calls in an answer, as OpenAI's `tool_calls`; None when it is text (or was cut short)."""
        if not text.startswith(MARKER):
            return None
        calls = self._calls(text[len(MARKER) :])
        if not calls:
            return None
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
            }
            for c in calls
        ]

    def _calls(self, rest: str) -> list[dict[str, Any]] | None:
        """The calls after the marker, up to the first that repeats an earlier one (the same name and arguments:
        the answer ends there, whatever follows, as generation stops there: RepeatStop); None when the text is no
        whole list of calls (cut short by the token limit, a key written twice, text after the calls)."""
        if self.native:  # compact JSON has no raw newline: the tags between calls split them
            head, sep, end, loose = "\n", f"\n{NATIVE_END}{NATIVE_SEP}{MARKER}\n", f"\n{NATIVE_END}", False
        elif rest.lstrip().startswith("["):
            head, sep, end, loose = "[", ",", "]", True
        else:  # one call, not a list
            try:
                one = json.loads(rest, object_pairs_hook=_once)
            except ValueError:
                return None
            return [one] if _is_call(one) else None
        decoder = json.JSONDecoder(object_pairs_hook=_once)
        calls: list[dict[str, Any]] = []
        at = _past(rest, 0, head, loose)
        while at >= 0:
            try:
                call, at = decoder.raw_decode(rest, _past(rest, at, "", loose))
            except ValueError:
                return None
            if not _is_call(call):
                return None
            if any(same_call(c, call) for c in calls):
                return calls
            calls.append(call)
            if (rest[at:].strip() if loose else rest[at:]) == end:
                return calls
            at = _past(rest, at, sep, loose)
        return None


def _is_call(made: Any) -> bool:
    return isinstance(made, dict) and "name" in made and "arguments" in made


def _past(text: str, at: int, literal: str, loose: bool) -> int:
    """Where `text` goes on after `literal` at `at` (white space before it too when `loose`), or -1."""
    if loose:
        while at < len(text) and text[at] in " \t\n\r":
            at += 1
    return at + len(literal) if text.startswith(literal, at) else -1


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once (json.loads would keep the last of two silently)."""
    made = dict(pairs)
    if len(made) != len(pairs):
        raise ValueError("a key given twice")
    return made


def call_key(name: Any, arguments: Any) -> tuple[str, str]:
    """What makes two calls the same: the name, and the arguments as canonical JSON (keys sorted)."""
    return str(name), json.dumps(arguments, ensure_ascii=False, sort_keys=True)


def same_call(one: dict[str, Any], other: dict[str, Any]) -> bool:
    """Two calls read from an answer ({"name", "arguments"}) are the same call."""
    return call_key(one["name"], one["arguments"]) == call_key(other["name"], other["arguments"])


def _written_key(call: StreamedCall) -> tuple[str, str]:
    """A streamed call's key, from its arguments as written (canonical JSON once the call is whole)."""
    try:
        return call_key(call.name, json.loads(call.arguments))
    except ValueError:  # not whole: only the same text is the same
        return call.name, call.arguments


@dataclass
class RepeatStop:
    """Stops an answer at a repeated call: fed the answer's text as it is generated (on the model thread, token by
    token), it sets `cancel` once a call ends that repeats an earlier one (name and arguments), so the request ends
    at the next step rather than writing the same call to the calls' cap. The read ends the calls there too
    (ToolMode.read), streamed or not, and their finish reason is still "tool_calls"."""

    mode: ToolMode
    cancel: threading.Event
    reader: CallReader = field(init=False)
    checked: int = 0  # the ended calls compared so far
    repeated: bool = False

    def __post_init__(self) -> None:
        self.reader = CallReader(self.mode.native)

    def __call__(self, piece: str) -> None:
        if self.reader.broken or self.repeated:
            return
        self.reader.feed(piece)
        calls = self.reader.calls
        while self.checked < self.reader.closed:
            key = _written_key(calls[self.checked])
            if any(_written_key(c) == key for c in calls[: self.checked]):
                self.repeated = True
                self.cancel.set()
                return
            self.checked += 1


def tool_mode(tools: list[Tool] | None, choice: Any, parallel: bool | None) -> ToolMode | None:
    """The request's tool mode (None: plain text), checked in both styles; ShapeError naming the field."""
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
    wide = (parallel is None or parallel) and not isinstance(choice, NamedChoice)
    mode = ToolMode(tuple(tools), picked, wide)
    for style in (mode, replace(mode, native=True)):
        try:
            style.format.check()
        except UnsupportedFormat as bad:  # each tool passed alone: only their union can be refused here
            raise ShapeError("tools", refusal(bad, "tools")) from None
    return mode


def _params(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY


def _call_schema(tools: tuple[Tool, ...]) -> dict[str, Any]:
    """One call of one of `tools`: {"name": its name, "arguments": valid for its parameters}."""
    calls, defs = [], {}
    for t in tools:
        # Kept as any schema's answer is: parameter objects closed unless `additionalProperties` opens them (the
        # model could write a key twice), numbers bounded in digits.
        arguments = kept_schema(_params(t))
        if _has_local_ref(arguments):  # its `$ref`s point into its own root, which is no longer the root here
            defs[t.function.name] = _moved_refs(arguments, f"#/$defs/{t.function.name}")
            arguments = {"$ref": f"#/$defs/{t.function.name}"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return schema | {"$defs": defs} if defs else schema


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _moved_refs(node: Any, root: str) -> Any:
    """A copy of `node` with every local `$ref` ("#", "#/$defs/x", ...) pointing under `root` instead."""
    if isinstance(node, dict):
        return {
            k: root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _moved_refs(v, root)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_moved_refs(v, root) for v in node]
    return node


def history_turn(turn: dict[str, Any], template_renders_calls: bool) -> dict[str, Any]:
    """An assistant turn of tool calls for the template: for one that ignores `tool_calls`, the calls as the
    text the model would have written; for one that renders them, their arguments as mappings."""
    calls = turn.get("tool_calls")
    if calls and template_renders_calls:  # HF's templates read arguments as a mapping (they tojson it)
        return turn | {"tool_calls": [_arguments_read(call) for call in calls]}
    if not calls:
        return turn
    written = []
    for call in calls:
        arguments = call["function"]["arguments"]
        with contextlib.suppress(ValueError):  # else a client's own text (or a key twice): the string it sent
            arguments = json.loads(arguments, object_pairs_hook=_once)
        written.append({"name": call["function"]["name"], "arguments": arguments})
    text = MARKER + json.dumps(written, ensure_ascii=False, separators=(", ", ": "))
    return turn | {"content": (turn.get("content") or "") + text, "tool_calls": None}


def _arguments_read(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"], object_pairs_hook=_once)
    except ValueError:
        return call  # a client's own text (or a key given twice, not one of them dropped): the string it sent
    return call | {"function": call["function"] | {"arguments": arguments}}


@dataclass
class CallStream:
    """One streamed choice under a tool mode: which text is shown as content as it comes, and the calls'
    events (commands/serve/call_reader.py) once it is known to be calls. Text is held only while it could still be
    the marker (auto) or always (a call is required). A call named as an earlier one is held until it is whole:
    a repeat of an earlier call (name and arguments) is never sent, nor anything after it (as ToolMode.read)."""

    mode: ToolMode
    held: str = ""
    text: bool | None = None  # None: not known yet
    reader: CallReader = field(init=False)
    shown: list[StreamedCall] = field(default_factory=list)  # the calls as sent so far
    pending: list[CallEvent] = field(default_factory=list)  # a call that may repeat one, held until whole
    cut: bool = False  # a repeat was read: nothing more is sent

    def __post_init__(self) -> None:
        self.reader = CallReader(self.mode.native)

    @property
    def started(self) -> bool:
        """A call's header was sent: the answer is calls, even one the token limit cuts short."""
        return bool(self.shown)

    def push(self, piece: str) -> tuple[str, list[CallEvent]]:
        """The part of `piece` to show now as content, and the calls' events it makes certain."""
        if self.text:
            return piece, []
        self.held += piece
        if self.mode.free_text and self.text is None:
            if self.held.startswith(MARKER):
                self.text = False
            elif MARKER.startswith(self.held):
                return "", []  # may still become the marker
            else:
                self.text, out, self.held = True, self.held, ""
                return out, []
        return "", self._release(self.reader.feed(self.held[len(self.reader.seen) :]))

    def _release(self, events: list[CallEvent]) -> list[CallEvent]:
        """The events to send now: a call named as an earlier one waits until the next call starts."""
        out: list[CallEvent] = []
        for event in events:
            if isinstance(event, CallStart):
                out += self._settle()
                if not self.cut and any(call.name == event.name for call in self.shown):
                    self.pending = [event]
                    continue
            if self.cut:
                continue
            if self.pending:
                self.pending.append(event)
                continue
            out.append(self._sent(event))
        return out

    def _settle(self) -> list[CallEvent]:
        """The held call, now whole: sent, or (a repeat) dropped with everything after it."""
        held, self.pending = self.pending, []
        if not held or self.cut:
            return []
        start = held[0]
        assert isinstance(start, CallStart)
        arguments = "".join(e.text for e in held[1:] if isinstance(e, CallArguments))
        whole = _written_key(StreamedCall(start.id, start.name, arguments))
        if any(_written_key(call) == whole for call in self.shown):
            self.cut = True
            return []
        return [self._sent(event) for event in held]

    def _sent(self, event: CallEvent) -> CallEvent:
        if isinstance(event, CallStart):
            self.shown.append(StreamedCall(event.id, event.name))
        else:
            self.shown[event.index].arguments += event.text
        return event

    def finish(self, text: str) -> tuple[list[dict[str, Any]] | None, list[CallEvent], bool]:
        """At the answer's end (`text`, the whole answer): its calls as read whole, with the ids the stream
        gave them; the events the stream still owes so that the fragments joined are those calls (the text
        the pieces did not bring; all of it for a results-cache replay, which streams nothing); and whether
        what was sent agrees with the read (else only what had not been sent of it is sent)."""
        calls = self.mode.read(text)
        owed: list[CallEvent] = []
        if (calls is not None or self.started) and text.startswith(self.reader.seen):
            owed = self._release(self.reader.feed(text[len(self.reader.seen) :]))
        owed += self._settle()
        if calls is None:
            return None, owed, True
        sent, agreed = self.shown, len(self.shown) <= len(calls)
        for k, call in enumerate(calls):
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            if k >= len(sent):  # not begun: sent whole, the header then the arguments
                owed += [CallStart(k, call["id"], name), CallArguments(k, arguments)]
                continue
            call["id"] = sent[k].id
            if sent[k].name != name or not arguments.startswith(sent[k].arguments):
                agreed = False  # what was sent stays sent: nothing more of this call
            elif len(arguments) > len(sent[k].arguments):
                owed.append(CallArguments(k, arguments[len(sent[k].arguments) :]))
        return calls, owed, agreed
