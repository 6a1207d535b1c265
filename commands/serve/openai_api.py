"""OpenAI's request and response shapes, and how a request maps onto a plan's stages.

A request's fields become overrides of the plan's own stage parameters, so the plan's values are the
defaults and its limits hold: `max_tokens` may not exceed the generate stage's `max_new_tokens`, and every
value is validated again by the stage's own schema. The extras llama.cpp and vLLM accept (`top_k`, `min_p`,
`repetition_penalty`) map the same way; `ignore_eos` too (benchmarks).

The sampling fields are not written here: each comes from `llm.sampling_params.SamplingParams` (its type and
limits), under the setting's own name, except where OpenAI's request differs (`MAPPED`):

    setting          request field              limits in the request                  back to the setting
    max_new_tokens   max_tokens (chat also      >= 1; at most the plan's max_new_tokens  the request's limit
                     max_completion_tokens,     (checked per request, naming the field)
                     which wins)
    temperature      temperature                [0, 2], OpenAI's (a plan: [0, 100])      as is
    seed             seed                       an int64, OpenAI's (a plan: >= 0)        folded into 0 .. 2^63-1
    stop             stop: a string or a list   at most 4, OpenAI's (a plan: 16);        a string s is [s]
                                                none empty (the setting's)
    logprobs_top_n   (none: a library knob)     chat's logprobs + top_logprobs (0 .. 20) and a completion's
                                                logprobs (0 .. 5) set the stage's `logprobs` instead
    speculative      speculative (an extra)     {method, tokens, ngram}, the setting's;  as a mapping
                                                unknown keys refused
    format           response_format, llama.cpp's  one of them; checked as it arrives     the shape asked, as
                     json_schema / grammar, vLLM's  (structured_output.py: 400 naming      the setting's mapping
                     guided_*, or format (the      the field and the keyword that cannot
                     setting's own mapping)        be enforced)
    every other      its own name               the setting's                            as is
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from llmplan.llm.generation import OPENAI_FINISH, openai_finish
from llmplan.llm.sampling import Limit, OutputFormat, SamplingParams, Speculation, request_fields, setting_kinds

from .structured_output import Shaped, ShapeError, requested_format
from .tool_calls import Tooled, ToolMode, history_turn, tool_mode

FINISH = OPENAI_FINISH  # one vocabulary with `run`, --json and the results database (llm/generation/ending.py)


# Types are strict, as OpenAI's are: "5" is not an integer, true is not a number, "yes" is not a boolean, and
# 1.0 is not an integer either (OpenAI: "expected an integer, but got a decimal number"). An int is a number.
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
INT64 = 1 << 63
STOP_SEQUENCES = 4  # OpenAI's limit on `stop`
# A stop string matched inside a shaped answer would end it where the shape is not whole, under finish "stop".
STOP_BESIDE_SHAPE = "not with {} (a stop string could end the answer before its shape is whole); send one of them"


@dataclass(frozen=True)
class Mapped:
    """A setting whose OpenAI field differs from it: the field's name, OpenAI's bounds, and the way back."""

    field: str
    bounds: dict[str, int] | None = None  # None: the setting's own
    to_setting: Callable[[Any], Any] = lambda value: value


MAPPED: dict[str, Mapped] = {
    "max_new_tokens": Mapped("max_tokens", {"ge": 1}),
    "temperature": Mapped("temperature", {"ge": 0, "le": 2}),
    "seed": Mapped("seed", {"ge": -INT64, "lt": INT64}, lambda seed: seed % INT64),
    "stop": Mapped("stop", None, lambda stop: [stop] if isinstance(stop, str) else list(stop)),
}


def nested_request_model(source: type) -> type[BaseModel]:
    """A setting that is a dataclass of settings (`speculative`) as a strict request object; a key it does
    not know is refused (a typo would otherwise turn the setting off unseen)."""
    fields = {f.name: (kind, Field(f.default, **f.metadata["limit"].bounds())) for f, kind in setting_kinds(source)}
    return create_model(  # type: ignore[call-overload, no-any-return]
        source.__name__, __config__=ConfigDict(extra="forbid", strict=True, allow_inf_nan=False), **fields
    )


def api_field(kind: Any, limit: Limit, mapped: Mapped | None) -> tuple[Any, FieldInfo]:
    """A setting as an optional request field (None: as the plan says), with OpenAI's bounds where MAPPED."""
    if kind == Speculation | None:
        return nested_request_model(Speculation) | None, Field(None)
    if kind == tuple[str, ...]:
        return str | list[str] | None, Field(None)  # checked by `_Request._stops`
    if kind == OutputFormat | None:
        return dict[str, Any] | None, Field(None)  # the setting's own shape; checked by `requested_format`
    bounds = mapped.bounds if mapped is not None and mapped.bounds is not None else limit.bounds()
    return kind | None, Field(None, **bounds)


API_TEMPERATURE = 1.0  # OpenAI's default; greedy (the library's) is for a plan to choose


