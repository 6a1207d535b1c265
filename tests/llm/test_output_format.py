"""The `format` setting without a model: what is refused (and where), the plan's finding, the mask kernel.

The answers of the bundled model under a format (the schema corpus, regex, choice, grammar, beams,
speculation) are tested in tests/pipeline/test_constrained_output.py, beside the session's SmolLM2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llmplan.engine.findings import PlanError
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover
from llmplan.llm.kernels import native
from llmplan.llm.sampling import OutputFormat, SamplingParams, UnsupportedFormat, token_mask

REPO = Path(__file__).resolve().parents[2]

# (schema, the keyword refused, its JSON path)
REFUSED_SCHEMAS: list[tuple[Any, str, tuple[Any, ...]]] = [
    ({"type": "array", "uniqueItems": True}, "uniqueItems", ("uniqueItems",)),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {}}}}, "contains", ("properties", "a", "contains")),
    ({"anyOf": [{"type": "integer"}, {"not": {"type": "string"}}]}, "not", ("anyOf", 1, "not")),
    ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "if", ("if",)),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", ("dependentRequired",)),
    ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties", ("unevaluatedProperties",)),
    ({"type": "object", "propertyNames": {"maxLength": 2}}, "propertyNames", ("propertyNames",)),
    ({"properties": {"when": {"type": "string", "format": "hostname-ish"}}}, "format", ("properties", "when", "format")),
    ({"properties": {"p": {"type": "string", "pattern": "(?=x)x+"}}}, "pattern (look-around)", ("properties", "p", "pattern")),
    ({"$ref": "https://example.com/schema.json"}, "$ref", ("$ref",)),
]


@pytest.mark.parametrize(("schema", "keyword", "path"), REFUSED_SCHEMAS)
def test_a_keyword_llguidance_cannot_enforce_is_refused_by_name_and_place(
    schema: Any, keyword: str, path: tuple[Any, ...]
) -> None:
    fmt = OutputFormat.from_json_schema(schema)
    with pytest.raises(UnsupportedFormat) as refused:
        fmt.check()
    assert refused.value.keyword == keyword
    assert refused.value.path == path
    assert refused.value.field_path == ("json_schema", *path)
    assert repr(keyword) in str(refused.value)


@pytest.mark.parametrize(
    ("setting", "construct"),
    [({"regex": "a(?=b)"}, "look-around"), ({"regex": "(a)\\1"}, "backreferences"), ({"grammar": "start: x"}, "grammar")],
)
def test_regex_and_grammar_constructs_are_refused(setting: dict[str, str], construct: str) -> None:
    fmt = OutputFormat.of(setting)
    assert fmt is not None
    with pytest.raises(UnsupportedFormat) as refused:
        fmt.check()
    assert refused.value.keyword == construct


@pytest.mark.parametrize(
    "setting",
    [
        {"json": True},
        {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "integer"}}}},
        {"json_schema": {"anyOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"type": "number", "maximum": 3}]}},
        {"regex": "[0-9]{3}-[0-9]{4}"},
        {"grammar": 'root ::= "yes" | "no"'},  # GBNF
        {"grammar": 'start: "a" b\nb: "b"+'},  # Lark
        {"choice": ["left", "right"]},
    ],
)
def test_enforceable_formats_pass_the_check(setting: dict[str, Any]) -> None:
    fmt = OutputFormat.of(setting)
    assert fmt is not None
    fmt.check()
    assert fmt.setting() == setting
    assert fmt.record() == {"kind": next(iter(setting)), "sha256": fmt.sha256, "summary": fmt.summary()}


def test_the_library_refuses_what_cannot_be_enforced() -> None:
    with pytest.raises(UnsupportedFormat, match="uniqueItems"):
        SamplingParams(format={"json_schema": {"type": "array", "uniqueItems": True}})


def test_the_hash_tells_schemas_apart_and_keeps_key_order() -> None:
    a = OutputFormat.from_json_schema({"properties": {"x": {}, "y": {}}})
    b = OutputFormat.from_json_schema({"properties": {"y": {}, "x": {}}})
    assert a.sha256 != b.sha256  # the order of properties is the order of the answer's keys
    assert list(json.loads(b.spec)["properties"]) == ["y", "x"]


def _plan_with_format(tmp_path: Path, format_yaml: str) -> Path:
    text = (REPO / "plans" / "llama-int8.yaml").read_text()
    old = "    with: {temperature: 0.7, top_p: 0.9, repetition_penalty: 1.1}"
    assert old in text
    plan = tmp_path / "plan.yaml"
    plan.write_text(text.replace(old, "    with:\n      max_new_tokens: 32\n      format:\n" + format_yaml))
    return plan


def test_validate_names_the_keyword_at_its_line_and_column(tmp_path: Path) -> None:
    plan = _plan_with_format(
        tmp_path,
        "        json_schema:\n"
        "          type: object\n"
        "          properties:\n"
        "            tags: {type: array, uniqueItems: true}\n",
    )
    with pytest.raises(PlanError) as bad:
        load_plan(plan, discover())
    (finding,) = bad.value.findings
    lines = plan.read_text().splitlines()
    assert "uniqueItems" in lines[finding.line - 1][finding.column - 1 :].split(":")[0]
    assert finding.field.endswith("format.json_schema.properties.tags.uniqueItems")
    assert "'uniqueItems'" in finding.message


def test_a_schema_file_is_read_relative_to_the_plan_and_recorded_inline(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (tmp_path / "answer.schema.json").write_text(json.dumps(schema))
    plan = _plan_with_format(tmp_path, "        json_schema: answer.schema.json\n")
    bound = load_plan(plan, discover())
    params = bound.stage("generate").params
    assert params.format.value == OutputFormat.from_json_schema(schema)
    assert params.model_dump()["format"] == {"json_schema": schema}


def test_a_missing_schema_file_is_one_finding(tmp_path: Path) -> None:
    plan = _plan_with_format(tmp_path, "        json_schema: nowhere.json\n")
    with pytest.raises(PlanError) as bad:
        load_plan(plan, discover())
    assert "nowhere.json" in str(bad.value)
    assert "Traceback" not in str(bad.value)


def _bits(allowed: np.ndarray) -> torch.Tensor:
    words = (len(allowed) + 31) // 32
    packed = np.packbits(np.pad(allowed, (0, words * 32 - len(allowed))).astype(np.uint8), bitorder="little")
    return torch.from_numpy(packed.view(np.int32).copy())


@pytest.mark.parametrize("vocab", [64, 49152, 49155])
def test_the_native_mask_matches_the_unpacked_bits(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(vocab)
    allowed = rng.random(vocab) < 0.1
    allowed[:32] = True  # a full word, the fast path
    allowed[32:64] = False  # an empty word
    logits = torch.randn(vocab)
    bits = _bits(allowed)
    expected = torch.where(torch.from_numpy(allowed), logits, torch.tensor(-torch.inf))
    if native.kernels() is not None:
        out = logits.clone()
        assert native.kernels().apply_token_bitmask(out, bits) == int(allowed.sum())
        assert torch.equal(out, expected)
    monkeypatch.setattr(native, "kernels", lambda: None)  # the numpy fallback
    out = logits.clone()
    assert token_mask.apply_bitmask(out, bits) == int(allowed.sum())
    assert torch.equal(out, expected)


# --- control tokens: llguidance's mask allows one where a literal spells its text; its matcher refuses it


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from llmplan.llm.text import Tokenizer
    from tests.stages.tiny_run import make_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return Tokenizer.from_dir(folder)


def _compiled(tok: Any, grammar: str) -> Any:
    from llmplan.llm.sampling import compile_format

    return compile_format(OutputFormat("grammar", grammar), tok, frozenset([tok.eos_id]), tok.vocab_size)


class _Step:
    prompt_len = 0

    def __init__(self, seen: list[int]) -> None:
        self.seen = seen


def test_a_literal_that_spells_a_control_token_is_refused_when_compiled(tiny_tokenizer: Any) -> None:
    user = tiny_tokenizer.token_to_id("<|user|>")
    assert user in tiny_tokenizer.special_ids
    with pytest.raises(UnsupportedFormat) as refused:
        _compiled(tiny_tokenizer, 'start: "<|user|>x"')
    assert refused.value.keyword == "<|user|>" and f"control token {user}" in str(refused.value)


def test_a_grammar_that_names_the_control_token_may_write_it(tiny_tokenizer: Any) -> None:
    user = tiny_tokenizer.token_to_id("<|user|>")
    mask = token_mask.FormatMask(_compiled(tiny_tokenizer, 'start: <|user|> "x"'))
    logits = torch.zeros(tiny_tokenizer.vocab_size)
    mask.apply(logits, _Step([]))  # type: ignore[arg-type]
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [user]
    mask.apply(torch.zeros(tiny_tokenizer.vocab_size), _Step([user]))  # type: ignore[arg-type]  # taken


def test_a_control_token_spelled_mid_answer_is_refused_before_the_first_token(tiny_tokenizer: Any) -> None:
    # Once the request ended in an error after "a"; the compile's rehearsal walks the path and refuses it.
    user = tiny_tokenizer.token_to_id("<|user|>")
    with pytest.raises(UnsupportedFormat, match=f"control token {user}"):
        _compiled(tiny_tokenizer, 'start: "a" "<|user|>x"')


def test_a_control_token_spelled_on_one_path_is_never_allowed(tiny_tokenizer: Any) -> None:
    # The other path ("ab") keeps the format: the mask clears the spelled token where the matcher refuses it.
    user = tiny_tokenizer.token_to_id("<|user|>")
    mask = token_mask.FormatMask(_compiled(tiny_tokenizer, 'start: "a" "<|user|>x" | "a" "b"'))
    first = torch.zeros(tiny_tokenizer.vocab_size)
    mask.apply(first, _Step([]))  # type: ignore[arg-type]
    (a,) = torch.isfinite(first).nonzero().flatten().tolist()
    second = torch.zeros(tiny_tokenizer.vocab_size)
    mask.apply(second, _Step([a]))  # type: ignore[arg-type]
    assert not torch.isfinite(second[user]) and torch.isfinite(second).any()
