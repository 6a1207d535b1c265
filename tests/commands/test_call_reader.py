"""The incremental reader of tool calls (commands/serve/call_reader.py) and the stream's end (CallStream.finish):
fed an answer a character at a time, in random splits or whole, its events are the calls the whole answer's
reading (ToolMode.read) finds, header first, the arguments' fragments joined to the read's string."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import pytest

from llmplan.commands.serve.call_reader import MARKER, NATIVE_END, CallArguments, CallEvent, CallReader, CallStart
from llmplan.commands.serve.tool_calls import CallStream, RepeatStop, ToolMode

# raw JSON as a model may write it: escapes the reading rewrites, braces, brackets and quotes inside strings
ARGUMENTS = [
    r'{"city": "Oslo", "unit": "C"}',
    r'{"code": "if (a) { b[0] = \"}\"; }", "path": "C:\\dir\\{x}", "x": "]}\"{["}',
    r'{"s": "\u00e9\u0041\/\b\f\n\r\t\u001f\u007f", "emoji": "\ud83d\ude00", "lone": "\ud800x\udc00"}',
    r'{"n": [1.50, 1e2, -0, 1E-3, 0.0, -12, 123456789012345678901234567890], "ok": true, "no": false, "z": null}',
    r'{"deep": {"a": [[], {}, [{"b": [1, {"c": "}"}]}]], "e": {}}, "t": []}',
    r"{}",
    r'{"k\"ey\\": "v", "": "", "ключ": "значение ✓"}',
]


def answer(calls: list[tuple[str, str]], native: bool, listed: bool) -> str:
    """The raw answer text of (name, raw arguments) calls, in the grammar's layout."""
    objects = [f'{{"name": {json.dumps(name)}, "arguments": {raw}}}' for name, raw in calls]
    if native:
        return "\n".join(f"{MARKER}\n{o}\n{NATIVE_END}" for o in objects)
    return MARKER + (f"[{', '.join(objects)}]" if listed else objects[0])


def splits(text: str, how: str, rng: random.Random) -> list[str]:
    if how == "chars":
        return list(text)
    if how == "whole":
        return [text]
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, 7)
        pieces.append(text[at : at + step])
        at += step
    return pieces


def read_streamed(pieces: list[str], native: bool) -> tuple[CallReader, list[CallEvent]]:
    reader = CallReader(native)
    events = [event for piece in pieces for event in reader.feed(piece)]
    return reader, events


def check_events(events: list[CallEvent], wanted: list[dict[str, Any]]) -> None:
    """The events are the calls read whole: each header before its fragments, one call after another."""
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [(e.index, e.name) for e in starts] == [(k, c["function"]["name"]) for k, c in enumerate(wanted)]
    current = -1
    joined = [""] * len(wanted)
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == current + 1 and event.id.startswith("call_")
            current = event.index
        else:
            assert event.index == current and event.text
            joined[event.index] += event.text
    assert joined == [c["function"]["arguments"] for c in wanted]


LAYOUTS = [(False, False), (False, True), (True, False)]


@pytest.mark.parametrize(("native", "listed"), LAYOUTS, ids=["one", "listed", "native"])
@pytest.mark.parametrize("how", ["chars", "random", "whole"])
def test_each_call_streams_as_the_whole_reading_has_it(native: bool, listed: bool, how: str) -> None:
    rng = random.Random(7)
    mode = ToolMode((), "required", parallel=listed or native, native=native)
    for raw in ARGUMENTS:
        for calls in ([("get_weather", raw)], [("a", raw), ("b-2", ARGUMENTS[0]), ("c_3", raw)]):
            if len(calls) > 1 and not (listed or native):
                continue
            text = answer(calls, native, listed)
            wanted = mode.read(text)
            assert wanted is not None, text
            for _ in range(3 if how == "random" else 1):
                reader, events = read_streamed(splits(text, how, rng), native)
                assert not reader.broken, text
                check_events(events, wanted)


