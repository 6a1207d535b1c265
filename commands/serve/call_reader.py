"""Tool calls read as their text is generated, so a stream can send them as OpenAI does: a call's header
(index, id, name) once its name is known, then its `arguments` in fragments as they are written.

The answer's grammar is the tool mode's (commands/serve/tool_calls.py): MARKER then one call object or a JSON list
of them, or (Hermes' style) `<tool_call>\\n{call}\\n</tool_call>` one per line; a call is
`{"name": .., "arguments": ..}` in that order. The fragments are the arguments as the whole answer's reading
writes them (`json.dumps(json.loads(..), ensure_ascii=False)`), each piece sent once it is certain: a
string's characters as their escapes complete (a surrogate pair's halves together), a number or literal
once it ends, separators as ", " and ": ". Text that does not fit stops the reader (`broken`); what it sent
stays a prefix of the read, and the stream's end sends the rest (CallStream.finish).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MARKER = "<tool_call>"
NATIVE_END = "</tool_call>"
NATIVE_SEP = "\n"  # between two calls in Hermes' style

_NUMBER = frozenset("0123456789+-.eE")
_SPACE = frozenset(" \t\n\r")
_CLOSE = {"{": "}", "[": "]"}


class Broken(ValueError):
    """Text the calls' grammar does not allow: the reader stops there."""


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str

    def delta(self) -> dict[str, Any]:
        """The call's header, as `delta.tool_calls[0]` (OpenAI's first chunk of a call)."""
        head = {"name": self.name, "arguments": ""}
        return {"index": self.index, "id": self.id, "type": "function", "function": head}


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str

    def delta(self) -> dict[str, Any]:
        return {"index": self.index, "function": {"arguments": self.text}}


CallEvent = CallStart | CallArguments


@dataclass
class StreamedCall:
    id: str
    name: str
    arguments: str = ""  # the fragments sent so far, joined


@dataclass
class _Container:
    kind: str  # "{" or "["
    want: str  # what may come next: "key|end", "key", "colon", "value", "value|end", "comma|end"
    keys: set[str] = field(default_factory=set)


def _canonical(raw: str) -> str:
    """A number or literal as the whole reading writes it."""
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False)
    except ValueError:
        raise Broken(raw) from None


def _decoded(unit: str) -> str:
    """A string's character (or escape) decoded; Broken where JSON does not allow it (a raw control char)."""
    try:
        made = json.loads(f'"{unit}"')
    except ValueError:
        raise Broken(unit) from None
    assert isinstance(made, str)
    return made


