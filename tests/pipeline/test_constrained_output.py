"""Structured output on the bundled SmolLM2 (int8 plan), asked through `llmplan serve` with the `openai` client.

The proof of issue #26: 55 JSON Schemas (tests/pipeline/data/schema_corpus.py) asked as `response_format`
(`json_schema`, strict) at temperature 0 and 1, the same schemas as a tool's parameters (`tools` with a named
`tool_choice`) at temperature 0, and regexes, choices and Lark / GBNF grammars through the extra fields of
vLLM (`guided_regex`, `guided_choice`, `guided_grammar`) and llama.cpp (`grammar`). Every request is in flight
at once, so the server's engine loop batches them (the scheduler every plan uses). Every answer not cut by
its length limit must parse and validate (`jsonschema`, with its format checker; a regex or grammar answer:
the equivalent Python regex), and most must stop by themselves: the floor is what a grammar that never lets
an answer close would fail.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from llmplan.commands.serve.app import ServerSettings
from tests.commands.conftest import LiveServer

from .conftest import PLANS
from .data.schema_corpus import CORPUS

STOPPED_FLOOR = 0.85  # of the JSON answers, per way of asking, that end by themselves (EOS), not by length
SLOTS = 64
CALL_TOKENS = 16  # a tool call's wrapper around its arguments ({"name": .., "arguments": ..} and the marker)

# (name, question, request fields, max_tokens, the Python regex its answer must match in full)
OTHERS: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("phone", "Give a phone number.", {"guided_regex": "[0-9]{3}-[0-9]{3}-[0-9]{4}"}, 16,
     r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    ("name", "Name a famous scientist.", {"guided_regex": "[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12}){0,2}"}, 16,
     r"[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12}){0,2}"),
    ("time", "What time is it?", {"guided_regex": "([01][0-9]|2[0-3]):[0-5][0-9]"}, 8, r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("sentiment", "Is 'I love it' positive or negative?", {"guided_choice": ["positive", "negative", "neutral"]}, 8,
     "positive|negative|neutral"),
    ("capital", "What is the capital of France?", {"guided_choice": ["Paris", "London", "Berlin", "Madrid"]}, 8,
     "Paris|London|Berlin|Madrid"),
    ("sum_lark", "Write a sum of two small numbers.",
     {"guided_grammar": 'start: n " + " n " = " n\nn: /[0-9]{1,3}/'}, 20, r"[0-9]{1,3} \+ [0-9]{1,3} = [0-9]{1,3}"),
    ("list_lark", "List some animals, comma separated.",
     {"guided_grammar": 'start: w (", " w)~0..3\nw: /[a-z]{2,10}/'}, 32, r"[a-z]{2,10}(, [a-z]{2,10}){0,3}"),
    ("answer_gbnf", "How many legs does a dog have?",
     {"grammar": 'root ::= "The answer is " [0-9] [0-9]? "."'}, 12, r"The answer is [0-9][0-9]?\."),
]  # fmt: skip


@dataclass
class Ask:
    name: str
    way: str  # "response_format", "tools" or "extra"
    temperature: float
    request: dict[str, Any]
    check: Callable[[str], None]  # raises when the answer's text is not of its shape
    finish: str = ""
    text: str = ""


def _asks() -> list[Ask]:
    asks = []
    for temperature in (0.0, 1.0):
        for index, (name, question, schema, budget) in enumerate(CORPUS):
            shape = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
            request = _chat(f"{question} Answer in JSON.", budget, temperature, index) | {"response_format": shape}
            asks.append(Ask(name, "response_format", temperature, request, _validator(schema)))
        for index, (name, question, fields, budget, pattern) in enumerate(OTHERS):
            check = lambda text, p=pattern: None if re.fullmatch(p, text) else _fail(f"{text!r} !~ {p}")  # noqa: E731
            asks.append(Ask(name, "extra", temperature, _chat(question, budget, temperature, index) | fields, check))
    for index, (name, question, schema, budget) in enumerate(CORPUS):
        if schema.get("type") != "object":
            continue  # a function's parameters are an object
        tool = {"type": "function", "function": {"name": name, "description": question, "parameters": schema}}
        request = _chat(question, budget + CALL_TOKENS, 0.0, index) | {
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": name}},
        }
        asks.append(Ask(name, "tools", 0.0, request, _validator(schema)))
    return asks


def _chat(question: str, budget: int, temperature: float, seed: int) -> dict[str, Any]:
    return {
        "model": "llama-int8",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": budget,
        "temperature": temperature,
        "seed": seed,
    }


def _validator(schema: dict[str, Any]) -> Callable[[str], None]:
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return lambda text: validator.validate(json.loads(text))


def _fail(message: str) -> None:
    raise AssertionError(message)


@pytest.fixture(scope="module")
def answered(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[list[Ask], int]:
    """Every ask sent at once; each filled with its finish reason and text (a tool call: its arguments), and
    the most requests the server's engine loop ran in one step."""
    tmp = tmp_path_factory.mktemp("constrained")
    overrides = [
        f"place.max_batch={SLOTS}",
        "place.kv_cache.max_tokens=512",
        "lookup.mode=off",
        f"store.db={tmp / 'results.sqlite'}",
        "write.to=[terminal]",
    ]
    asks = _asks()
    with LiveServer(PLANS / "llama-int8.yaml", ServerSettings(access_log=None), overrides, tmp / "run") as live:
        client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=600)

        def send(ask: Ask) -> None:
            body = dict(ask.request)
            extra = {k: body.pop(k) for k in ("guided_regex", "guided_choice", "guided_grammar", "grammar") if k in body}
            choice = client.chat.completions.create(**body, extra_body=extra or None).choices[0]
            ask.finish = choice.finish_reason
            calls = choice.message.tool_calls or []
            if ask.way == "tools" and calls:
                assert [c.function.name for c in calls] == [ask.name]  # type: ignore[union-attr]
                ask.text = calls[0].function.arguments  # type: ignore[union-attr]
            else:
                ask.text = choice.message.content or ""

        with ThreadPoolExecutor(SLOTS) as pool:  # the server takes as many requests as it has slots in flight
            list(pool.map(send, asks))
        busiest = live.host.scheduler.stats.busy_max
    return asks, busiest


