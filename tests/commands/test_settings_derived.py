"""The plan's and the API's sampling schemas are derived from llm.sampling_params.SamplingParams, not restated.

Each test reads the limits from the dataclass's field metadata and compares them with the JSON schemas the
plan (RequestSettings → plan.schema.json) and the server (ChatRequest, CompletionRequest) publish; a field
added to the dataclass must appear in both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from llmplan.commands.serve.openai_api import MAPPED, ChatRequest, CompletionRequest, sampling_model
from llmplan.llm.sampling import SamplingParams, request_fields
from llmplan.llm.sampling.params import setting
from llmplan.stages.compute_generate import GenerateParams
from llmplan.stages.request_settings import RequestSettings, settings_model

BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}
SETTINGS = [f.name for f, _, _ in request_fields()]


def _bounds(prop: dict[str, Any]) -> dict[str, Any]:
    """A JSON-schema property's numeric bounds as ge/gt/le/lt, looking into an `anyOf` of int | null."""
    found = {short: prop[long] for short, long in BOUNDS.items() if long in prop}
    for branch in prop.get("anyOf", []):
        found |= _bounds(branch)
    return found


def _limit(name: str) -> Any:
    return next(limit for f, _, limit in request_fields() if f.name == name)


@pytest.mark.parametrize("model", [RequestSettings, GenerateParams])
@pytest.mark.parametrize("name", SETTINGS)
def test_the_plan_schema_states_the_dataclass_limits(model: Any, name: str) -> None:
    prop = model.model_json_schema()["properties"][name]
    limit = _limit(name)
    default = next(f for f in dataclasses.fields(SamplingParams) if f.name == name).default
    assert _bounds(prop) == limit.bounds()
    assert prop["description"] == limit.description
    made = model.model_fields[name].get_default(call_default_factory=True)
    assert made == (list(default) if isinstance(default, tuple) else default)
    if name == "stop":
        assert prop["maxItems"] == limit.max_items
        assert prop["items"]["minLength"] == limit.min_chars


@pytest.mark.parametrize("model", [ChatRequest, CompletionRequest])
@pytest.mark.parametrize("name", SETTINGS)
def test_the_api_schema_states_the_dataclass_limits_or_openai_s(model: Any, name: str) -> None:
    mapped = MAPPED.get(name)
    field = mapped.field if mapped is not None else name
    prop = model.model_json_schema()["properties"][field]
    expected = mapped.bounds if mapped is not None and mapped.bounds is not None else _limit(name).bounds()
    assert _bounds(prop) == expected
    assert prop.get("default") is None  # absent or null: the plan's value holds


def test_only_mapped_settings_differ_from_the_dataclass_in_the_api() -> None:
    """Every difference between the API and the dataclass is a row of MAPPED: the rest are the same field."""
    api = ChatRequest.model_json_schema()["properties"]
    differing = {name for name in SETTINGS if name not in api or _bounds(api[name]) != _limit(name).bounds()}
    assert differing <= set(MAPPED)
    assert set(MAPPED) <= set(SETTINGS)  # no row for a setting that does not exist


@dataclasses.dataclass(frozen=True)
class WithTypicalP(SamplingParams):
    typical_p: float = setting(1.0, "locally typical sampling; 1 = off", gt=0, le=1)


def test_a_field_added_to_the_dataclass_appears_in_both_schemas() -> None:
    plan = settings_model(WithTypicalP).model_json_schema()["properties"]["typical_p"]
    api = sampling_model(WithTypicalP).model_json_schema()["properties"]["typical_p"]
    assert _bounds(plan) == _bounds(api) == {"gt": 0, "le": 1}
    assert plan["default"] == 1.0
    assert plan["description"] == "locally typical sampling; 1 = off"
    with pytest.raises(ValueError, match="typical_p"):
        WithTypicalP(typical_p=1.5)  # the dataclass checks its own new field too


def test_values_a_derived_schema_checked_are_taken_as_they_are() -> None:
    """`trusted` (the path after a plan's or the API's validation) does not check again; direct construction does."""
    assert SamplingParams.trusted(temperature=-1.0).temperature == -1.0
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(TypeError, match="tempreature"):
        SamplingParams.trusted(tempreature=0.5)
    assert SamplingParams.trusted(stop=["a"]).stop == ("a",)


# OpenAI's own ranges (its API reference), where they are what clients send instead of the plan's.
OPENAI = {"max_tokens": {"ge": 1}, "temperature": {"ge": 0, "le": 2}, "seed": {"ge": -(1 << 63), "lt": 1 << 63}}


@pytest.mark.parametrize(("field", "bounds"), OPENAI.items())
def test_the_api_keeps_openai_s_ranges_where_they_differ(field: str, bounds: dict[str, int]) -> None:
    assert _bounds(ChatRequest.model_json_schema()["properties"][field]) == bounds
