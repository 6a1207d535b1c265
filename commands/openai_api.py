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

from pydantic import BaseModel, ConfigDict, Field, field_validator

FINISH = {"eos": "stop", "stop_string": "stop", "length": "length", "cache_full": "length", "cancelled": "stop"}


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI's server does for fields it does not know (clients send many).
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # extras (llama.cpp's server, vLLM)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool | None = None

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
        return bool((self.stream_options or {}).get("include_usage"))

    def generate_overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
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


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
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
