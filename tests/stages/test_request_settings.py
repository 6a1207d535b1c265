"""A request line and the plan accept exactly the same generation settings (declared once)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from llmplan.llm.sampling.chain import SamplingParams
from llmplan.stages.compute_generate import GenerateParams
from llmplan.stages.compute_tokenize import RequestLine
from llmplan.stages.request_settings import SAMPLING_FIELDS, Overrides, RequestSettings

# Values at, inside and past each limit; bools and strings where numbers go.
PROBES: dict[str, list[Any]] = {
    "max_new_tokens": [0, 1, 1 << 20, (1 << 20) + 1, True, "3"],
    "temperature": [-0.1, 0, 0.7, 100, 100.5, "1"],
    "top_k": [-1, 0, 40],
    "top_p": [0, 0.001, 1, 1.01],
    "min_p": [-0.1, 0, 1, 1.1],
    "repetition_penalty": [0, 0.5, 10, 10.5],
    "frequency_penalty": [-2.1, -2, 2, 2.1],
    "presence_penalty": [-2.1, -2, 2, 2.1],
    "no_repeat_ngram_size": [-1, 0, 64, 65, 1000],
    "seed": [-1, 0, 2**40],
    "stop": [[], [""], ["a"], ["a"] * 16, ["a"] * 17, "a"],
    "speculative": [
        None,
        {},
        {"method": "prompt_lookup", "tokens": 4, "ngram": 3},
        *({"tokens": k} for k in (0, 1, 16, 17, True, "3")),
        *({"ngram": n} for n in (0, 1, 8, 9)),
        {"method": "draft"},
        {"tokenz": 2},
        5,
        "prompt_lookup",
    ],
    "format": [
        None,
        {"json": True},
        {"json": False},
        {"json_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}},
        {"json_schema": {"type": "array", "uniqueItems": True}},  # cannot be enforced: refused everywhere
        {"json_schema": 3},
        {"regex": "[a-z]{2,5}"},
        {"regex": "a(?=b)"},
        {"regex": ""},
        {"grammar": 'root ::= "yes" | "no"'},
        {"choice": ["red", "green"]},
        {"choice": []},
        {"json": True, "regex": "a"},
        {},
        {"yaml": True},
        5,
        "json",
    ],
}


def _accepts(model: type, values: dict[str, Any]) -> bool:
    try:
        model.model_validate(values)
    except ValidationError:
        return False
    return True


def test_every_request_setting_is_probed() -> None:
    assert set(PROBES) == set(RequestSettings.model_fields) == set(Overrides.model_fields)


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in PROBES.items() for v in vs])
def test_a_request_line_accepts_what_the_plan_accepts(name: str, value: Any) -> None:
    in_plan = _accepts(GenerateParams, {name: value})
    in_line = _accepts(RequestLine, {"text": "hi", name: value})
    assert in_plan == in_line, f"{name}={value!r}: plan {'accepts' if in_plan else 'refuses'}, line differs"


def _sampler_accepts(name: str, value: Any) -> bool:
    try:
        SamplingParams(**{name: value})
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in PROBES.items() for v in vs])
def test_the_library_accepts_exactly_what_the_plan_accepts(name: str, value: Any) -> None:
    """One statement of the limits: the dataclass built directly refuses what a plan refuses, no more."""
    in_plan = _accepts(GenerateParams, {name: value})
    assert _sampler_accepts(name, value) == in_plan, f"{name}={value!r}: plan {'accepts' if in_plan else 'refuses'}"


def test_the_sampler_settings_are_the_request_settings_less_the_ending_rules() -> None:
    assert set(SAMPLING_FIELDS) == set(RequestSettings.model_fields) - {"max_new_tokens", "stop"}


def test_unset_override_fields_are_none() -> None:
    line = RequestLine.model_validate({"text": "hi", "temperature": 0.5})
    assert line.model_dump(exclude={"id", "messages", "text"}, exclude_none=True) == {"temperature": 0.5}
