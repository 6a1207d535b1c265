"""What one request asks of generation, stated once: each setting with its type, default, limits and meaning.

`SamplingParams` is the only place these are written. Its fields carry their limits (`Limit`, in the field's
metadata); the plan's schema (stages/request_settings.py) and the OpenAI API's request schema
(commands/serve/openai_api.py) are built from them, so a plan, a JSONL request line, an API request and a direct
caller of this library are held to the same rule. Built directly, the dataclass checks its values itself;
`SamplingParams.trusted` builds one from values a derived schema already checked, without a second pass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from .constrained_format import OutputFormat
from .format_compiler import CompiledFormat

__all__ = ["HOW_GREEDY", "Limit", "SamplingParams", "Speculation", "request_fields", "setting", "setting_kinds"]


@dataclass(frozen=True)
class Limit:
    """A setting's meaning and limits. Numbers: ge/gt/le/lt. A list of strings: at most `max_items`, each at
    least `min_chars` long. `request=False`: the library's own knob, set by the caller, not by a request."""

    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    max_items: int | None = None
    min_chars: int | None = None
    request: bool = True

    def bounds(self) -> dict[str, float]:
        """The numeric bounds that are set, by name (pydantic's names: ge, gt, le, lt)."""
        named = {"ge": self.ge, "gt": self.gt, "le": self.le, "lt": self.lt}
        return {name: value for name, value in named.items() if value is not None}

    def refusal(self, value: float) -> str | None:
        """Why a number is out of bounds, or None."""
        for name, bound, inside in (
            ("ge", self.ge, lambda b: value >= b),
            ("gt", self.gt, lambda b: value > b),
            ("le", self.le, lambda b: value <= b),
            ("lt", self.lt, lambda b: value < b),
        ):
            if bound is not None and not inside(bound):
                sign = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[name]
                return f"must be {sign} {bound} (got {value})"
        return None


