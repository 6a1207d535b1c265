"""Issue 56's proof on the served bundled SmolLM2 (fp32, greedy), through the real `openai` client, streamed and
not: a corpus of fresh hostile requests of each class the issue names, each beside a benign twin.

    spelled    shapes that can only be met by spelling the end token or a control token
    limits     shapes the matcher cannot hold (huge repeats, nested quantifiers, a grammar of many thousand
               alternatives, a rule or a `$ref` that only recurses)
    schema     schema answers (objects closed by default, unbounded integers and numbers, a stop string beside
               a format, `ignore_eos` beside one)
    tools      tool calls (open parameter objects where a key could come twice, a history whose arguments
               hold a key twice)
    responses  /v1/responses' own fields given loosely
    fields     request fields out of range or of the wrong kind

Every hostile case is a 4xx whose message is one line, before any token (streamed too: the status, not an
event after a 200); every twin is a 200. Every 200 whose finish is `stop` (or `tool_calls`) holds its shape:
the JSON parses (no key twice) and validates, the regex fullmatches, the choice is a member, the calls name a
given tool with arguments valid for it; streamed equals whole. No case takes 60 s; the server's process (this
one: the server runs in a thread) stays under 4 GB of RSS.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import openai
import psutil
import pytest

from .conftest import served_fp32_client

MAX_TOKENS = 12
CALL_TOKENS = 40  # a call's text, whole
LONGER = {"max_tokens": 32}  # a small object, whole
# twins whose answer ends by itself (greedy): their shape is checked, not only allowed to be
ENDS = {"stop-beside-schema-twin", "text-format-strict-string-twin", "tools-closed-parameters", "gbnf-many-twin"}
RSS_LIMIT = 4 << 30
CASE_LIMIT_S = 60.0
ASK = [{"role": "user", "content": "Describe a city as JSON."}]

Holds = Callable[[str], bool]


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    made = dict(pairs)
    if len(made) != len(pairs):
        raise ValueError("a key twice")
    return made


def schema(shape: dict[str, Any]) -> Holds:
    """The answer parses (no key written twice) and validates against `shape`."""

    def holds(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text, object_pairs_hook=_once), shape)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return holds


def regex(pattern: str) -> Holds:
    return lambda text: re.fullmatch(pattern, text) is not None


def member(*options: str) -> Holds:
    return lambda text: text in options


def closed(shape: dict[str, Any]) -> dict[str, Any]:
    """An object schema as the server keeps it: no keys but its properties."""
    return shape | {"additionalProperties": False}


@dataclass(frozen=True)
class Case:
    """One request: its endpoint ("chat", "completions", "responses"), its body (beside model and a prompt), whether
    it must be refused, and the shape a `stop` answer holds (for tools: each call's arguments, per tool)."""

    name: str
    body: dict[str, Any]
    refused: bool
    endpoint: str = "chat"
    holds: Holds | None = None
    tools: dict[str, Holds] = field(default_factory=dict)


def pair(name: str, hostile: dict[str, Any], twin: dict[str, Any], **shape: Any) -> list[Case]:
    """A hostile case and its benign twin, of one endpoint; `holds`: the twin's shape (the hostile case must be
    refused, so its shape is never checked)."""
    return [Case(f"{name}-hostile", hostile, True, **shape), Case(f"{name}-twin", twin, False, **shape)]


def rf(shape: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": shape}}}


CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "people": {"type": "integer"}},
    "required": ["name", "people"],
}
TAGGED = {"type": "object", "properties": {"tag": {"const": "<|im_end|>"}}, "required": ["tag"]}
TAGGED_TWIN = {"type": "object", "properties": {"tag": {"const": "im_end"}}, "required": ["tag"]}
ENDLESS = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"next": {"$ref": "#/$defs/node"}},
            "required": ["next"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
ENDING = json.loads(json.dumps(ENDLESS).replace('"required": ["next"], ', ""))
MANY = " | ".join(f'"w{i}"' for i in range(25_000))
FEW = " | ".join(f'"w{i}"' for i in range(25))

SPELLED = [
    *pair(
        "json-const-im_end", {"guided_json": TAGGED}, {"guided_json": TAGGED_TWIN}, holds=schema(closed(TAGGED_TWIN))
    ),
    *pair(
        "enum-endoftext",
        rf({"type": "string", "enum": ["<|endoftext|>"]}),
        rf({"type": "string", "enum": ["endoftext"]}),
        holds=member('"endoftext"'),
    ),
    *pair(
        "regex-repeated-end",
        {"guided_regex": "(<\\|im_end\\|>)+"},
        {"guided_regex": "(ab){1,3}"},
        holds=regex("(ab){1,3}"),
    ),
    *pair(
        "choice-im_start",
        {"guided_choice": ["<|im_start|>assistant"]},
        {"guided_choice": ["assistant"]},
        endpoint="completions",
        holds=member("assistant"),
    ),
    *pair(
        "lark-terminal-end",
        {"grammar": 'start: "x" END\nEND: "<|im_end|>"'},
        {"grammar": 'start: "x" END\nEND: "y"'},
        holds=member("xy"),
    ),
    *pair("format-regex", {"format": {"regex": "ok<\\|im_end\\|>"}}, {"format": {"regex": "ok"}}, holds=member("ok")),
    *pair(
        "gbnf-endoftext",
        {"guided_grammar": 'root ::= "<|endoftext|>" [a-z]'},
        {"guided_grammar": 'root ::= "eot" [a-z]'},
        holds=regex("eot[a-z]"),
    ),
    *pair(
        "responses-text-format",
        {"text": {"format": {"type": "json_schema", "name": "s", "schema": TAGGED}}},
        {"text": {"format": {"type": "json_schema", "name": "s", "schema": TAGGED_TWIN}}},
        endpoint="responses",
        holds=schema(closed(TAGGED_TWIN)),
    ),
]

LIMITS = [
    *pair("regex-huge-repeat", {"guided_regex": "z{300000}"}, {"guided_regex": "z{3}"}, holds=regex("z{3}")),
    *pair(
        "regex-nested",
        {"guided_regex": "((q{1,90}){1,90}){1,90}"},
        {"guided_regex": "((q{1,2}){1,2}){1,2}"},
        holds=regex("((q{1,2}){1,2}){1,2}"),
    ),
    *pair(
        "gbnf-many",
        {"guided_grammar": f"root ::= {MANY}"},
        {"guided_grammar": f"root ::= {FEW}"},
        holds=regex("w([0-9]|1[0-9]|2[0-4])"),
    ),
    *pair(
        "lark-only-recurses",
        {"grammar": 'start: item\nitem: "[" item "]"'},
        {"grammar": 'start: item\nitem: "[" item "]" | "x"'},
        holds=regex(r"(\[)*x(\])*"),
    ),
    *pair("ref-required-forever", {"guided_json": ENDLESS}, {"guided_json": ENDING}, holds=schema(ENDING)),
]

SCHEMAS = [
    *pair("stop-beside-schema", rf(CITY) | {"stop": ["}"]}, rf(CITY) | LONGER, holds=schema(closed(CITY))),
    *pair("ignore_eos-beside-schema", rf(CITY) | {"ignore_eos": True}, rf(CITY) | LONGER, holds=schema(closed(CITY))),
    *pair(
        "open-object-number",
        rf({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}) | {"stop": "\n"},
        rf({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}),
        holds=schema(
            {
                "type": "object",
                "properties": {"x": {"type": "number"}},
                "required": ["x"],
                "additionalProperties": False,
            }
        ),
    ),
]

OPEN = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "additionalProperties": True}
SHUT = closed({"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]})


def tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "weather", "parameters": parameters}}