def test_fragments_are_sent_as_they_become_certain() -> None:
    text = MARKER + r'{"name": "f", "arguments": {"a": "x\u00e9\ud83d\ude00", "n": 12.50}}'
    reader = CallReader(native=False)
    sent = []
    for ch in text:
        sent.append("".join(e.text for e in reader.feed(ch) if isinstance(e, CallArguments)))
    at = text.index("arguments") + len('arguments": ')
    assert sent[at] == "{"  # the value's first character, at once
    escape = text.index(r"\u00e9")
    assert sent[escape : escape + 6] == [""] * 5 + ["é"]  # an escape once it is whole
    pair = text.index(r"\ud83d")
    assert sent[pair : pair + 12] == [""] * 11 + ["😀"]  # a surrogate pair's halves together
    number = text.index("12.50")
    assert sent[number : number + 6] == [""] * 5 + ["12.5}"]  # a number once it has ended (at the "}" after it)
    assert sent[number + 6 :] == [""]  # the call's own end: nothing more of the arguments


@pytest.mark.parametrize(
    "text",
    [
        MARKER + '{"arguments": {}, "name": "f"}',  # the grammar's order is name first
        MARKER + '{"name": "f", "arguments": {"a": 1, "a": 2}}',  # the reading keeps the last one
        MARKER + '{"name": "f", "args": {}}',
        MARKER + '{"name": "f", "arguments": {"a": tru}}',
        MARKER + '{"name": "f", "arguments": {"a": "\x01"}}',  # a raw control character
        "<tool_cal>{}",
    ],
    ids=["order", "key-twice", "key", "literal", "control", "marker"],
)
def test_text_outside_the_grammar_stops_the_reader(text: str) -> None:
    reader, _ = read_streamed(list(text), native=False)
    assert reader.broken


def test_text_after_the_calls_stops_the_reader_but_keeps_them() -> None:
    text = answer([("f", '{"a": 1}')], native=True, listed=False) + "\nmore"
    reader, events = read_streamed(list(text), native=True)
    assert reader.broken and [(c.name, c.arguments) for c in reader.calls] == [("f", '{"a": 1}')]
    assert len(events) > 2


MODE = ToolMode((), "auto", parallel=True)
CALLS = answer([("f", ARGUMENTS[1]), ("g", ARGUMENTS[2])], native=False, listed=True)


def owed_joined(stream: CallStream, pushed: list[str], text: str) -> tuple[Any, list[CallEvent], bool]:
    events = [e for piece in pushed for e in stream.push(piece)[1]]
    calls, owed, agreed = stream.finish(text)
    if calls is not None:
        check_events(events + owed, calls)
        ids = [e.id for e in events + owed if isinstance(e, CallStart)]
        assert ids == [c["id"] for c in calls]  # the read's calls carry the ids streamed
    return calls, owed, agreed


@pytest.mark.parametrize("upto", [0, 1, 20, 40, len(CALLS) - 3, len(CALLS)], ids=lambda n: f"upto{n}")
def test_the_end_sends_what_the_stream_owes_once(upto: int) -> None:
    """Nothing streamed (a results-cache replay), part of it, or all: what was sent and what is owed
    join to the calls read whole."""
    stream = CallStream(MODE)
    calls, owed, agreed = owed_joined(stream, list(CALLS[:upto]), CALLS)
    assert agreed and calls is not None and len(calls) == 2
    assert (owed == []) == (upto == len(CALLS))


def test_a_final_text_unlike_the_pieces_sends_the_rest_of_the_read() -> None:
    """The final text does not go on from the pieces (here one the reader refused, sending nothing of it):
    the reader stops, and the read's rest is sent after what was sent, which is its prefix."""
    cut = CALLS.index('"path"')
    stream = CallStream(MODE)
    calls, owed, agreed = owed_joined(stream, [CALLS[:cut], "#"], CALLS)
    assert agreed and calls is not None and stream.reader.broken
    assert owed[0] == CallArguments(0, CALLS[cut : CALLS.index("}, {")])