def setting(default: Any, description: str, **limits: Any) -> Any:
    """A dataclass field with its default, meaning and limits (the keyword arguments of `Limit`)."""
    return field(default=default, metadata={"limit": Limit(description, **limits)})


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding (llm/generation/speculative.py): guess the next tokens, verify them all in one pass. The
    answers are those of plain decoding (greedy: token for token; sampled: the same distribution)."""

    method: Literal["prompt_lookup", "draft"] = setting(
        "prompt_lookup",
        "prompt_lookup: guesses copied from the text so far; draft: the greedy tokens of the plan's load.draft model",
    )
    tokens: int = setting(4, "guessed tokens verified per pass, at most", ge=1, le=16)
    ngram: int = setting(3, "the longest suffix looked up in the prompt and output (prompt_lookup)", ge=1, le=8)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = _refusal(getattr(self, f.name), kinds(type(self))[f.name], f.metadata["limit"])
            if problem is not None:
                raise ValueError(f"speculative.{f.name}: {problem}")

    @classmethod
    def of(cls, value: Speculation | dict[str, Any] | None) -> Speculation | None:
        """A setting as given (a plan's or request's mapping, or built already); None: no speculation."""
        if value is None or isinstance(value, Speculation):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative: must be a mapping {{method, tokens, ngram}} (got {value!r})")
        unknown = sorted(set(value) - kinds(cls).keys())
        if unknown:
            raise ValueError(f"speculative: unknown field {', '.join(unknown)} (known: method, tokens, ngram)")
        return cls(**value)


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings. The sampler chain reads temperature .. no_repeat_ngram_size, seed and
    logprobs_top_n; max_new_tokens and stop end the request (the caller hands them to the loop)."""

    # None: until EOS or the context (the KV cache's rows) is full, as Ollama, vLLM and llama-server do; the loop
    # that owns the cache turns it into the room left there (llm/generation/request_runner.py `token_room`)
    max_new_tokens: int | None = setting(
        None, "generated tokens per request, at most; null = until end-of-sequence or the context is full", ge=1,
        le=1 << 20
    )
    temperature: float = setting(0.0, "0 = greedy", ge=0, le=100)
    top_k: int = setting(0, "keep the k most likely tokens; 0 = off", ge=0)
    top_p: float = setting(1.0, "keep the smallest set with this probability; 1 = off", gt=0, le=1)
    min_p: float = setting(0.0, "drop tokens below min_p × p(best); 0 = off", ge=0, le=1)
    repetition_penalty: float = setting(1.0, "HF-style, over prompt and output; 1 = off", gt=0, le=10)
    frequency_penalty: float = setting(0.0, "OpenAI-style, over generated tokens", ge=-2, le=2)
    presence_penalty: float = setting(0.0, "OpenAI-style, over generated tokens", ge=-2, le=2)
    no_repeat_ngram_size: int = setting(0, "ban repeating any n-gram; 0 = off", ge=0, le=64)
    # None: a plan uses its own seed; a direct caller of the library gets a fresh random one
    seed: int | None = setting(None, "sampling seed; default: the plan's seed", ge=0)
    # "" would stop before the first token
    stop: tuple[str, ...] = setting((), "stop strings (on decoded text)", max_items=16, min_chars=1)
    logprobs_top_n: int = setting(0, "best tokens by raw log-prob returned per pick", ge=0, request=False)
    # None by default, else a frozen Speculation: immutable either way
    speculative: Speculation | None = setting(  # noqa: RUF009
        None, "guess tokens and verify them in one pass: {method: prompt_lookup | draft, tokens, ngram}; null = off"
    )
    # the answer's shape (llm/sampling/constrained_format.py), enforced by the first sampler of the chain
    # (llm/sampling/token_mask.py)
    format: OutputFormat | None = setting(  # noqa: RUF009
        None, "the answer's shape: {json: true}, {json_schema: SCHEMA or FILE}, {regex}, {grammar} or {choice: [..]}"
    )
    # `format` compiled against the model's tokenizer (compile_format): the caller's, as only it has the tokenizer
    grammar: CompiledFormat | None = setting(None, "format compiled for the tokenizer", request=False)  # noqa: RUF009
    # (token id, bias) pairs added to the logits first; the caller's knob (the API's logit_bias, validated there)
    logit_bias: tuple[tuple[int, float], ...] = setting(
        (), "added to the token's logit: (id, bias) pairs", request=False
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = _refusal(getattr(self, f.name), kinds(type(self))[f.name], f.metadata["limit"])
            if problem is not None:
                raise ValueError(f"{f.name}: {problem}")
        for name in ("stop", "logit_bias", "speculative", "format"):  # kept hashable, as frozen promises
            object.__setattr__(self, name, _frozen(name, getattr(self, name)))
        if self.format is not None:
            self.format.check()  # fail closed: what llguidance cannot enforce is refused here too

    @classmethod
    def trusted(cls, **values: Any) -> SamplingParams:
        """Values a schema derived from these limits has already checked (a plan's, a request line's, the
        API's): built without checking them again. Unset fields take their defaults; unknown names fail."""
        unknown = set(values) - kinds(cls).keys()
        if unknown:
            raise TypeError(f"SamplingParams has no field {', '.join(sorted(unknown))}")
        made = object.__new__(cls)
        for f in dataclasses.fields(cls):
            value = values.get(f.name, f.default)
            object.__setattr__(made, f.name, _frozen(f.name, value))
        return made

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# How a request asks for greedy picks, for a loop that only picks greedily (beam search) to say so.
HOW_GREEDY = "temperature 0"


def request_fields(source: type = SamplingParams) -> list[tuple[dataclasses.Field[Any], Any, Limit]]:
    """(field, type, limit) of each setting a request may carry, in declaration order. `source`: the
    dataclass the schemas are derived from (SamplingParams; a test passes one with a field more)."""
    out = []
    for f in dataclasses.fields(source):
        limit = f.metadata["limit"]
        if limit.request:
            out.append((f, kinds(source)[f.name], limit))
    return out


def setting_kinds(source: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """(field, resolved type) of every field of a dataclass of settings."""
    return [(f, kinds(source)[f.name]) for f in dataclasses.fields(source)]


@functools.cache
def kinds(source: type) -> dict[str, Any]:
    """Each field's type, resolved (this module's annotations are strings)."""
    return typing.get_type_hints(source)


def _frozen(name: str, value: Any) -> Any:
    if name == "speculative":
        return Speculation.of(value)
    if name == "format":
        return OutputFormat.of(value)
    if name == "stop":
        return tuple(value)
    if name == "logit_bias":
        return tuple((int(token), float(bias)) for token, bias in value)
    return value


def _refusal(value: Any, kind: Any, limit: Limit) -> str | None:
    """Why `value` does not fit the field's type and limits, or None."""
    if kind == Speculation | None:
        if value is None or isinstance(value, Speculation | dict):
            return None  # a mapping's own fields are checked as it is built (`Speculation.of`)
        return f"must be a mapping {{method, tokens, ngram}} (got {value!r})"
    if kind == OutputFormat | None:
        if value is None or isinstance(value, OutputFormat | dict):
            return None  # a mapping is checked as it is built (`OutputFormat.of`)
        return f"must be a mapping with one of json, json_schema, regex, grammar, choice (got {value!r})"
    if kind == CompiledFormat | None:
        return None if value is None or isinstance(value, CompiledFormat) else f"must be compiled (got {value!r})"
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        return None if value in choices else f"must be one of {', '.join(map(repr, choices))} (got {value!r})"
    if kind == tuple[tuple[int, float], ...]:
        pairs = value if isinstance(value, tuple | list) else None
        if pairs is None or not all(
            isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], int | float)
            for p in pairs
        ):
            return f"must be (token id, bias) pairs (got {value!r})"
        return None
    if kind == int | None:
        if value is None:
            return None
        kind = int
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer (got {value!r})"
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"must be a finite number (got {value!r})"
    else:  # tuple[str, ...]: the stop strings
        if not isinstance(value, tuple | list) or not all(isinstance(s, str) for s in value):
            return f"must be a list of strings (got {value!r})"
        if limit.max_items is not None and len(value) > limit.max_items:
            return f"at most {limit.max_items} (got {len(value)})"
        if limit.min_chars is not None and any(len(s) < limit.min_chars for s in value):
            return f"each must have at least {limit.min_chars} character(s)"
        return None
    return limit.refusal(value)
