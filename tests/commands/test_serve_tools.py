"""`tools`, `tool_choice` and `parallel_tool_calls` through `llmplan serve` and the real `openai` client, on a
tiny random model (one server for the module; the bundled model's calls: tests/pipeline/test_serve_tools_real.py).

The answers are noise held to the tools' formats, so what holds whatever the weights: a call that is
required comes back as `tool_calls` of a tool that was given, its arguments valid for that tool's schema,
with `finish_reason: "tool_calls"`, streamed as the same calls. The parameter schemas bound their strings so
noise cannot run on; `auto` is pushed towards a call by a `logit_bias` on the marker's first tokens.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from llmplan.commands.serve.app import ServerSettings
from llmplan.commands.serve.openai_api import ChatRequest
from llmplan.commands.serve.request_body import validate
from llmplan.commands.serve.tool_calls import MARKER
from llmplan.llm.text import Tokenizer

from .conftest import LiveServer, write_serve_plan
from .openai_shapes import conforms, stream_bodies

CHAT = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "label": {"type": ["string", "null"], "maxLength": 4},
    },
    "required": ["hour"],
    "additionalProperties": False,  # else noise may add keys without end
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM, "strict": True}},
    {"type": "function", "function": {"name": "now", "description": "the time (no parameters)"}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM, "now": {"type": "object", "maxProperties": 0}}


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("tools")
    model_dir = root / "tiny-tools"  # a longer context: the tools' description is a long prompt in this vocabulary
    shutil.copytree(tiny_model, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    plan = write_serve_plan(root, model_dir, context=1024, max_new_tokens=200)
    with LiveServer(plan, ServerSettings(max_queue=16, access_log=None)) as server:
        yield server


@pytest.fixture(scope="module")
def towards_a_call(live: LiveServer) -> dict[str, float]:
    """A logit_bias that makes the first token one that starts the marker (a text answer may not)."""
    tok: Tokenizer = live.host.context.tokenizer
    starts = [i for i in range(tok.vocab_size) if (t := tok.decode([i])) and MARKER.startswith(t)]
    assert starts
    return {str(i): 100.0 for i in starts}


def sdk(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)


def ask(live: LiveServer, **body: Any) -> dict[str, Any]:
    answer = httpx.post(f"{live.url}/chat/completions", json={"model": "m", "messages": CHAT, **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    made = answer.json()
    conforms("chat.completion", made)
    return made["choices"][0]  # type: ignore[no-any-return]


def ask_streamed(live: LiveServer, **body: Any) -> tuple[str, list[dict[str, Any]], str]:
    """(content, the calls joined from their deltas, finish reason) of a streamed answer."""
    payload = {"model": "m", "messages": CHAT, "stream": True, **body}
    with httpx.stream("POST", f"{live.url}/chat/completions", json=payload, timeout=60) as answer:
        assert answer.status_code == 200, answer.read()
        chunks = stream_bodies(list(answer.iter_lines()))
    content, calls, reason = "", {}, None
    for chunk in chunks:
        conforms("chat.completion.chunk", chunk)
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            for part in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(part["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = part.get("id") or call["id"]
                call["name"] += (part.get("function") or {}).get("name") or ""
                call["arguments"] += (part.get("function") or {}).get("arguments") or ""
            reason = choice["finish_reason"] or reason
    assert reason is not None
    return content, [calls[k] for k in sorted(calls)], reason


def streamed_parts(live: LiveServer, **body: Any) -> list[dict[str, Any]]:
    """The `delta.tool_calls` parts of a streamed answer in their order, each in a chunk of its own, after
    checking the shape every call's parts must have: its header first (id, type, name, arguments ""), then
    only argument fragments, the calls one after another by index; no content."""
    payload = {"model": "m", "messages": CHAT, "stream": True, **body}
    with httpx.stream("POST", f"{live.url}/chat/completions", json=payload, timeout=60) as answer:
        assert answer.status_code == 200, answer.read()
        chunks = stream_bodies(list(answer.iter_lines()))
    parts = []
    for chunk in chunks:
        conforms("chat.completion.chunk", chunk)
        for choice in chunk["choices"]:
            assert not choice["delta"].get("content")
            assert len(choice["delta"].get("tool_calls") or []) <= 1
            parts += choice["delta"].get("tool_calls") or []
    begun: list[int] = []
    for part in parts:
        if "id" in part:  # a header: the next call's, its name whole
            assert part["index"] == len(begun) and part["id"].startswith("call_") and part["type"] == "function"
            assert part["function"]["name"] and part["function"]["arguments"] == ""
            begun.append(part["index"])
        else:  # a fragment of the call begun last
            assert begun and part == {"index": begun[-1], "function": {"arguments": part["function"]["arguments"]}}
            assert part["function"]["arguments"]
    return parts


def joined(parts: list[dict[str, Any]]) -> list[tuple[str, str, str, int]]:
    """(id, name, arguments joined, how many fragments) per call index."""
    calls: dict[int, list[Any]] = {}
    for part in parts:
        if "id" in part:
            calls[part["index"]] = [part["id"], part["function"]["name"], "", 0]
        else:
            calls[part["index"]][2] += part["function"]["arguments"]
            calls[part["index"]][3] += 1
    return [tuple(calls[k]) for k in sorted(calls)]  # type: ignore[misc]


def checked_calls(choice: dict[str, Any], names: set[str]) -> list[tuple[str, Any]]:
    """The (name, arguments) of a choice's calls, each of a given tool and valid for its schema."""
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    out = []
    for call in choice["message"]["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])
        out.append((name, arguments))
    return out


@pytest.mark.parametrize("parallel", [None, False], ids=["parallel", "one"])
def test_a_required_call_names_a_tool_with_valid_arguments(live: LiveServer, parallel: bool | None) -> None:
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    for seed in range(4):
        choice = ask(live, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, **extra)
        calls = checked_calls(choice, set(SCHEMAS))
        assert 1 <= len(calls) <= (8 if parallel is None else 1)


def test_a_named_function_is_the_one_called(live: LiveServer) -> None:
    for name in ("set_alarm", "get_weather"):
        named = {"type": "function", "function": {"name": name}}
        for seed in range(2):
            choice = ask(live, tools=TOOLS, tool_choice=named, temperature=1.0, seed=seed)
            assert [n for n, _ in checked_calls(choice, {name})] == [name]


def test_the_sdk_reads_the_calls(live: LiveServer) -> None:
    answer = sdk(live).chat.completions.create(
        model="m",
        messages=CHAT,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,  # type: ignore[arg-type]
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"],
    ids=["required", "named", "auto"],
)
def test_streamed_calls_come_as_generated_and_join_to_the_whole_answers(
    live: LiveServer, choice: Any, towards_a_call: dict[str, float]
) -> None:
    body = {"tools": TOOLS, "tool_choice": choice, "temperature": 0, "logit_bias": towards_a_call}
    whole = ask(live, **body)
    calls = joined(streamed_parts(live, **body))
    wanted = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert [(name, arguments) for _, name, arguments, _ in calls] == wanted
    # this vocabulary's tokens are a character or two: the arguments come in many fragments, as generated
    assert all(fragments > 1 for _, _, arguments, fragments in calls if len(arguments) > 2), calls
    content, parts, reason = ask_streamed(live, **body)  # as a client joins them, with the finish reason
    assert (content, reason) == ("", "tool_calls") and len(parts) == len(wanted)


def test_parallel_calls_stream_one_index_after_another(live: LiveServer) -> None:
    """A bias against the list's end makes the answer as many calls as it may have, of two tools; a call that
    repeats an earlier one ends the list there (#56: greedy, the tiny model repeats its call to the cap)."""
    tok: Tokenizer = live.host.context.tokenizer
    ends = {str(i): -100.0 for i in range(tok.vocab_size) if "]" in tok.decode([i])}
    for seed in range(8):  # sampled until an answer has several calls
        body = {"tools": TOOLS[1:], "tool_choice": "required", "logit_bias": ends, "max_tokens": 600}
        body |= {"temperature": 1.0, "seed": seed}
        whole = ask(live, **body)
        wanted = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
        assert len(set(wanted)) == len(wanted) and 1 <= len(wanted) <= 8, wanted  # never a repeat
        if len(wanted) > 1:
            break
    assert len(wanted) > 1
    calls = joined(streamed_parts(live, **body))
    assert [(name, arguments) for _, name, arguments, _ in calls] == wanted
    assert len({ident for ident, *_ in calls}) == len(wanted)  # an id of its own per call
    assert all(fragments > 1 for _, _, arguments, fragments in calls if len(arguments) > 2), calls


def test_auto_answers_text_or_a_call(live: LiveServer, towards_a_call: dict[str, float]) -> None:
    text = ask(live, tools=TOOLS, temperature=0)  # tool_choice defaults to auto
    assert "tool_calls" not in text["message"] and text["finish_reason"] in ("stop", "length")
    assert text["message"]["content"] and not text["message"]["content"].startswith("<")
    assert ask_streamed(live, tools=TOOLS, temperature=0) == (text["message"]["content"], [], text["finish_reason"])
    called = ask(live, tools=TOOLS, temperature=0, logit_bias=towards_a_call)
    checked_calls(called, set(SCHEMAS))


def test_tool_choice_none_is_text_even_when_it_looks_like_a_call(
    live: LiveServer, towards_a_call: dict[str, float]
) -> None:
    choice = ask(live, tools=TOOLS, tool_choice="none", temperature=0, logit_bias=towards_a_call, max_tokens=8)
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] != "tool_calls"
    assert choice["message"]["content"].startswith("<")  # free text: the bias had its way, no call was read


