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
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationInfo,
    create_model,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo

from llmplan.engine.stage import Params
from llmplan.llm.sampling import (
    CompiledFormat,
    Limit,
    OutputFormat,
    SamplingParams,
    Speculation,
    request_fields,
    setting_kinds,
)


class FormatSetting(Params):
    """`format`: the answer's shape (llm/sampling/constrained_format.py), exactly one of these. Checked here, before any
    model is loaded: a keyword llguidance cannot enforce is refused, named at its own line and column."""

    json_: bool | None = Field(None, alias="json", description="any JSON object")
    json_schema: dict[str, Any] | bool | str | None = Field(
        None, description="a JSON Schema, inline or a file (relative to the plan's folder)"
    )
    regex: str | None = Field(None, min_length=1, description="a regular expression the whole answer matches")
    grammar: str | None = Field(None, min_length=1, description="a Lark or GBNF grammar")
    choice: list[str] | None = Field(None, min_length=1, description="the answer is one of these strings")
    _format: OutputFormat | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _built(self, info: ValidationInfo) -> FormatSetting:
        named = {"json": self.json_, "json_schema": self.json_schema, "regex": self.regex, "grammar": self.grammar}
        given = {name: value for name, value in {**named, "choice": self.choice}.items() if value is not None}
        base = (info.context or {}).get("plan_dir")
        fmt = OutputFormat.of(given, Path(base) if base else None)
        assert fmt is not None
        fmt.check()  # UnsupportedFormat (a ValueError): its field_path points at the keyword
        self._format = fmt
        return self

    @model_serializer(mode="plain")
    def _inline(self) -> dict[str, Any]:
        # A schema read from a file is recorded inline: results and cache keys hold what actually ran.
        return self._format.setting() if self._format is not None else {}

    @property
    def value(self) -> OutputFormat:
        assert self._format is not None
        return self._format


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
    if kind == OutputFormat | None:
        return FormatSetting | None, Field(None, description=limit.description)
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
    settings: dict[str, Any],
    logprobs_top_n: int,
    logit_bias: tuple[tuple[int, float], ...] = (),
    grammar: CompiledFormat | None = None,
) -> SamplingParams:
    """A request's effective settings (a validated plan's, then a validated request line's) for the library:
    checked already, so built as they are. `grammar`: the request's format compiled for the tokenizer."""
    return SamplingParams.trusted(
        **{name: settings[name] for name in RequestSettings.model_fields},
        logprobs_top_n=logprobs_top_n,
        logit_bias=logit_bias,
        grammar=grammar,
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
