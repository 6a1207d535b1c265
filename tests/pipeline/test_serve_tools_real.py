"""`llmplan serve` on the bundled SmolLM2 (fp32, greedy): structured answers whose content matters.

SmolLM2's template knows no tools, so the server describes them in the system turn and holds the answer to
their format (commands/serve/tool_calls.py): asked for the weather in Paris with a weather and a time tool, the
model calls the weather tool for Paris. `json_object` answers parse, and a schema's answer validates,
streamed or not. (Protocol cases, refusals and the many shapes: tests/commands/test_serve_structured.py and
test_serve_tools.py, on the tiny model.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from .conftest import served_fp32_client

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city name"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the current time in a timezone",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
        },
    },
]
PARIS = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
CAT = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 40}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[openai.OpenAI]:
    with served_fp32_client(tmp_path_factory.mktemp("serve-tools"), 120) as client:
        yield client


def test_the_weather_question_calls_the_weather_tool_for_paris(client: openai.OpenAI) -> None:
    ask = {"model": "llama-fp32", "messages": PARIS, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    arguments = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, WEATHER)
    assert arguments["city"] == "Paris"
    joined: dict[int, list[str]] = {}
    fragments = 0
    for chunk in client.chat.completions.create(**ask, stream=True):
        for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            got = joined.setdefault(part.index, ["", ""])
            got[0] += (part.function.name or "") if part.function else ""
            got[1] += (part.function.arguments or "") if part.function else ""
            fragments += bool(part.function and part.function.arguments)
    assert list(joined.values()) == [["get_weather", calls[0].function.arguments]]  # type: ignore[union-attr]
    assert fragments > 2  # the arguments came as they were generated, not whole at the end


def test_json_object_and_json_schema_answers_parse(client: openai.OpenAI) -> None:
    cat = [{"role": "user", "content": "Give me a JSON object describing a cat with a name and an age."}]
    base = {"model": "llama-fp32", "messages": cat, "temperature": 0}
    answer = client.chat.completions.create(**base, response_format={"type": "json_object"}).choices[0]
    assert answer.finish_reason == "stop" and isinstance(json.loads(answer.message.content or ""), dict)
    rf: Any = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT, "strict": True}}
    whole = client.chat.completions.create(**base, response_format=rf).choices[0].message.content or ""
    jsonschema.validate(json.loads(whole), CAT)
    parts = client.chat.completions.create(**base, response_format=rf, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == whole