def test_a_key_written_twice_is_no_call_streamed_or_not() -> None:
    # Once the read kept the last value silently while the stream stopped at the second key (#56): now neither
    # reads calls (a closed parameter object never lets it be written; an open one may).
    text = MARKER + '[{"name": "f", "arguments": {"a": 1, "a": 2}}, {"name": "g", "arguments": {}}]'
    stream = CallStream(MODE)
    sent = [e for ch in text for e in stream.push(ch)[1]]
    calls, owed, agreed = stream.finish(text)
    assert calls is None and owed == [] and agreed
    assert "".join(e.text for e in sent if isinstance(e, CallArguments)) == '{"a": 1, "a"'


def test_a_repeated_call_ends_the_calls_streamed_or_not() -> None:
    call = '{"name": "f", "arguments": {"a": 1}}'
    other = '{"name": "f", "arguments": {"a": 2}}'
    text = MARKER + f"[{call}, {other}, {call}, {other}]"
    stream = CallStream(MODE)
    sent = [e for ch in text for e in stream.push(ch)[1]]
    calls, owed, agreed = stream.finish(text)
    assert calls is not None and [c["function"]["arguments"] for c in calls] == ['{"a": 1}', '{"a": 2}']
    assert agreed and [e.index for e in sent + owed if isinstance(e, CallStart)] == [0, 1]  # the repeat never sent
    joined = ["", ""]
    for e in sent + owed:
        if isinstance(e, CallArguments):
            joined[e.index] += e.text
    assert joined == ['{"a": 1}', '{"a": 2}']


@pytest.mark.parametrize("native", [False, True], ids=["listed", "native"])
def test_generation_stops_at_the_repeat_and_the_calls_end_before_it(native: bool) -> None:
    """RepeatStop, fed the answer as generated, cancels once a call ends that repeats an earlier one (the same
    name, the same arguments whatever their keys' order); the answer cut there reads as the calls before it,
    streamed or not. A call with other arguments, or one not yet ended, does not stop it."""
    mode = ToolMode((), "required", parallel=True, native=native)
    calls = [("f", '{"a": 1, "b": [2]}'), ("f", '{"a": 2, "b": [2]}'), ("f", '{"b": [2], "a": 1}'), ("g", "{}")]
    text = answer(calls, native=native, listed=True)
    repeat_ends = text.index('"a": 1}', text.index('"b": [2], "a"')) + len('"a": 1}}')  # the third call's end
    cancel = threading.Event()
    stop = RepeatStop(mode, cancel)
    for at, ch in enumerate(text):
        stop(ch)
        assert cancel.is_set() == (at + 1 >= repeat_ends), at
        if cancel.is_set():
            break
    cut = text[:repeat_ends]
    for whole in (cut, text):  # stopped at the repeat, or run on to the end: the same calls
        read = mode.read(whole)
        assert read is not None and [(c["function"]["name"], c["function"]["arguments"]) for c in read] == [
            ("f", '{"a": 1, "b": [2]}'),
            ("f", '{"a": 2, "b": [2]}'),
        ]
        stream = CallStream(mode)
        sent = [e for ch in whole for e in stream.push(ch)[1]]
        streamed, owed, agreed = stream.finish(whole)
        assert agreed and streamed is not None and len(streamed) == 2
        assert [e.index for e in sent + owed if isinstance(e, CallStart)] == [0, 1]
    assert mode.read(cut[: -len("}}")]) is None  # cut inside the repeat: not calls (the token limit's cut)
    assert mode.read(text[: text.index('{"name": "f", "arguments": {"b"') - 2]) is None  # cut before the repeat


def test_text_in_auto_is_content_and_a_cut_call_is_what_it_was() -> None:
    stream = CallStream(MODE)
    shown = [stream.push(piece) for piece in ["<", "tool", "s are fun"]]
    assert shown == [("", []), ("", []), ("<tools are fun", [])]
    assert stream.finish("<tools are fun") == (None, [], True) and not stream.started
    cut = CALLS[: CALLS.index("path")]
    stream = CallStream(MODE)
    events = [e for ch in cut for e in stream.push(ch)[1]]
    assert stream.finish(cut) == (None, [], True) and stream.started
    assert "".join(e.text for e in events if isinstance(e, CallArguments)) == '{"code": "if (a) { b[0] = \\"}\\"; }", "'
