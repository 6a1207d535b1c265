"""`llmplan serve` with the answer's shape asked for: `response_format`, llama.cpp's `json_schema` / `grammar`
and vLLM's `guided_*`, through the real `openai` client, on a tiny random model (one server for the module).

A random model's answers are noise, so what holds here is the constraint itself: every answer that did not
stop for length parses and validates, whatever the weights. The schemas bound every string and number so the
noise cannot run on forever. A shape that cannot be enforced is a 400 naming the field and the keyword.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from llmplan.commands.serve.app import ServerSettings

from .conftest import LiveServer, write_serve_plan
from .openai_shapes import conforms, stream_bodies

CHAT = [{"role": "user", "content": "Describe a llama."}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "colour": {"enum": ["white", "brown", "black"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "friend": {"$ref": "#/$defs/friend"},
    },
    "required": ["name", "age", "colour", "tags", "friend"],
    "additionalProperties": False,
    "$defs": {"friend": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}},
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "llama", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("structured")
    plan = write_serve_plan(root, tiny_model, context=256, max_new_tokens=160)
    with LiveServer(plan, ServerSettings(max_queue=16, access_log=None)) as server:
        yield server


def sdk(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)


def streamed(live: LiveServer, path: str, body: dict[str, Any]) -> tuple[str, str]:
    """(the text, the finish reason) of a streamed answer, each chunk checked against OpenAI's shape."""
    kind = "chat.completion.chunk" if path == "/chat/completions" else "text_completion.chunk"
    with httpx.stream("POST", f"{live.url}{path}", json=body | {"stream": True}, timeout=60) as answer:
        assert answer.status_code == 200, answer.read()
        chunks = stream_bodies(list(answer.iter_lines()))
    text, reason = "", None
    for chunk in chunks:
        conforms(kind, chunk)
        for choice in chunk["choices"]:
            text += (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
            reason = choice["finish_reason"] or reason
    assert reason is not None
    return text, reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_answer_parses_and_validates(live: LiveServer, stream: bool) -> None:
    c = sdk(live)
    for seed in (1, 2):  # sampled: a different answer each, every one valid
        kwargs: dict[str, Any] = {"model": "m", "messages": CHAT, "response_format": RESPONSE_FORMAT}
        kwargs |= {"temperature": 1.0, "seed": seed}
        if stream:
            parts = list(c.chat.completions.create(**kwargs, stream=True))
            text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
            reason = [p.choices[0].finish_reason for p in parts if p.choices][-1]
        else:
            choice = c.chat.completions.create(**kwargs).choices[0]
            text, reason = choice.message.content or "", choice.finish_reason
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_the_streamed_shaped_answer_is_the_whole_one(live: LiveServer) -> None:
    body = {"model": "m", "messages": CHAT, "response_format": RESPONSE_FORMAT, "temperature": 0}
    whole = httpx.post(f"{live.url}/chat/completions", json=body, timeout=60).json()
    assert streamed(live, "/chat/completions", body) == (whole["choices"][0]["message"]["content"], "stop")
    free = httpx.post(f"{live.url}/chat/completions", json={**body, "response_format": {"type": "text"}}, timeout=60)
    assert free.json()["choices"][0]["message"]["content"] != whole["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_take_response_format_too(live: LiveServer, stream: bool) -> None:
    body = {"model": "m", "prompt": "A llama:", "temperature": 0}
    if stream:
        text, reason = streamed(live, "/completions", body | {"response_format": RESPONSE_FORMAT})
    else:  # the SDK's completions take it as an extra, as vLLM's docs say
        choice = sdk(live).completions.create(**body, extra_body={"response_format": RESPONSE_FORMAT}).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "holds"),
    [
        ({"json_schema": {"enum": ["yes", "no"]}}, lambda t: json.loads(t) in ("yes", "no")),  # llama.cpp's
        ({"grammar": 'root ::= "ab" [0-9] [0-9]'}, lambda t: re.fullmatch(r"ab[0-9]{2}", t)),  # GBNF
        ({"grammar": 'start: "x" ("-" "y")~2'}, lambda t: t == "x-y-y"),  # Lark
        ({"guided_regex": "[a-c]{3}-[0-9]"}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]", t)),  # vLLM's
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"format": {"regex": "(on|off)"}}, lambda t: t in ("on", "off")),  # the plan setting's own shape
        (
            {"response_format": {"type": "json_object", "schema": {"type": "integer", "maximum": 9}}},
            lambda t: int(t) <= 9,
        ),
    ],
    ids=["json_schema", "gbnf", "lark", "guided_regex", "guided_choice", "format", "json_object-schema"],
)
def test_the_extra_shape_fields_are_enforced(live: LiveServer, extra: dict[str, Any], holds: Any) -> None:
    for temperature, seed in ((0, 0), (1.0, 3), (1.0, 4)):
        body = {"model": "m", "messages": CHAT, "temperature": temperature, "seed": seed, **extra}
        answer = httpx.post(f"{live.url}/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and holds(choice["message"]["content"]), choice


def test_a_structured_answer_cut_short_says_length(live: LiveServer) -> None:
    for stream in (False, True):
        long = {"type": "object", "properties": {"s": {"type": "string", "minLength": 60}}, "required": ["s"]}
        rf = {"type": "json_schema", "json_schema": {"name": "long", "schema": long}}
        body = {"model": "m", "messages": CHAT, "response_format": rf, "max_tokens": 6}
        if stream:
            text, reason = streamed(live, "/chat/completions", body)
        else:
            choice = httpx.post(f"{live.url}/chat/completions", json=body, timeout=60).json()["choices"][0]
            text, reason = choice["message"]["content"], choice["finish_reason"]
        assert reason == "length" and text.startswith("{")
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)  # cut short: the finish reason is what tells the client why


