"""Issue 56 through the server: an answer that claims success holds its shape, and a shape that cannot be kept
is a 400 naming its field before any token, streamed or not (one tiny-model server for the module).

The tiny model's end token is `</s>` (SmolLM2's is `<|im_end|>`: tests/llm/test_format_shapes.py and
tests/pipeline/test_format_end_token.py). Each refused case has a benign twin that still answers, and every 200
whose finish is `stop` or `tool_calls` parses and validates.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from llmplan.commands.serve.app import ServerSettings

from .conftest import LiveServer, write_serve_plan
from .openai_shapes import conforms
from .test_serve_structured import streamed
from .test_serve_tools import TOOLS, ask_streamed

CHAT = [{"role": "user", "content": "Describe a llama."}]


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("shapes")
    model_dir = root / "tiny-shapes"  # a longer context: the tools' description is a long prompt here
    shutil.copytree(tiny_model, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 2048}))
    plan = write_serve_plan(root, model_dir, context=1024, max_new_tokens=120)
    with LiveServer(plan, ServerSettings(max_queue=16, access_log=None)) as server:
        yield server


def _generated(live: LiveServer) -> float:
    metrics = httpx.get(f"{live.base}/metrics", timeout=10).text
    return float(re.search(r"^llmplan_generation_tokens_total (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]


def refused(live: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A 400 before any token, streamed or not, its message one line; the error object."""
    start, before = time.monotonic(), _generated(live)
    errors = []
    for stream in (False, True):
        answer = httpx.post(f"{live.url}{path}", json={"model": "m", **body, "stream": stream}, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        conforms("error", error)
        assert "\n" not in error["message"], error
        errors.append(error)
    assert _generated(live) == before  # refused before any token
    assert errors[0] == errors[1] and time.monotonic() - start < 60
    return errors[0]  # type: ignore[no-any-return]


def answered(live: LiveServer, path: str, body: dict[str, Any]) -> list[tuple[str, str]]:
    """(text, finish reason), whole then streamed: the same answer both ways (greedy)."""
    whole = httpx.post(f"{live.url}{path}", json={"model": "m", **body, "temperature": 0}, timeout=60)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    both = [(text, choice["finish_reason"]), streamed(live, path, {"model": "m", **body, "temperature": 0})]
    assert both[0] == both[1]
    return both


END_TOKEN = [
    ("guided_json", {"const": "</s>"}, {"const": "s"}, lambda t: json.loads(t) == "s"),
    ("guided_regex", "abc</s>", "abc", lambda t: t == "abc"),
    ("guided_choice", ["</s>"], ["s"], lambda t: t == "s"),
    ("guided_choice", ["yes", "no</s>"], ["yes", "no"], lambda t: t in ("yes", "no")),
    ("grammar", 'root ::= "</s>"', 'root ::= "s"', lambda t: t == "s"),
    ("format", {"regex": "</s>"}, {"regex": "s"}, lambda t: t == "s"),
]


@pytest.mark.parametrize(("field", "spelled", "twin", "holds"), END_TOKEN, ids=[str(c[1])[:24] for c in END_TOKEN])
@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_a_shape_that_spells_the_end_token_is_a_400_naming_its_field(
    live: LiveServer, path: str, field: str, spelled: Any, twin: Any, holds: Any
) -> None:
    prompt: dict[str, Any] = {"messages": CHAT} if path == "/chat/completions" else {"prompt": "A llama:"}
    error = refused(live, path, prompt | {field: spelled})
    assert error["param"] == field and "end token" in error["message"] and "</s>" in error["message"], error
    for text, reason in answered(live, path, prompt | {field: twin}):
        assert reason == "stop" and holds(text), text


ALTERNATIVES = " | ".join(f'"w{i}"' for i in range(20_000))
RECURSIVE = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
UNHELD = [
    ("guided_regex", "a{1000000}", "a{1,5}", lambda t: re.fullmatch("a{1,5}", t)),
    ("guided_regex", "((a{1,100}){1,100}){1,100}", "((a{1,2}){1,2}){1,2}", lambda t: re.fullmatch("a{1,8}", t)),
    ("grammar", f"root ::= {ALTERNATIVES}", 'root ::= "w1" | "w2"', lambda t: t in ("w1", "w2")),
    ("grammar", 'start: a\na: "x" a', 'start: a\na: "x" a | "x"', lambda t: re.fullmatch("x+", t)),
    (
        "guided_json",
        RECURSIVE,
        {"type": "object", "properties": {"next": {"type": "null"}}, "required": ["next"]},
        lambda t: json.loads(t) == {"next": None},
    ),
]


@pytest.mark.parametrize(
    ("field", "unheld", "twin", "holds"), UNHELD, ids=["a1e6", "nested", "20k-alts", "lark-loop", "ref-loop"]
)
def test_a_shape_the_matcher_cannot_hold_is_a_400_before_any_token(
    live: LiveServer, field: str, unheld: Any, twin: Any, holds: Any
) -> None:
    error = refused(live, "/chat/completions", {"messages": CHAT, field: unheld})
    assert error["param"] == field and "the matcher cannot hold it" in error["message"], error
    for text, reason in answered(live, "/chat/completions", {"messages": CHAT, field: twin}):
        assert reason in ("stop", "length") and (reason == "length" or holds(text)), text


CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "population": {"type": "integer"}},
    "required": ["name", "population"],
}


