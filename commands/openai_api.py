"""OpenAI's request and response shapes, and how a request maps onto a plan's stages.

A request's fields become overrides of the plan's own stage parameters, so the plan's values are the
defaults and its limits hold: `max_tokens` may not exceed the generate stage's `max_new_tokens`, and every
value is validated again by the stage's own schema. The extras llama.cpp and vLLM accept (`top_k`, `min_p`,
`repetition_penalty`) map the same way; `ignore_eos` too (benchmarks).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

FINISH = {"eos": "stop", "stop_string": "stop", "length": "length", "cache_full": "length", "cancelled": "stop"}


# Types are strict, as OpenAI's are: "5" is not an integer, true is not a number, "yes" is not a boolean, and
# 1.0 is not an integer either (OpenAI: "expected an integer, but got a decimal number"). An int is a number.
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
INT64 = 1 << 63
# Fields OpenAI documents as "or null" whose null means the default; any other null is refused.
NULL_MEANS_DEFAULT = ("n", "stream", "logprobs", "echo")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class _Request(BaseModel):
    # Unknown fields are ignored (clients send many: vLLM's and llama.cpp's extras, tools, user metadata).
    model_config = STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)  # OpenAI's seed is an int64
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras (llama.cpp's server, vLLM)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in NULL_MEANS_DEFAULT):
            return {k: v for k, v in data.items() if not (v is None and k in NULL_MEANS_DEFAULT)}
        return data

    @field_validator("model", mode="before")
    @classmethod
    def _model_given(cls, value: Any) -> Any:
        if value is None:  # absent means this server's model; an explicit null is not a model name
            raise PydanticCustomError("string_type", "expected a string")
        return value

    def check_combination(self) -> None:
        """Fields valid alone but not together (OpenAI refuses these too)."""
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed when stream is true")

    @property
    def sampling_seed(self) -> int | None:
        """The seed the sampler takes (0 .. 2^63-1): an int64 as OpenAI allows, negative ones folded in."""
        return None if self.seed is None else self.seed % INT64

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    def generate_overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.seed is not None:
            out["seed"] = self.sampling_seed
        if self.repetition_penalty is not None:
            out["repetition_penalty"] = self.repetition_penalty
        if self.ignore_eos is not None:
            out["ignore_eos"] = self.ignore_eos
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        limit = self.token_limit
        if limit is not None:
            out["max_new_tokens"] = limit
        return out

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def prompt_count(self) -> int:
        return 1


class ContentPart(BaseModel):
    model_config = STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported (text only)")
            parts.append(part.text)
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def check_combination(self) -> None:
        super().check_combination()
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "only allowed when logprobs is true")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tokenize_overrides(self) -> dict[str, Any]:
        chat = []
        for i, message in enumerate(self.messages):
            try:
                content = message.text()
            except ValueError as bad:
                raise FieldError(f"messages.{i}.content", str(bad)) from None
            role = "system" if message.role == "developer" else message.role
            chat.append({"role": role, "content": content})
        out: dict[str, Any] = {"messages": chat, "text": None, "prompts_file": None, "truncation": "error"}
        if any(m["role"] == "system" for m in chat):
            out["system"] = None  # the request's own system message replaces the plan's
        return out

    def logprobs_wanted(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class CompletionRequest(_Request):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @property
    def prompt_count(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, list) else 1

    def prompts(self) -> list[str]:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if not prompts:
            raise FieldError("prompt", "must not be empty")
        return prompts

    @staticmethod
    def tokenize_overrides(prompt: str) -> dict[str, Any]:
        return {"text": prompt, "messages": None, "prompts_file": None, "truncation": "error"}

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def finish_reason(reason: str) -> str:
    return FINISH.get(reason, "stop")


def chat_logprobs(tok: Any, ids: list[int], logprobs: list[float], top: list[Any] | None) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion: one entry per token with its top alternatives."""

    def entry(token: int, value: float) -> dict[str, Any]:
        text = tok.decode([token])
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (token, value) in enumerate(zip(ids, logprobs, strict=False)):
        item = entry(token, value)
        item["top_logprobs"] = [entry(t, v) for t, v in (top[i] if top and i < len(top) else [])]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(tok: Any, ids: list[int], logprobs: list[float], top: list[Any] | None) -> dict[str, Any]:
    """`choices[].logprobs` of a legacy completion: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets, offset = [], [], 0
    for token in ids:
        text = tok.decode([token])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    tops = [{tok.decode([t]): v for t, v in (top[i] if top and i < len(top) else [])} for i in range(len(ids))]
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs[: len(ids)]),
        "top_logprobs": tops,
        "text_offset": offsets,
    }