def refusal(live: LiveServer, body: dict[str, Any], path: str = "/chat/completions") -> dict[str, Any]:
    before = _generated(live)
    answer = httpx.post(f"{live.url}{path}", json={"model": "m", "messages": CHAT, **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert _generated(live) == before  # refused before any token
    error = answer.json()["error"]
    conforms("error", error)
    return error  # type: ignore[no-any-return]


def _generated(live: LiveServer) -> float:
    metrics = httpx.get(f"{live.base}/metrics", timeout=10).text
    return float(re.search(r"^llmplan_generation_tokens_total (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]


UNENFORCEABLE = [
    ({"type": "array", "uniqueItems": True}, "uniqueItems", "uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {}}}}, "contains", "properties.a.contains"),
    ({"anyOf": [{"type": "integer"}, {"not": {"type": "string"}}]}, "not", "anyOf.1.not"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "if", "if"),
    ({"properties": {"w": {"type": "string", "format": "hostname-ish"}}}, "format", "properties.w.format"),
    ({"properties": {"p": {"type": "string", "pattern": "(?=x)x+"}}}, "pattern (look-around)", "properties.p.pattern"),
    ({"$ref": "https://example.com/schema.json"}, "$ref", "$ref"),
]


@pytest.mark.parametrize(("schema", "keyword", "where"), UNENFORCEABLE, ids=[k for _, k, _ in UNENFORCEABLE])
def test_a_keyword_that_cannot_be_enforced_is_a_400_naming_it(
    live: LiveServer, schema: dict[str, Any], keyword: str, where: str
) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    for stream in (False, True):
        error = refusal(live, {"response_format": rf, "stream": stream})
        assert error["param"] == "response_format"
        assert error["message"].startswith("response_format: ")
        assert f"{keyword!r} at response_format.json_schema.schema.{where} cannot be enforced" in error["message"]
    answer = httpx.post(f"{live.url}/completions", json={"prompt": "x", "json_schema": schema}, timeout=60)
    error = answer.json()["error"]
    assert (
        answer.status_code == 400 and error["param"] == "json_schema" and f"at json_schema.{where}" in error["message"]
    )


def test_the_sdk_sees_the_refusal_as_a_bad_request(live: LiveServer) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(live).chat.completions.create(model="m", messages=CHAT, response_format=rf)  # type: ignore[arg-type]
    assert refused.value.status_code == 400 and refused.value.param == "response_format"
    assert "uniqueItems" in refused.value.message


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"response_format": "json"}, "response_format", "expected an object"),
        ({"response_format": {"type": "jsn"}}, "response_format", "'json_object'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
            "response_format.json_schema.name",
            "must match",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
            "response_format.json_schema.schema",
            "object",
        ),
        ({"grammar": "root ::= undefined_rule"}, "grammar", "'undefined_rule' not found"),
        ({"guided_regex": "(a)\\1"}, "guided_regex", "'backreferences'"),
        ({"format": {"json_schema": "/etc/hosts"}}, "format", "reads no schema files"),
        ({"format": {"json": True, "regex": "a"}}, "format", "exactly one"),
        ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar", "one shape"),
    ],
    ids=[
        "string",
        "type",
        "no-json_schema",
        "no-name",
        "bad-name",
        "schema-list",
        "grammar",
        "regex",
        "file",
        "two-kinds",
        "two-fields",
    ],
)
def test_a_malformed_shape_is_a_400_naming_the_field(
    live: LiveServer, body: dict[str, Any], param: str, says: str
) -> None:
    error = refusal(live, body)
    assert error["param"] == param and says in error["message"], error


def test_a_control_token_spelled_anywhere_is_a_400_before_any_token(live: LiveServer) -> None:
    # The literal spells the tokenizer's own control token: llguidance lets the answer write it only as that
    # token, which its matcher refuses. At the start, and after "a" (once a 500 mid-answer), the compile's
    # rehearsal finds it: a 400 naming the field before any token, and the next request goes on.
    for grammar in ('root ::= "<|user|>x"', 'root ::= "a" "<|user|>x"'):
        error = refusal(live, {"grammar": grammar})
        assert error["param"] == "grammar" and "control token" in error["message"], error
    after = httpx.post(
        f"{live.url}/chat/completions", json={"model": "m", "messages": CHAT, "max_tokens": 3}, timeout=60
    )
    assert after.status_code == 200


def test_the_responses_endpoint_takes_text_format(live: LiveServer) -> None:
    shape = {"format": {"type": "json_schema", "name": "llama", "schema": SCHEMA, "strict": True}}
    answer = sdk(live).responses.create(model="m", input="Describe a llama.", text=shape, temperature=0)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(answer.output_text), SCHEMA)
    bad = {"format": {"type": "json_schema", "name": "s", "schema": {"type": "array", "uniqueItems": True}}}
    refused = httpx.post(f"{live.url}/responses", json={"input": "x", "text": bad}, timeout=60)
    assert refused.status_code == 400 and "'uniqueItems'" in refused.json()["error"]["message"]
