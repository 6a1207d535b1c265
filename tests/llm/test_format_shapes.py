"""Issue 56: a shape that cannot be kept is refused when it is compiled (before any request's first token),
and the JSON a schema asks for is kept as the peers keep it. Each refused case has a benign twin that compiles.

The tokenizer here has SmolLM2's special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) and, like
SmolLM2's, `<|im_end|>` as its end token (tests/pipeline/test_format_end_token.py checks the real one).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from llmplan.llm.sampling import OutputFormat, UnsupportedFormat, compile_format, kept_schema, token_mask
from llmplan.llm.sampling.constrained_format import INTEGER_BOUND

SMOL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def smol_like(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from llmplan.llm.text import Tokenizer
    from tests.stages.tiny_run import SENTENCES, train_byte_bpe

    folder = tmp_path_factory.mktemp("smol-like")
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    train_byte_bpe(folder, SENTENCES * 4 + ["im_end abc 0123456789 {} [] \" : , yes no"] * 8, SMOL_SPECIALS, config)
    tok = Tokenizer.from_dir(folder)
    assert tok.decode([tok.eos_id], skip_special_tokens=False) == "<|im_end|>"
    return tok


def compiled(tok: Any, setting: dict[str, Any]) -> Any:
    fmt = OutputFormat.of(setting)
    assert fmt is not None
    return compile_format(fmt, tok, frozenset([tok.eos_id]), tok.vocab_size)


# (a shape spelling the end token, its benign twin)
END_TOKEN_SHAPES = [
    ({"json_schema": {"const": "<|im_end|>"}}, {"json_schema": {"const": "im_end"}}),
    ({"regex": "abc<\\|im_end\\|>"}, {"regex": "abc"}),
    ({"choice": ["<|im_end|>"]}, {"choice": ["im_end"]}),
    ({"grammar": 'root ::= "<|im_end|>"'}, {"grammar": 'root ::= "im_end"'}),  # GBNF
    ({"grammar": 'start: "yes" "<|im_end|>"'}, {"grammar": 'start: "yes"'}),  # Lark, mid-answer
    ({"choice": ["yes", "no<|im_end|>"]}, {"choice": ["yes", "no"]}),  # one path of two
]


@pytest.mark.parametrize(("spelled", "twin"), END_TOKEN_SHAPES, ids=[str(s)[:40] for s, _ in END_TOKEN_SHAPES])
def test_a_shape_that_spells_the_end_token_is_refused_when_compiled(
    smol_like: Any, spelled: dict[str, Any], twin: dict[str, Any]
) -> None:
    with pytest.raises(UnsupportedFormat) as refused:
        compiled(smol_like, spelled)
    assert "end token" in str(refused.value) and "<|im_end|>" in str(refused.value)
    assert "\n" not in str(refused.value)
    compiled(smol_like, twin)


def test_the_end_token_stays_allowed_where_the_answer_may_end(smol_like: Any) -> None:
    # The mask allows EOS only where the matcher accepts: after "yes", not before.
    mask = token_mask.FormatMask(compiled(smol_like, {"choice": ["yes", "yes sir"]}))
    eos, seen = smol_like.eos_id, []

    class Step:
        prompt_len = 0

        def __init__(self, seen: list[int]) -> None:
            self.seen = seen

    for piece in smol_like.encode("yes", add_bos=False):
        logits = torch.zeros(smol_like.vocab_size)
        mask.apply(logits, Step(seen))  # type: ignore[arg-type]
        assert not torch.isfinite(logits[eos])
        seen = [*seen, piece]
    logits = torch.zeros(smol_like.vocab_size)
    mask.apply(logits, Step(seen))  # type: ignore[arg-type]
    assert torch.isfinite(logits[eos])


ALTERNATIVES = " | ".join(f'"w{i}"' for i in range(20_000))
RECURSIVE = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
# (a shape the matcher cannot hold, its benign twin)
UNHELD_SHAPES = [
    ({"regex": "a{1000000}"}, {"regex": "a{1,100}"}),
    ({"regex": "((a{1,100}){1,100}){1,100}"}, {"regex": "(a{1,10}){1,10}"}),
    ({"grammar": f"root ::= {ALTERNATIVES}"}, {"grammar": 'root ::= "w1" | "w2" | "w3"'}),
    ({"grammar": 'start: a\na: "x" a'}, {"grammar": 'start: a\na: "x" a | "x"'}),
    (
        {"json_schema": RECURSIVE},
        {"json_schema": {"type": "object", "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}}},
    ),
]


@pytest.mark.parametrize(("unheld", "twin"), UNHELD_SHAPES, ids=["a1e6", "nested", "20k-alts", "lark-loop", "ref-loop"])
def test_a_shape_the_matcher_cannot_hold_is_refused_when_compiled(
    smol_like: Any, unheld: dict[str, Any], twin: dict[str, Any]
) -> None:
    start = time.monotonic()
    with pytest.raises(UnsupportedFormat) as refused:
        compiled(smol_like, unheld)
    assert "the matcher cannot hold it" in str(refused.value) and "\n" not in str(refused.value)
    compiled(smol_like, twin)
    assert time.monotonic() - start < 60


# --- the JSON semantics (README: Structured output) -----------------------------------------------------


def _accepts(tok: Any, schema: dict[str, Any], text: str) -> bool:
    matcher = compiled(tok, {"json_schema": schema}).matcher()
    return bool(matcher.consume_tokens(tok.encode(text, add_bos=False)) and matcher.is_accepting())


def test_objects_are_closed_unless_additional_properties_opens_them(smol_like: Any) -> None:
    city = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert _accepts(smol_like, city, '{"name": "a"}')
    assert not _accepts(smol_like, city, '{"name": "a", "x": 1}')
    assert _accepts(smol_like, city | {"additionalProperties": True}, '{"name": "a", "x": 1}')
    merged = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    assert _accepts(smol_like, merged, '{"a": 1, "b": 2}')  # an intersection is not closed part by part
    unlisted = {"properties": {"a": {"type": "string"}}, "required": ["a", "b"]}
    assert kept_schema(unlisted) == unlisted  # "b" could only be written to an open object


def test_integers_and_numbers_are_bounded_in_digits(smol_like: Any) -> None:
    city = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"]}
    assert _accepts(smol_like, city, '{"population": 2019000}')
    assert not _accepts(smol_like, city, '{"population": 20190000000000000000}')  # 20 digits ran to the cap once
    share = {"type": "number", "minimum": 0, "maximum": 1}
    assert _accepts(smol_like, share, "0.25") and not _accepts(smol_like, share, "0." + "3" * 30)
    kept = kept_schema({"type": "integer", "minimum": 1400})
    assert kept == {"type": "integer", "minimum": 1400, "maximum": INTEGER_BOUND}
    assert kept_schema({"enum": [10**20], "type": "integer"}) == {"enum": [10**20], "type": "integer"}


def test_free_whitespace_a_schema_asks_for_is_bounded(smol_like: Any) -> None:
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}, "x-guidance": {"whitespace_flexible": True}}
    assert _accepts(smol_like, loose, '{ "a" : 1 }')
    assert not _accepts(smol_like, loose, "{" + " " * 100 + '"a": 1}')


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"n": {"type": "number"}, "i": {"type": "integer"}}, "required": ["n", "i"]},
        {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}}}},
    ],
)
def test_an_answer_to_the_kept_schema_is_valid_under_the_schema_given(smol_like: Any, schema: dict[str, Any]) -> None:
    # Greedy over random logits, a few seeds: each whole answer validates against the client's own schema.
    from llmplan.llm.sampling import complete

    grammar = compiled(smol_like, {"json_schema": schema})
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        mask, seen = token_mask.FormatMask(grammar), []

        class Step:
            prompt_len = 0

            def __init__(self, seen: list[int]) -> None:
                self.seen = seen

        for _ in range(200):
            logits = torch.randn(smol_like.vocab_size, generator=gen)
            mask.apply(logits, Step(seen))  # type: ignore[arg-type]
            token = int(logits.argmax())
            seen.append(token)
            if token == smol_like.eos_id:
                break
        if seen[-1] == smol_like.eos_id:
            assert complete(grammar, seen)
            jsonschema.validate(json.loads(smol_like.decode(seen[:-1])), schema)


def test_a_format_beside_stop_strings_is_refused_by_the_door() -> None:
    from llmplan.llm.generation.request_runner import stop_beside_format
    from llmplan.llm.sampling import SamplingParams

    fmt = OutputFormat.of({"json": True})
    assert stop_beside_format(SamplingParams(format=fmt, stop=('"',))) is not None
    assert stop_beside_format(SamplingParams(format=fmt)) is None  # the twin: a format alone
    assert stop_beside_format(SamplingParams(stop=('"',))) is None  # stop strings alone


def test_the_compiled_cache_is_per_tokenizer(tmp_path: Path, smol_like: Any) -> None:
    # A refusal is not cached as a success: asked twice, refused twice.
    for _ in range(2):
        with pytest.raises(UnsupportedFormat):
            compiled(smol_like, {"regex": "<\\|im_end\\|>"})