def test_the_corpus_is_the_size_and_variety_the_issue_asks() -> None:
    assert len(CORPUS) >= 50 and len({name for name, *_ in CORPUS}) == len(CORPUS)
    text = json.dumps([schema for _, _, schema, _ in CORPUS])
    for keyword in ('"minItems"', '"maxItems"', '"enum"', '"pattern"', '"minimum"', '"anyOf"', '"$ref"',
                    '"additionalProperties": false', '"format"', '"prefixItems"'):  # fmt: skip
        assert keyword in text, keyword


def test_the_requests_were_batched(answered: tuple[list[Ask], int]) -> None:
    # (nearly) every slot busy at once: the answers below share decode steps. Not exactly SLOTS: a choice answer
    # can end in a few steps, before the 64th of the first requests is admitted (63 seen once in a clean CI run).
    assert SLOTS - 4 <= answered[1] <= SLOTS


WAYS = [("response_format", 0.0), ("response_format", 1.0), ("extra", 0.0), ("extra", 1.0), ("tools", 0.0)]


@pytest.mark.parametrize(("way", "temperature"), WAYS)
def test_every_answer_not_cut_by_length_obeys_its_format(
    answered: tuple[list[Ask], int], way: str, temperature: float
) -> None:
    mine = [a for a in answered[0] if a.way == way and a.temperature == temperature]
    assert mine
    expected = "tool_calls" if way == "tools" else "stop"
    bad = []
    for ask in mine:
        assert ask.finish in (expected, "length"), (ask.name, ask.finish, ask.text)
        if ask.finish == "length":
            continue
        try:
            ask.check(ask.text)
        except (AssertionError, ValueError, jsonschema.ValidationError) as wrong:
            bad.append(f"{ask.name}: {ask.text!r}: {str(wrong).splitlines()[0]}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("way", "temperature"), WAYS)
def test_most_answers_stop_by_themselves(answered: tuple[list[Ask], int], way: str, temperature: float) -> None:
    mine = [a for a in answered[0] if a.way == way and a.temperature == temperature]
    stopped = [a for a in mine if a.finish != "length"]
    print(f"{way} at temperature {temperature}: {len(stopped)}/{len(mine)} answers stopped by themselves")
    if way == "extra":  # short shapes: every one closes well inside its budget
        assert stopped == mine, [(a.name, a.text) for a in mine if a not in stopped]
        return
    cut = [f"{a.name}: {a.text!r}" for a in mine if a not in stopped]
    assert len(stopped) >= STOPPED_FLOOR * len(mine), f"{len(stopped)}/{len(mine)} stopped; cut:\n" + "\n".join(cut)