def test_a_call_cut_short_says_length(live: LiveServer) -> None:
    for stream in (False, True):
        body = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 4}
        if stream:
            content, calls, reason = ask_streamed(live, **body)
        else:
            choice = ask(live, **body)
            content, calls, reason = choice["message"]["content"], [], choice["finish_reason"]
        assert reason == "length" and calls == [] and content.startswith("<")


def test_a_call_cut_short_in_its_arguments_streams_as_far_as_it_went(live: LiveServer) -> None:
    body = {"tools": TOOLS, "tool_choice": "required", "temperature": 0}
    call = ask(live, **body)["message"]["tool_calls"][0]["function"]
    text = MARKER + json.dumps([{"name": call["name"], "arguments": json.loads(call["arguments"])}])
    tok: Tokenizer = live.host.context.tokenizer
    cut = len(tok.encode(text[: text.index('"arguments": {') + 16], add_bos=False))  # a few characters in
    whole = ask(live, **body, max_tokens=cut)
    assert whole["finish_reason"] == "length" and whole["message"]["content"].startswith(MARKER)  # text, unread
    content, calls, reason = ask_streamed(live, **body, max_tokens=cut)
    assert (content, reason, len(calls)) == ("", "length", 1) and calls[0]["name"] == call["name"]
    assert calls[0]["arguments"] and call["arguments"].startswith(calls[0]["arguments"])
    assert calls[0]["arguments"] != call["arguments"]