def called(arguments: str) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    called('{"city": "Oslo", "city": "Rome"}'),
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
]
TOOLS = [
    Case(
        "tools-open-parameters",
        {"tools": [tool(OPEN)], "tool_choice": "required", "max_tokens": CALL_TOKENS},
        False,
        tools={"weather": schema(OPEN)},
    ),
    Case(
        "tools-closed-parameters",
        {"tools": [tool(SHUT)], "tool_choice": "required", "max_tokens": CALL_TOKENS},
        False,
        tools={"weather": schema(SHUT)},
    ),
    Case(
        "tools-history-key-twice", {"tools": [tool(SHUT)], "messages": HISTORY}, False, tools={"weather": schema(SHUT)}
    ),
]

RESPONSES = [
    *pair("instructions-object", {"instructions": {"text": "x"}}, {"instructions": "Be brief."}, endpoint="responses"),
    *pair(
        "text-format-strict-string",
        {"text": {"format": {"type": "json_schema", "name": "s", "schema": CITY, "strict": "yes"}}},
        {
            "text": {"format": {"type": "json_schema", "name": "s", "schema": CITY, "strict": True}},
            "max_output_tokens": 32,
        },
        endpoint="responses",
        holds=schema(closed(CITY)),
    ),
    *pair(
        "input-part-text-number",
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
        endpoint="responses",
    ),
    *pair("max_output_tokens-string", {"max_output_tokens": "8"}, {"max_output_tokens": 8}, endpoint="responses"),
    *pair("text-verbosity-number", {"text": {"verbosity": 5}}, {"text": {"verbosity": "low"}}, endpoint="responses"),
]

FIELDS = [
    *pair("max_tokens-zero", {"max_tokens": 0}, {"max_tokens": 4}),
    *pair("n-zero", {"n": 0}, {"n": 1}),
    *pair("logit_bias-key", {"logit_bias": {"x": 1}}, {"logit_bias": {"42": 1}}),
    *pair("top_logprobs-many", {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": 2}),
    *pair("stop-five", {"stop": ["a", "b", "c", "d", "e"]}, {"stop": ["\n\n"]}),
    *pair(
        "role-wizard",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}]},
    ),
    *pair("seed-fraction", {"seed": 1.5}, {"seed": 7}),
    *pair("presence_penalty-high", {"presence_penalty": 3}, {"presence_penalty": 0.5}),
    *pair(
        "response_format-yaml",
        {"response_format": {"type": "yaml"}},
        {"response_format": {"type": "json_object"}},
        holds=schema({"type": "object"}),
    ),
    *pair("prompt-empty-list", {"prompt": []}, {"prompt": ["The city of"]}, endpoint="completions"),
]

