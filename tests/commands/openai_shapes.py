"""OpenAI's response shapes, from the `openai` package's own pydantic models, held strictly both ways.

`conforms(kind, body)` validates a body the server sent against the SDK's model of it (every required key
there, of its type) and walks it against the model's fields (no key the model does not know: the SDK's
models allow extra keys, OpenAI's bodies have none). `EXTRA` lists the few keys of our own on purpose.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from openai.types import Completion, CompletionChoice, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.shared import ErrorObject
from pydantic import BaseModel, TypeAdapter


class StreamedCompletionChoice(CompletionChoice):
    """A streamed completion's choice: OpenAI sends `finish_reason: null` until the last one (the SDK reads
    chunks into `Completion` without validating them, so its model does not say so)."""

    finish_reason: Literal["stop", "length", "content_filter"] | None = None  # type: ignore[assignment]


class CompletionChunk(Completion):
    choices: list[StreamedCompletionChoice]  # type: ignore[assignment]


KINDS: dict[str, type[BaseModel]] = {
    "chat.completion": ChatCompletion,
    "chat.completion.chunk": ChatCompletionChunk,
    "text_completion": Completion,
    "text_completion.chunk": CompletionChunk,
    "model": Model,
    "error": ErrorObject,
    "response": Response,
}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def conforms_event(body: dict[str, Any]) -> Any:
    """A Responses streaming event, validated against the SDK's union of events (by its `type`)."""
    made = EVENTS.validate_python(body)
    _walk(type(made), body, body["type"])
    return made


EXTRA = {Model: {"llmplan"}}  # the plan behind the model, as metadata


def conforms(kind: str, body: dict[str, Any]) -> BaseModel:
    """The SDK's object for `body`; AssertionError naming the path of any key that does not fit."""
    schema = KINDS[kind]
    made = schema.model_validate(body)  # required keys and their types
    _walk(schema, body, kind)
    return made


def _walk(schema: type[BaseModel], body: Any, path: str) -> None:
    assert isinstance(body, dict), f"{path}: expected an object, got {type(body).__name__}"
    fields = {(f.alias or name): f for name, f in schema.model_fields.items()}
    for key, value in body.items():
        assert key in fields or key in EXTRA.get(schema, ()), f"{path}.{key}: not in OpenAI's {schema.__name__}"
        if key in fields and value is not None:
            _walk_value(fields[key].annotation, value, f"{path}.{key}")


def _walk_value(annotation: Any, value: Any, path: str) -> None:
    for model in _models(annotation):
        if isinstance(value, dict):
            _walk(model, value, path)
            return
    if isinstance(value, list):
        for item_type in _list_items(annotation):
            for i, item in enumerate(value):
                _walk_value(item_type, item, f"{path}.{i}")


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def _list_items(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is list:
        return list(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [i for arg in typing.get_args(annotation) for i in _list_items(arg)]
    return []


def stream_bodies(lines: list[str]) -> list[dict[str, Any]]:
    """The JSON bodies of a server-sent event stream's `data:` lines, up to `[DONE]` (which must come)."""
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]