def api_defaults() -> dict[str, Any]:
    """What a request that omits a sampling setting gets: OpenAI's defaults (temperature 1, no penalties, no
    stop) and the extras off; not the plan's values (but where its generate stage marks `serving_defaults`).
    `max_new_tokens` is not here (the plan's is the default) nor `seed` (the server draws one)."""
    out = {
        f.name: list(f.default) if isinstance(f.default, tuple) else f.default
        for f, _, _ in request_fields()
        if f.name not in ("max_new_tokens", "seed")
    }
    return out | {"temperature": API_TEMPERATURE}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None


class _Fields(BaseModel):
    # Unknown fields are ignored (clients send many: vLLM's and llama.cpp's extras, tools, user metadata).
    model_config = STRICT
    model: str | None = None


_STOP_LIMIT = next(limit for f, _, limit in request_fields() if f.name == "stop")


def sampling_model(source: type = SamplingParams) -> type[_Fields]:
    """The request's sampling fields, each under its request name (`MAPPED`), built from the dataclass
    `source`; after `model`, as OpenAI lists them."""
    return create_model(  # type: ignore[call-overload, no-any-return]
        "_Sampling",
        __base__=_Fields,
        **{
            MAPPED[f.name].field if f.name in MAPPED else f.name: api_field(kind, limit, MAPPED.get(f.name))
            for f, kind, limit in request_fields(source)
        },
    )


_Sampling = sampling_model()


class _Request(_Sampling, Shaped):  # type: ignore[misc, valid-type]
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = None  # llama.cpp's and vLLM's extra (benchmarks)
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM's: keep the prompt's last k tokens
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias in [-100, 100]
    _shape: OutputFormat | None = PrivateAttr(None)  # the answer's shape, checked (`check_combination`)
    _shape_field: str | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        """An explicit null for an optional field is the field left out, as OpenAI and llama-server read it
        (clients serialise unset fields as null); a required field's null is still refused by its type."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or _required(cls, k)}
        return data

    def check_combination(self) -> None:
        """Fields valid alone but not together (OpenAI refuses these too)."""
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed when stream is true")
        for key, bias in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit() or len(key) > 9:
                raise FieldError("logit_bias", f"keys are token ids (digits), got {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise FieldError("logit_bias", f"a bias is in [-100, 100], got {bias} for token {key}")
        try:
            self._shape, self._shape_field = requested_format(self)
        except ShapeError as bad:
            raise FieldError(bad.field, str(bad).split(": ", 1)[1]) from None
        if self._shape is not None and self.stop:
            raise FieldError("stop", STOP_BESIDE_SHAPE.format(self._shape_field))

    @property
    def shape(self) -> OutputFormat | None:
        """The answer's shape (response_format, json_schema, grammar, ...), once `check_combination` ran."""
        return self._shape

    def bias(self, vocab: int | None) -> dict[int, float]:
        """`logit_bias` by token id, each id checked against the vocabulary (OpenAI refuses unknown ids too)."""
        out = {int(key): bias for key, bias in (self.logit_bias or {}).items()}
        outside = [token for token in out if vocab is not None and token >= vocab]
        if outside:
            raise FieldError("logit_bias", f"token {outside[0]} is not in the vocabulary (0 .. {vocab - 1})")
        return out

    @property
    def sampling_seed(self) -> int | None:
        """The seed the sampler takes (0 .. 2^63-1): an int64 as OpenAI allows, negative ones folded in."""
        return None if self.seed is None else MAPPED["seed"].to_setting(self.seed)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > STOP_SEQUENCES:
            raise ValueError(f"at most {STOP_SEQUENCES} stop sequences")
        if any(len(s) < (_STOP_LIMIT.min_chars or 0) for s in stops):
            raise ValueError("stop sequences must not be empty")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    def generate_overrides(self) -> dict[str, Any]:
        """The generate stage's overrides: each sampling field given, as its setting (MAPPED's way back)."""
        out: dict[str, Any] = {}
        for f, _, _ in request_fields():
            if f.name == "format":
                continue  # the request's shape, from whichever field asked for it (`shape`)
            mapped = MAPPED.get(f.name)
            value = getattr(self, mapped.field if mapped is not None else f.name)
            if isinstance(value, BaseModel):
                value = value.model_dump()
            if value is not None:
                out[f.name] = mapped.to_setting(value) if mapped is not None else value
        limit = self.token_limit  # chat's max_completion_tokens wins over max_tokens
        if limit is not None:
            out["max_new_tokens"] = limit
        if self.ignore_eos is not None:
            out["ignore_eos"] = self.ignore_eos
        if self._shape is not None:
            out["format"] = self._shape.setting()
        return out

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def prompt_count(self) -> int:
        return 1


def _required(schema: type[BaseModel], name: str) -> bool:
    field = schema.model_fields.get(name)
    return field is not None and field.is_required()


