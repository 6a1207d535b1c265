"""The generation settings a single request may set for itself, as a plan's schema.

Nothing is declared here: `RequestSettings` is built from `llm.sampling_params.SamplingParams`, field by field
(its type, default, limits and description), and the generate stage's parameters inherit it. `Overrides`
(what a JSONL line carries) is built from RequestSettings with every field optional, so a plan, a request
line and the library can never accept different values: `stop: [""]` or `no_repeat_ngram_size: 1000` is
refused in each place by the same rule.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Annotated, Any

from pydantic import Field, StringConstraints, create_model
from pydantic.fields import FieldInfo

from llmplan.engine.stage import Params
from llmplan.llm.sampling_params import Limit, SamplingParams, Speculation, request_fields, setting_kinds


def nested_model(source: type) -> type[Params]:
    """A setting that is itself a dataclass of settings (`speculative`) as a pydantic model, field by field."""
    return create_model(  # type: ignore[call-overload, no-any-return]
        source.__name__,
        __base__=Params,
        __doc__=source.__doc__,
        **{f.name: plan_field(f, kind, f.metadata["limit"]) for f, kind in setting_kinds(source)},
    )


def plan_field(f: dataclasses.Field[Any], kind: Any, limit: Limit) -> tuple[Any, FieldInfo]:
    """A dataclass field as a pydantic field: the same default, limits and description."""
    if kind == Speculation | None:
        return nested_model(Speculation) | None, Field(None, description=limit.description)
    if kind == tuple[str, ...]:  # a YAML list of strings; the dataclass keeps them as a tuple
        item = Annotated[str, StringConstraints(min_length=limit.min_chars)]
        return list[item], Field(default_factory=list, max_length=limit.max_items, description=limit.description)
    return kind, Field(f.default, description=limit.description, **limit.bounds())


def settings_model(source: type = SamplingParams) -> type[Params]:
    """The plan's schema of the settings a request may carry, built from the dataclass `source`."""
    return create_model(  # type: ignore[call-overload, no-any-return]
        "RequestSettings",
        __base__=Params,
        __doc__="The settings one request may set for itself: llm.sampling_params.SamplingParams, as a plan's schema.",
        **{f.name: plan_field(f, kind, limit) for f, kind, limit in request_fields(source)},
    )


RequestSettings = settings_model()

# The settings that go to the sampler chain; the others end a request.
SAMPLING_FIELDS: tuple[str, ...] = tuple(n for n in RequestSettings.model_fields if n not in ("max_new_tokens", "stop"))


def plain_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings as plain data (a nested setting's model as its mapping): what results and cache keys record."""
    return {name: v.model_dump() if isinstance(v, Params) else v for name, v in settings.items()}


def sampling_params(
    settings: dict[str, Any], logprobs_top_n: int, logit_bias: tuple[tuple[int, float], ...] = ()
) -> SamplingParams:
    """A request's effective settings (a validated plan's, then a validated request line's) for the library:
    checked already, so built as they are."""
    return SamplingParams.trusted(
        **{name: settings[name] for name in RequestSettings.model_fields},
        logprobs_top_n=logprobs_top_n,
        logit_bias=logit_bias,
    )


def _optional(field: FieldInfo) -> tuple[Any, FieldInfo]:
    """The same field with the same limits, but optional: None means 'as the plan says'."""
    clone = copy.copy(field)
    clone.default = None
    clone.default_factory = None
    return field.annotation | None, clone


Overrides: type[Params] = create_model(  # type: ignore[call-overload]
    "Overrides",
    __base__=Params,
    __doc__="Per-request generation settings a JSONL line may carry: RequestSettings, every field optional.",
    **{name: _optional(field) for name, field in RequestSettings.model_fields.items()},
)
