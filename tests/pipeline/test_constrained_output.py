"""Structured output on the bundled SmolLM2 (int8 plan): every answer under a format obeys it.

The proof of issue #26: 55 JSON Schemas (tests/pipeline/data/schema_corpus.py), regexes, choices and Lark / GBNF
grammars, each asked at temperature 0 and 1, all rows batched through the engine loop at once (the scheduler
the plan uses). Every answer not stopped by its length limit must parse and validate (`jsonschema`, with its
format checker; a regex or grammar answer: the equivalent Python regex), and most must stop by themselves:
the floor below is what a grammar that never lets the answer close would fail.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llmplan.llm.engine_loop import EngineLoop
from llmplan.llm.output_format import OutputFormat, compile_format
from llmplan.llm.sampling import build_picker
from llmplan.llm.sampling_params import SamplingParams
from llmplan.llm.scheduler import GenerationRequest, Sequence
from llmplan.llm.slot_cache import SlotCache
from llmplan.llm.tokenizer import Tokenizer

from .conftest import PLANS, run_plan
from .data.schema_corpus import CORPUS

STOPPED_FLOOR = 0.85  # of the JSON answers, at each temperature, that end by themselves (EOS), not by length
SLOTS = 128  # every row at once: one wave of decode steps
CONTEXT = 160

# (name, question, format, max_new_tokens, the Python regex its answer must match in full)
OTHERS: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("phone", "Give a phone number.", {"regex": "[0-9]{3}-[0-9]{3}-[0-9]{4}"}, 16, r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    ("name", "Name a famous scientist.", {"regex": "[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12}){0,2}"}, 16,
     r"[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12}){0,2}"),
    ("time", "What time is it?", {"regex": "([01][0-9]|2[0-3]):[0-5][0-9]"}, 8, r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("sentiment", "Is 'I love it' positive or negative?", {"choice": ["positive", "negative", "neutral"]}, 8,
     "positive|negative|neutral"),
    ("capital", "What is the capital of France?", {"choice": ["Paris", "London", "Berlin", "Madrid"]}, 8,
     "Paris|London|Berlin|Madrid"),
    ("sum_lark", "Write a sum of two small numbers.",
     {"grammar": 'start: n " + " n " = " n\nn: /[0-9]{1,3}/'}, 20, r"[0-9]{1,3} \+ [0-9]{1,3} = [0-9]{1,3}"),
    ("list_lark", "List some animals, comma separated.",
     {"grammar": 'start: w (", " w)~0..3\nw: /[a-z]{2,10}/'}, 32, r"[a-z]{2,10}(, [a-z]{2,10}){0,3}"),
    ("answer_gbnf", "How many legs does a dog have?",
     {"grammar": 'root ::= "The answer is " [0-9] [0-9]? "."'}, 12, r"The answer is [0-9][0-9]?\."),
]


@dataclass
class Row:
    name: str
    temperature: float
    fmt: OutputFormat
    check: Any  # text -> None, or raises
    seq: Sequence


@pytest.fixture(scope="module")
def rows(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Row]:
    placed = run_plan(PLANS / "llama-int8.yaml", tmp_path_factory.mktemp("int8"), until="place")
    assert placed.exit_code == 0, placed.message
    ctx = placed.context
    tok, cfg, model = Tokenizer.from_dir(smollm2_dir), ctx.model_config, ctx.model
    eos = frozenset(set(cfg.eos_token_ids) | ({tok.eos_id} if tok.eos_id is not None else set()))
    asks: list[tuple[str, str, OutputFormat, int, Any]] = []
    for name, question, schema, budget in CORPUS:
        validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
        check = lambda text, v=validator: v.validate(json.loads(text))  # noqa: E731
        asks.append((name, f"{question} Answer in JSON.", OutputFormat.from_json_schema(schema), budget, check))
    for name, question, setting, budget, pattern in OTHERS:
        check = lambda text, p=pattern: None if re.fullmatch(p, text) else _fail(f"{text!r} !~ {p}")  # noqa: E731
        fmt = OutputFormat.of(setting)
        assert fmt is not None
        asks.append((name, question, fmt, budget, check))
    loop = EngineLoop.for_model(model, SlotCache.for_model(model, SLOTS, CONTEXT), max_running=SLOTS)
    out = []
    for temperature in (0.0, 1.0):
        for index, (name, question, fmt, budget, check) in enumerate(asks):
            _, prompt = tok.encode_chat([{"role": "user", "content": question}])
            compiled = compile_format(fmt, tok, eos, cfg.vocab_size)
            params = SamplingParams.trusted(temperature=temperature, seed=index, grammar=compiled)
            request = GenerationRequest(prompt, build_picker(params, len(prompt)), budget, eos_ids=eos, tag=name)
            out.append(Row(name, temperature, fmt, check, loop.submit(request)))
    loop.run()
    for row in out:
        row.text = tok.decode(row.seq.generation.tokens, skip_special_tokens=True)  # type: ignore[attr-defined]
    return out


def _fail(message: str) -> None:
    raise AssertionError(message)


def test_the_corpus_is_the_size_and_variety_the_issue_asks() -> None:
    assert len(CORPUS) >= 50 and len({name for name, *_ in CORPUS}) == len(CORPUS)
    text = json.dumps([schema for _, _, schema, _ in CORPUS])
    for keyword in ('"minItems"', '"maxItems"', '"enum"', '"pattern"', '"minimum"', '"anyOf"', '"$ref"',
                    '"additionalProperties": false', '"format"', '"prefixItems"'):
        assert keyword in text, keyword


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_not_cut_by_length_obeys_its_format(rows: list[Row], temperature: float) -> None:
    mine = [row for row in rows if row.temperature == temperature]
    bad = []
    for row in mine:
        gen = row.seq.generation
        assert gen.finish_reason in ("eos", "length"), (row.name, gen.finish_reason, gen.error)
        if gen.finish_reason == "length":
            continue
        try:
            row.check(row.text)  # type: ignore[attr-defined]
        except (AssertionError, ValueError, jsonschema.ValidationError) as wrong:
            bad.append(f"{row.name}: {row.text!r}: {str(wrong).splitlines()[0]}")  # type: ignore[attr-defined]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_most_answers_stop_by_themselves(rows: list[Row], temperature: float) -> None:
    shaped = [r for r in rows if r.temperature == temperature and r.fmt.kind == "json_schema"]
    stopped = [r for r in shaped if r.seq.generation.finish_reason == "eos"]
    cut = [f"{r.name}: {r.text!r}" for r in shaped if r not in stopped]  # type: ignore[attr-defined]
    print(f"temperature {temperature}: {len(stopped)}/{len(shaped)} JSON answers stopped by themselves")
    assert len(stopped) >= STOPPED_FLOOR * len(shaped), f"{len(stopped)}/{len(shaped)} stopped; cut:\n" + "\n".join(cut)
    others = [r for r in rows if r.temperature == temperature and r.fmt.kind != "json_schema"]
    assert all(r.seq.generation.finish_reason == "eos" for r in others), [(r.name, r.text) for r in others]  # type: ignore[attr-defined]
