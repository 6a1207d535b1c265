"""The generation settings a single request may set for itself, declared once.

`RequestSettings` states each setting with its default and limits. The generate stage's parameters inherit
it, and `Overrides` (what a JSONL line carries) is derived from it field by field with every field optional,
so a plan and a request line can never accept different values: `stop: [""]` or `no_repeat_ngram_size: 1000`
is refused in both places by the same rule.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any

from pydantic import Field, StringConstraints, create_model
from pydantic.fields import FieldInfo

from llmplan.engine.stage import Params

StopString = Annotated[str, StringConstraints(min_length=1)]  # "" would stop before the first token


class RequestSettings(Params):
    max_new_tokens: int = Field(256, ge=1, le=1 << 20, description="generated tokens per request, at most")
    temperature: float = Field(0.0, ge=0, le=100, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="keep the smallest set with this probability; 1 = off")
    min_p: float = Field(0.0, ge=0, le=1, description="drop tokens below min_p × p(best); 0 = off")
    repetition_penalty: float = Field(1.0, gt=0, le=10, description="HF-style, over prompt and output; 1 = off")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="OpenAI-style, over generated tokens")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="OpenAI-style, over generated tokens")
    no_repeat_ngram_size: int = Field(0, ge=0, le=64, description="ban repeating any n-gram; 0 = off")
    seed: int | None = Field(None, ge=0, description="sampling seed; default: the plan's seed")
    stop: list[StopString] = Field(default_factory=list, max_length=16, description="stop strings (on decoded text)")


# The settings that go to the sampler (llm.sampling.SamplingParams); the others end a request.
SAMPLING_FIELDS: tuple[str, ...] = tuple(n for n in RequestSettings.model_fields if n not in ("max_new_tokens", "stop"))


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