HISTORY = [
    *CHAT,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
]


def test_a_history_of_calls_goes_through_the_template(live: LiveServer) -> None:
    with_calls = ask(live, messages=HISTORY, tools=TOOLS, max_tokens=2)
    bare = [HISTORY[0], HISTORY[1] | {"tool_calls": None, "content": ""}, HISTORY[2]]
    without = ask(live, messages=bare, tools=TOOLS, max_tokens=2)
    # the tiny template does not render tool_calls: the call went in as text, so the prompt is longer
    assert with_calls["finish_reason"] and without["finish_reason"]
    usage = [
        httpx.post(f"{live.url}/chat/completions", json={"messages": m, "max_tokens": 1}, timeout=60).json()["usage"]
        for m in (HISTORY, bare)
    ]
    assert usage[0]["prompt_tokens"] > usage[1]["prompt_tokens"]


def test_the_history_turn_is_the_calls_as_text_or_as_they_came() -> None:
    body = validate(ChatRequest, {"messages": HISTORY, "tools": TOOLS, "tool_choice": "required"})
    body.check_combination()
    as_text = body.tokenize_overrides("Be brief.", renders_calls=False)["messages"]
    assert as_text[0]["role"] == "system" and as_text[0]["content"].startswith("Be brief.\n\nYou can call")
    assert "set_alarm" in as_text[0]["content"] and as_text[1] == CHAT[0]
    assert as_text[2]["content"] == MARKER + '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert as_text[3] == {"role": "tool", "content": "-3 C, snow", "tool_call_id": "call_1"}
    as_came = body.tokenize_overrides(None, renders_calls=True)["messages"]
    assert as_came[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # as HF's templates read it


def test_history_arguments_with_a_key_twice_go_to_the_template_as_sent() -> None:
    """Neither value of a key given twice is dropped silently (json.loads keeps the last): the string as sent."""
    twice = '{"city": "Oslo", "city": "Rome"}'
    turn = HISTORY[1] | {
        "tool_calls": [HISTORY[1]["tool_calls"][0] | {"function": {"name": "get_weather", "arguments": twice}}]
    }
    body = validate(ChatRequest, {"messages": [HISTORY[0], turn, HISTORY[2]], "tools": TOOLS})
    body.check_combination()
    as_text = body.tokenize_overrides(None, renders_calls=False)["messages"]
    assert as_text[2]["content"] == MARKER + json.dumps([{"name": "get_weather", "arguments": twice}])
    as_came = body.tokenize_overrides(None, renders_calls=True)["messages"]
    assert as_came[2]["tool_calls"][0]["function"]["arguments"] == twice


UNENFORCEABLE = [
    (
        {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}},
        "uniqueItems",
        "properties.t.uniqueItems",
    ),
    ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "if", "if"),
    (
        {"type": "object", "properties": {"w": {"type": "string", "format": "hostname-ish"}}},
        "format",
        "properties.w.format",
    ),
]