class ContentPart(BaseModel):
    model_config = STRICT
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One turn. The tool-result turn is part of the chat: an assistant turn may carry `tool_calls` and no
    content, and a `tool` turn answers one call by its id; both go to the chat template as they came."""

    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def missing(self) -> str | None:
        """The field this turn lacks, if any: content (but on an assistant turn of tool calls), a tool turn's id."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            return "content"
        if self.role == "tool" and self.tool_call_id is None:
            return "tool_call_id"
        return None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported (text only)")
            parts.append(part.text)
        return "".join(parts)

    def for_template(self, content: str) -> dict[str, Any]:
        """The turn as a chat template reads it (HF's message dicts): content text, the tool fields as sent."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(_Request, Tooled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    _tools: ToolMode | None = PrivateAttr(None)

    def check_combination(self) -> None:
        super().check_combination()
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "only allowed when logprobs is true")
        try:
            self._tools = tool_mode(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ShapeError as bad:
            raise FieldError(bad.field, str(bad).split(": ", 1)[1]) from None
        if self._tools is not None:
            if self._shape is not None:  # the calls' format and the answer's cannot both hold
                raise FieldError(
                    self._shape_field or "response_format",
                    "not with tools a call may be made to; send tool_choice: none to keep the shape",
                )
            self._shape = self._tools.format
            if self._shape is not None and self.stop:
                raise FieldError("stop", STOP_BESIDE_SHAPE.format("tools a call may be made to"))

    @property
    def tool_mode(self) -> ToolMode | None:
        """How the answer may call the request's tools (None: text), once `check_combination` ran."""
        return self._tools

    def calls_in_template_style(self, tag_tokens: bool = False) -> None:
        """Call the tools in the template's own style (Hermes' tags, Qwen2.5's): the template is given the
        tools and the answer is held to its format (tool_calls.py); `tag_tokens`: the tags are tokens."""
        if self._tools is not None:
            self._tools = replace(self._tools, native=True, tag_tokens=tag_tokens)
            self._shape = self._tools.format

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tokenize_overrides(self, plan_system: str | None = None, renders_calls: bool = True) -> dict[str, Any]:
        """The tokenize stage's overrides: the chat as the template reads it. With tools to call, their
        description ends the system turn (the request's, else the plan's `plan_system`), or, in the template's
        own style, they are its `tools`; a template that does not render `tool_calls` (`renders_calls`) gets
        the history's calls as text (tool_calls.py)."""
        chat = []
        for i, message in enumerate(self.messages):
            lacking = message.missing()
            if lacking is not None:
                raise FieldError(f"messages.{i}.{lacking}", "required")
            try:
                content = message.text()
            except ValueError as bad:
                raise FieldError(f"messages.{i}.content", str(bad)) from None
            chat.append(history_turn(message.for_template(content), renders_calls))
        out: dict[str, Any] = {"messages": chat, "text": None, "prompts_file": None, "truncation": "error"}
        if self._tools is not None and self._tools.native:
            out["tools"] = self._tools.template_tools()
        elif self._tools is not None:
            told = self._tools.describe()
            if chat[0]["role"] == "system":
                chat[0] = chat[0] | {"content": f"{chat[0]['content']}\n\n{told}"}
            else:
                chat.insert(0, {"role": "system", "content": f"{plan_system}\n\n{told}" if plan_system else told})
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
    suffix: str | None = None  # fill-in-the-middle: refused unless empty

    def check_combination(self) -> None:
        super().check_combination()
        if self.suffix:
            raise FieldError("suffix", "not supported (no fill-in-the-middle here); leave it out")

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
    return openai_finish(reason)


def _special(tok: Any) -> set[int]:
    return set(getattr(tok, "special_ids", ()))


def chat_logprobs(tok: Any, ids: list[int], logprobs: list[float], top: list[Any] | None) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion: one entry per token of the text with its top alternatives.
    A special token (the end of turn) is no text: its entry is left out, and as an alternative it reads ""."""
    special = _special(tok)

    def entry(token: int, value: float) -> dict[str, Any]:
        text = "" if token in special else tok.decode([token])
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (token, value) in enumerate(zip(ids, logprobs, strict=False)):
        if token in special:
            continue
        item = entry(token, value)
        item["top_logprobs"] = [entry(t, v) for t, v in (top[i] if top and i < len(top) else [])]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(tok: Any, ids: list[int], logprobs: list[float], top: list[Any] | None) -> dict[str, Any]:
    """`choices[].logprobs` of a legacy completion: tokens, token_logprobs, top_logprobs, text_offset (special
    tokens left out, as alternatives too: they are no text)."""
    special = _special(tok)
    tokens, values, tops, offsets, offset = [], [], [], [], 0
    for i, (token, value) in enumerate(zip(ids, logprobs, strict=False)):
        if token in special:
            continue
        text = tok.decode([token])
        tokens.append(text)
        values.append(value)
        offsets.append(offset)
        offset += len(text)
        alternatives = top[i] if top and i < len(top) else []
        tops.append({tok.decode([t]): v for t, v in alternatives if t not in special})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
