"""A format on every path that picks a token, on the tiny random Llama: batched rows each under their own
grammar, and speculative decoding (its guesses verified under the mask) giving the plain answers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.pipeline.conftest import run_plan
from tests.stages.tiny_run import make_tiny_model_dir, write_plan

WORDS = "(hello |model |tokens ){4,12}"
ROWS = {  # id -> (format, does the answer obey it)
    "digits": ({"regex": "[0-9]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[0-9]{2}", t) is not None),
    "words": ({"regex": WORDS}, lambda t: re.fullmatch(WORDS, t) is not None),
    "pick": ({"choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    "object": (
        {"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
        lambda t: isinstance(json.loads(t)["n"], int),
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))[0]


def run(tmp_path: Path, model_dir: Path, lines: list[dict], overrides: list[str], **generate):  # type: ignore[no-untyped-def]
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    plan = write_plan(tmp_path, model_dir, generate={"ignore_eos": False, "max_new_tokens": 40, **generate})
    given = [f"prompt.prompts_file={prompts}", "prompt.messages=null", "place.max_batch=4", *overrides]
    result = run_plan(plan, tmp_path / "run", given, until="generate")
    assert result.exit_code == 0, result.message
    return result


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_rows_each_obey_their_own_format(tmp_path: Path, model_dir: Path, temperature: float) -> None:
    lines = [{"id": name, "text": "Hello model", "format": fmt} for name, (fmt, _) in ROWS.items()]
    lines.append({"id": "free", "text": "Hello model", "max_new_tokens": 8})  # one free row beside them
    result = run(tmp_path, model_dir, lines, [], temperature=temperature, batch_size=5)
    tok = result.context.tokenizer
    assert result.context.metrics.get("generate", "scheduler")["busy_max"] > 1  # the rows ran together
    for gen in result.context.generations:
        if gen.request_id == "free":
            assert gen.finish_detail == "length"
            continue
        text = tok.decode(gen.tokens, skip_special_tokens=True)
        assert gen.finish_detail == "eos", (gen.request_id, text)
        assert ROWS[gen.request_id][1](text), (gen.request_id, text)


def test_speculation_under_a_format_gives_the_plain_answers(tmp_path: Path, model_dir: Path) -> None:
    # Prompts that quote the grammar's words: prompt lookup guesses them, and the mask verifies every guess.
    lines = [
        {"id": f"r{i}", "text": text, "format": {"regex": WORDS}}
        for i, text in enumerate(["hello model tokens hello model tokens", "model model hello model model", "Hi"])
    ]
    plain = run(tmp_path / "plain", model_dir, lines, [])
    spec = run(tmp_path / "spec", model_dir, lines, [], speculative={"tokens": 4, "ngram": 2})
    tok = plain.context.tokenizer
    for want, got in zip(plain.context.generations, spec.context.generations, strict=True):
        assert got.tokens == want.tokens and got.finish_detail == want.finish_detail == "eos"
        assert re.fullmatch(WORDS, tok.decode(got.tokens, skip_special_tokens=True))
    guesses = [g.generation.accepted for g in spec.context.generations]
    assert sum(guesses) > 0, "no guess was accepted: the speculative path under the mask did not run"


def test_the_result_records_the_format_and_says_when_the_limit_cut_it_short(tmp_path: Path, model_dir: Path) -> None:
    from llmplan.llm.sampling import OutputFormat
    from llmplan.stages.completion_rendering import result_object, stats_text

    fmt, _ = ROWS["object"]
    lines = [
        {"id": "whole", "text": "Hello model", "format": fmt},
        {"id": "cut", "text": "Hello model", "format": fmt, "max_new_tokens": 3},
        {"id": "free", "text": "Hello model", "max_new_tokens": 3},
    ]
    whole, cut, free = run(tmp_path, model_dir, lines, []).context.generations
    record = OutputFormat.of(fmt).record()
    assert whole.finish_detail == "eos" and result_object(whole)["format"] == {**record, "complete": True}
    assert record["summary"] == "object {n}"
    assert cut.finish_reason == "length" and result_object(cut)["format"] == {**record, "complete": False}
    assert "finish length (the json_schema answer was cut short: it may not parse)" in stats_text(cut)
    assert result_object(free)["format"] is None and free.mask_allowed is None
    # per step, how many tokens the mask allowed: all of them nowhere, one (the closing "}" or EOS) at the end
    assert len(whole.mask_allowed) == len(whole.tokens) and whole.mask_allowed[-1] <= 2
    assert max(whole.mask_allowed) < 420