def test_a_schema_answer_is_closed_and_bounded_as_the_peers_keep_it(live: LiveServer) -> None:
    # No additionalProperties, an integer with no bounds: once a key of noise or a 60-digit integer ran to the
    # length cap. Sampled, several seeds: every answer that stops parses, validates, is closed and bounded.
    for seed in range(4):
        body = {"messages": CHAT, "guided_json": CITY, "temperature": 1.0, "seed": seed, "max_tokens": 120}
        answer = httpx.post(f"{live.url}/chat/completions", json={"model": "m", **body}, timeout=60).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        made = json.loads(choice["message"]["content"])
        jsonschema.validate(made, CITY | {"additionalProperties": False})
        assert len(str(abs(made["population"]))) <= 16


def test_stop_beside_a_shape_is_a_400_naming_stop(live: LiveServer) -> None:
    error = refused(live, "/chat/completions", {"messages": CHAT, "guided_json": CITY, "stop": ['"']})
    assert error["param"] == "stop", error
    error = refused(live, "/completions", {"prompt": "A llama:", "guided_regex": "[a-c]{3}", "stop": "b"})
    assert error["param"] == "stop", error
    # the twins: stop alone, the shape alone
    text, reason = answered(live, "/chat/completions", {"messages": CHAT, "stop": ["e"], "max_tokens": 20})[0]
    assert "e" not in text and reason in ("stop", "length")
    text, reason = answered(live, "/completions", {"prompt": "A llama:", "guided_regex": "[a-c]{3}"})[0]
    assert reason == "stop" and re.fullmatch("[a-c]{3}", text)


OPEN_PARAMETERS = {  # no additionalProperties: closed by default, so no key of noise and no key twice
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 5}, "days": {"type": "integer", "maximum": 9}},
    "required": ["city"],
}


def test_tool_arguments_hold_their_parameters_streamed_equal_to_whole(live: LiveServer) -> None:
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": OPEN_PARAMETERS}}, TOOLS[2]]
    called = 0
    for seed in range(3):
        body = {"messages": CHAT, "tools": tools, "tool_choice": "required", "temperature": 1.0, "seed": seed}
        whole = httpx.post(f"{live.url}/chat/completions", json={"model": "m", **body}, timeout=60).json()
        choice = whole["choices"][0]
        if choice["finish_reason"] != "tool_calls":
            assert choice["finish_reason"] == "length"
            continue
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
        assert len(set(calls)) == len(calls)  # never a repeated call
        for name, arguments in calls:
            schema = OPEN_PARAMETERS if name == "forecast" else {"type": "object", "maxProperties": 0}
            jsonschema.validate(json.loads(arguments), schema | {"additionalProperties": False})
        _, streamed_calls, reason = ask_streamed(live, **body)
        assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in streamed_calls] == calls
        called += 1
    assert called