CORPUS = [*SPELLED, *LIMITS, *SCHEMAS, *TOOLS, *RESPONSES, *FIELDS]


@dataclass
class Answer:
    """What a client got: a status; for a 200 the text, the finish and the calls (name, arguments); else the
    error's message."""

    status: int
    text: str = ""
    finish: str | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)
    message: str = ""


def _chat(client: openai.OpenAI, body: dict[str, Any], stream: bool) -> Answer:
    body = {"messages": ASK} | body
    messages = body.pop("messages")
    made = client.chat.completions.create(model="m", messages=messages, stream=stream, extra_body=body)
    if not stream:
        choice = made.choices[0]  # type: ignore[union-attr]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
        return Answer(200, choice.message.content or "", choice.finish_reason, calls)
    text, parts, finish = "", {}, None
    for chunk in made:  # type: ignore[union-attr]
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                name, arguments = parts.get(part.index, ("", ""))
                got = part.function
                parts[part.index] = (
                    name + ((got.name or "") if got else ""),
                    arguments + ((got.arguments or "") if got else ""),
                )
            finish = choice.finish_reason or finish
    return Answer(200, text, finish, [parts[k] for k in sorted(parts)])


def _completion(client: openai.OpenAI, body: dict[str, Any], stream: bool) -> Answer:
    body = {"prompt": "The city of"} | body
    prompt = body.pop("prompt")
    made = client.completions.create(model="m", prompt=prompt, stream=stream, extra_body=body)
    if not stream:
        return Answer(200, made.choices[0].text, made.choices[0].finish_reason)  # type: ignore[union-attr]
    text, finish = "", None
    for chunk in made:  # type: ignore[union-attr]
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return Answer(200, text, finish)


def _response(client: openai.OpenAI, body: dict[str, Any], stream: bool) -> Answer:
    body = {"input": ASK[0]["content"]} | body
    given = body.pop("input")
    if not stream:
        made = client.responses.create(model="m", input=given, extra_body=body)
    else:
        events = list(client.responses.create(model="m", input=given, stream=True, extra_body=body))
        done = [e for e in events if e.type in ("response.completed", "response.incomplete")]
        assert len(done) == 1, [e.type for e in events]
        made = done[0].response
    return Answer(200, made.output_text, "stop" if made.status == "completed" else "length")


SEND = {"chat": _chat, "completions": _completion, "responses": _response}


def send(client: openai.OpenAI, case: Case, stream: bool) -> Answer:
    body = {"temperature": 0, "max_tokens": MAX_TOKENS} | case.body
    if case.endpoint == "responses":
        body = {"temperature": 0, "max_output_tokens": MAX_TOKENS} | case.body
    try:
        return SEND[case.endpoint](client, body, stream)
    except openai.APIStatusError as bad:
        error = bad.body if isinstance(bad.body, dict) else {}
        return Answer(bad.status_code, message=str(error.get("message", bad.message)))


def check(case: Case, answer: Answer) -> None:
    """The corpus' rules for one answer (the module's doc)."""
    if case.refused:
        assert 400 <= answer.status < 500, (case.name, answer)
    else:
        assert answer.status == 200, (case.name, answer)
    if answer.status != 200:
        assert answer.message and "\n" not in answer.message and "Traceback" not in answer.message, answer
        return
    assert answer.finish in (("stop", "tool_calls") if case.name in ENDS else ("stop", "length", "tool_calls")), (
        case.name,
        answer,
    )
    if answer.finish == "tool_calls":
        assert case.tools and answer.calls and not answer.text, (case.name, answer)
        for name, arguments in answer.calls:
            assert name in case.tools and case.tools[name](arguments), (case.name, answer)
    elif answer.finish == "stop" and case.holds is not None:
        assert case.holds(answer.text), (case.name, answer)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[openai.OpenAI]:
    with served_fp32_client(tmp_path_factory.mktemp("hostile"), CASE_LIMIT_S) as client:
        yield client


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_the_hostile_corpus(client: openai.OpenAI, case: Case) -> None:
    started = time.monotonic()
    whole, streamed = send(client, case, stream=False), send(client, case, stream=True)
    assert time.monotonic() - started < CASE_LIMIT_S, case.name
    assert psutil.Process().memory_info().rss < RSS_LIMIT, case.name
    for answer in (whole, streamed):
        check(case, answer)
    if case.tools and whole.finish == "length":  # calls cut short: whole, the text; streamed, the calls begun
        return
    assert (whole.status, whole.text, whole.finish, whole.calls) == (
        streamed.status,
        streamed.text,
        streamed.finish,
        streamed.calls,
    ), case.name