class _Value:
    """One JSON value read a character at a time, written out canonically (the module's doc) through `emit`."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.stack: list[_Container] = []
        self.lexeme: str | None = None  # "string", "number" or "literal" while one is read
        self.raw = ""  # the number or literal so far, or a string's escape so far
        self.pending = ""  # a high surrogate's escape, until its low half (or its absence) is known
        self.key: str | None = None  # the key being read (decoded), None while a string value is read
        self.done = False

    def push(self, ch: str) -> bool:
        """Read `ch`; False when it is not the value's (a number's end is known by the character after it)."""
        if self.lexeme == "string":
            self._string(ch)
            return True
        if self.lexeme is not None:
            if ch in _NUMBER if self.lexeme == "number" else ch.isalpha():
                self.raw += ch
                return True
            self.emit(_canonical(self.raw))
            self.lexeme, self.raw = None, ""
            self._ended()
            if self.done:
                return False
        if ch in _SPACE:
            return True
        if self.done:
            return False
        top = self.stack[-1] if self.stack else None
        want = top.want if top is not None else "value"
        if top is not None and want.endswith("|end") and ch == _CLOSE[top.kind]:
            self.stack.pop()
            self.emit(ch)
            self._ended()
        elif top is not None and want == "comma|end" and ch == ",":
            top.want = "key" if top.kind == "{" else "value"
            self.emit(", ")
        elif top is not None and want == "colon" and ch == ":":
            top.want = "value"
            self.emit(": ")
        elif want in ("key", "key|end") and ch == '"':
            self.lexeme, self.key = "string", ""
            self.emit(ch)
        elif want in ("value", "value|end"):
            if ch in _CLOSE:
                self.stack.append(_Container(ch, "key|end" if ch == "{" else "value|end"))
                self.emit(ch)
            elif ch == '"':
                self.lexeme, self.key = "string", None
                self.emit(ch)
            elif ch == "-" or ch.isdigit() or ch.isalpha():
                self.lexeme, self.raw = "number" if not ch.isalpha() else "literal", ch
            else:
                raise Broken(ch)
        else:
            raise Broken(ch)
        return True

    def _ended(self) -> None:
        """A value ended: the container it was in wants a comma or its end; the top level is done."""
        if self.stack:
            self.stack[-1].want = "comma|end"
        else:
            self.done = True

    def _string(self, ch: str) -> None:
        if self.raw:  # an escape under way: \x, or \uXXXX
            self.raw += ch
            if self.raw.startswith("\\u") and len(self.raw) < 6:
                return
            unit, self.raw = self.raw, ""
            self._unit(unit)
        elif ch == "\\":
            self.raw = ch
        elif ch == '"':
            self._flush()
            self.lexeme = None
            self.emit(ch)
            if self.key is None:
                self._ended()
                return
            top = self.stack[-1]
            if self.key in top.keys:  # the reading keeps the last value, in the first one's place
                raise Broken(f"the key {self.key!r} twice")
            top.keys.add(self.key)
            top.want, self.key = "colon", None
        else:
            self._unit(ch)

    def _unit(self, unit: str) -> None:
        char = _decoded(unit)
        if self.pending:
            if len(unit) == 6 and "\udc00" <= char <= "\udfff":  # the pair is one character once decoded
                char, self.pending = _decoded(self.pending + unit), ""
            else:
                self._flush()
        if len(unit) == 6 and "\ud800" <= char <= "\udbff":
            self.pending = unit
            return
        self._text(char)

    def _flush(self) -> None:
        if self.pending:
            char, self.pending = _decoded(self.pending), ""
            self._text(char)

    def _text(self, char: str) -> None:
        self.emit(json.dumps(char, ensure_ascii=False)[1:-1])
        if self.key is not None:
            self.key += char


class CallReader:
    """The calls of one answer in one tool format, as events while its text is fed (from its start)."""

    def __init__(self, native: bool) -> None:
        self.native = native
        self.seen = ""  # the text fed so far
        self.calls: list[StreamedCall] = []
        self.closed = 0  # the calls whose object has ended (their arguments whole)
        self.broken = False
        self._state = "tag"
        self._tag = MARKER + ("\n" if native else "")  # literal text that must come next
        self._then = "call" if native else "top"  # the state after it
        self._listed = False  # the server's parallel style: a JSON list of calls
        self._value: _Value | None = None
        self._parts: list[str] = []  # the text of the call's key or name being read
        self._key = ""
        self._name: str | None = None
        self._events: list[CallEvent] = []

    def feed(self, piece: str) -> list[CallEvent]:
        """The events `piece` makes certain (an argument fragment per call at most)."""
        if not self.broken:
            try:
                for ch in piece:
                    self._char(ch)
            except Broken:
                self.broken = True
        self.seen += piece
        events, self._events = self._events, []
        merged: list[CallEvent] = []
        for event in events:
            last = merged[-1] if merged else None
            if isinstance(event, CallArguments) and isinstance(last, CallArguments) and last.index == event.index:
                merged[-1] = CallArguments(event.index, last.text + event.text)
            else:
                merged.append(event)
        return merged

    def _char(self, ch: str) -> None:
        while not self._step(ch):
            pass

    def _step(self, ch: str) -> bool:
        """One state's reading of `ch`; False when the next state must read it too."""
        state = self._state
        if state == "tag":
            if ch != self._tag[0]:
                raise Broken(ch)
            self._tag = self._tag[1:]
            if not self._tag:
                self._state = self._then
            return True
        if self._value is not None:
            consumed = self._value.push(ch)
            if self._value.done:
                self._value_done()
            return consumed
        if ch in _SPACE and state in ("top", "call", "key", "colon", "next", "end"):
            return True  # the grammar's JSON is compact, but space between tokens does not matter
        if state == "between":  # Hermes' style: another call, on the next line
            self._tag, self._then, self._state = f"{NATIVE_SEP}{MARKER}\n", "call", "tag"
            return False
        if state == "top":  # after the server's marker: one call, or a list of them
            self._listed, self._state = ch == "[", "call"
            return ch == "["
        if state == "call" and ch == "{":
            self._state, self._name = "key", None
        elif state == "key" and ch == '"':
            self._parts = []
            self._value = _Value(self._parts.append)
            self._value.push(ch)
        elif state == "colon" and ch == ":":
            self._state = "value"
            if self._key == "arguments":
                if self._name is None:
                    raise Broken("arguments before the name")
                index = len(self.calls) - 1
                self._value = _Value(lambda text: self._arguments(index, text))
            elif self._key == "name":
                self._parts = []
                self._value = _Value(self._parts.append)
            else:
                raise Broken(self._key)
        elif state == "next" and ch == ",":
            self._state = "key"
        elif state == "next" and ch == "}":
            self._state = "after"
            self.closed += 1
        elif state == "after":
            return self._after(ch)
        else:
            raise Broken(ch)
        return True

    def _after(self, ch: str) -> bool:
        """Between a call's end and the next call (or the answer's end)."""
        if self.native:
            self._tag, self._then, self._state = f"\n{NATIVE_END}", "between", "tag"
            return False
        if ch in _SPACE:
            return True
        if self._listed and ch == ",":
            self._state = "call"
        elif self._listed and ch == "]":
            self._state = "end"
        else:
            raise Broken(ch)
        return True

    def _value_done(self) -> None:
        value, self._value = self._value, None
        assert value is not None
        if self._state == "key":
            self._key, self._state = json.loads("".join(self._parts)), "colon"
            return
        self._state = "next"
        if self._key == "name":
            name = json.loads("".join(self._parts))
            if not isinstance(name, str) or self._name is not None:
                raise Broken("name")
            self._name = name
            call = StreamedCall(f"call_{uuid.uuid4().hex[:24]}", name)
            self.calls.append(call)
            self._events.append(CallStart(len(self.calls) - 1, call.id, name))

    def _arguments(self, index: int, text: str) -> None:
        self.calls[index].arguments += text
        self._events.append(CallArguments(index, text))