@pytest.mark.parametrize(("schema", "keyword", "where"), UNENFORCEABLE, ids=[k for _, k, _ in UNENFORCEABLE])
def test_a_parameter_keyword_that_cannot_be_enforced_is_a_400(
    live: LiveServer, schema: dict[str, Any], keyword: str, where: str
) -> None:
    tools = [TOOLS[0], {"type": "function", "function": {"name": "bad", "parameters": schema}}]
    for choice in ("auto", "required", "none"):  # refused whether or not a call is asked for
        answer = httpx.post(
            f"{live.url}/chat/completions", json={"messages": CHAT, "tools": tools, "tool_choice": choice}, timeout=60
        )
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == "tools[1].function.parameters", error
        assert f"{keyword!r} at tools[1].function.parameters.{where} cannot be enforced" in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", "'fly'"),
        ({"tools": [TOOLS[2], TOOLS[2]]}, "tools", "given twice"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "'function'"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "must match"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'required'"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "tool_choice: none"),
    ],
    ids=["choice-without-tools", "unknown-name", "twice", "type", "name", "choice", "with-response_format"],
)
def test_malformed_tools_are_a_400_naming_the_field(
    live: LiveServer, body: dict[str, Any], param: str, says: str
) -> None:
    answer = httpx.post(f"{live.url}/chat/completions", json={"messages": CHAT, **body}, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param and says in error["message"], error
    conforms("error", error)


def test_tool_choice_none_keeps_a_response_format(live: LiveServer) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    choice = ask(live, tools=TOOLS, tool_choice="none", response_format=rf, temperature=0)
    jsonschema.validate(json.loads(choice["message"]["content"]), WEATHER)


def test_the_responses_endpoint_refuses_tools_by_name(live: LiveServer) -> None:
    body = {"input": "hi", "tools": [{"type": "function", "name": "now", "parameters": {}}]}
    answer = httpx.post(f"{live.url}/responses", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"


def test_a_repeated_call_ends_the_answer_at_the_repeat(live: LiveServer) -> None:
    """Greedy, with the list's end barred, the tiny model writes its one call again and again (#56): the answer
    ends at the first repeat, not at the calls' cap or the token limit, streamed as it is whole."""
    tok: Tokenizer = live.host.context.tokenizer
    ends = {str(i): -100.0 for i in range(tok.vocab_size) if "]" in tok.decode([i])}
    body = {"tools": TOOLS[1:], "tool_choice": "required", "logit_bias": ends, "max_tokens": 600, "temperature": 0}
    answer = sdk(live).chat.completions.create(model="m", messages=CHAT, **body)  # type: ignore[call-overload]
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    wanted = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert len(set(wanted)) == len(wanted) < 8, wanted
    # what was generated: the calls and one more (the repeat), then nothing (before #56's fix: 353 tokens, 8 calls)
    written = [{"name": n, "arguments": json.loads(a)} for n, a in [*wanted, wanted[-1]]]
    text = MARKER + json.dumps(written)[:-1]
    assert answer.usage is not None and answer.usage.completion_tokens <= len(tok.encode(text, add_bos=False)) + 2
    calls = joined(streamed_parts(live, **body))
    assert [(name, arguments) for _, name, arguments, _ in calls] == wanted
    content, parts, reason = ask_streamed(live, **body)
    assert (content, reason, len(parts)) == ("", "tool_calls", len(wanted))
