"""OpenAI's Responses API (`POST /v1/responses`, the SDK's `client.responses`) over the chat completions path.

Text in, text out: `input` (a string, or messages whose content is text or `input_text` / `output_text` parts),
`instructions` (the system turn), `max_output_tokens`, `text.format` (the answer's shape: chat's
`response_format`, failing closed the same way), and the sampling fields chat takes. A request becomes a
chat request (so the chat template, limits and errors are the same); its answer and its stream are the chat
answer re-shaped: one `message` output item of one `output_text` part, and the streaming events
response.created .. response.completed with their sequence numbers. Nothing is stored: `previous_response_id`
is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import model_validator

from llmplan.engine.messages import shown

from .openai_api import ChatRequest, FieldError, new_id, now
from .request_body import json_kind


class ResponsesRequest(ChatRequest):
    responses_tools: Any = None  # the request's `tools`, which are refused

    def check_combination(self) -> None:
        if self.responses_tools:  # its function calls would be other output items, not a chat message
            raise FieldError("tools", "not supported on /v1/responses here; call tools through /v1/chat/completions")
        super().check_combination()

    @model_validator(mode="before")
    @classmethod
    def _as_chat(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "input" not in data:  # already a chat request (`as_chat` ran)
            return data
        return as_chat(data)


def as_chat(data: dict[str, Any]) -> dict[str, Any]:
    """A Responses request's body as the chat request it is answered as (validated as one, so a refusal names
    a chat field: `responses_name` turns it back into the Responses request's own)."""
    data = dict(data)
    if data.get("previous_response_id") is not None:
        raise FieldError("previous_response_id", "responses are not stored here; send the whole input")
    shape = data.pop("text", None)  # Responses' `text.format`: the answer's shape, as chat's response_format
    if isinstance(shape, dict) and shape.get("format") is not None:
        data["response_format"] = _response_format(shape["format"])
    if data.get("tools"):  # Responses' tools are another shape: refused by name (`check_combination`)
        data["responses_tools"] = data.pop("tools")
    given = data.pop("input", None)
    turns = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if isinstance(turns, list):
        turns = [_turn(t) for t in turns]
    instructions = data.pop("instructions", None)
    if isinstance(instructions, str) and isinstance(turns, list):
        turns = [{"role": "system", "content": instructions}, *turns]
    data["messages"] = turns
    if "max_output_tokens" in data:
        data["max_tokens"] = data.pop("max_output_tokens")
    if data.get("stream"):
        data["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return data


TEXT_FIELDS = ("format", "verbosity")  # what Responses' `text` object holds
VERBOSITY = ("low", "medium", "high")


def check_body(data: Any) -> None:
    """Responses' own fields, refused in their own names before the body becomes a chat request (FieldError):
    `instructions` a string, `text` an object of TEXT_FIELDS, `input` a string or an array of items."""
    if not isinstance(data, dict):
        return
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise FieldError("instructions", f"expected a string, got {json_kind(instructions)}")
    shape = data.get("text")
    if shape is not None and not isinstance(shape, dict):
        example = '{"format": {"type": "text"}}'
        raise FieldError("text", f"expected an object (such as {example}), got {json_kind(shape)}")
    for key in shape or {}:
        if key not in TEXT_FIELDS:
            raise FieldError(f"text.{key}", f"not a field of text (it takes {', '.join(TEXT_FIELDS)})")
    verbosity = (shape or {}).get("verbosity")
    if verbosity is not None and verbosity not in VERBOSITY:  # a hint this server takes and does not act on
        said = shown(verbosity) if isinstance(verbosity, str) else json_kind(verbosity)
        raise FieldError("text.verbosity", f"expected one of {', '.join(VERBOSITY)}, got {said}")
    given = data.get("input")
    if given is None:
        raise FieldError("input", "required (a string, or an array of input items)")
    if not isinstance(given, str | list):
        raise FieldError("input", f"expected a string or an array of input items, got {json_kind(given)}")


# Chat's names for what a Responses request calls otherwise (the request is validated as a chat request).
_CHAT_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format", "responses_tools": "tools"}


def responses_name(param: str | None, data: Any) -> str | None:
    """A chat field's name (`messages.1.content`) as the Responses request named it (`input.0.content`)."""
    if param is None or not isinstance(data, dict):
        return param
    head, _, rest = param.partition(".")
    if head in _CHAT_NAMES:
        return _CHAT_NAMES[head] + (f".{rest}" if rest else "")
    if head != "messages":
        return param
    index, _, tail = rest.partition(".")
    if not index.isdigit():
        return "input"
    at = int(index) - (1 if isinstance(data.get("instructions"), str) else 0)  # instructions: the system turn
    if at < 0:
        return "instructions"
    if isinstance(data.get("input"), str):
        return "input"
    return f"input.{at}" + (f".{tail}" if tail else "")


def _response_format(given: Any) -> Any:
    """`text.format` as chat's `response_format`: json_schema's fields sit beside its type here."""
    if isinstance(given, dict) and given.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: given[k] for k in keys if k in given}}
    return given  # text, json_object, or what chat's validation refuses by name


def _turn(item: Any) -> Any:
    """A Responses input item as a chat message: its text parts joined (other items stay, and are refused)."""
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        return item
    content = item.get("content")
    if isinstance(content, list):
        texts = [
            p.get("text") for p in content if isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
        ]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            content = "".join(texts)
    return {"role": item.get("role"), "content": content}


def response_body(chat: dict[str, Any], body: ResponsesRequest, status: str = "completed") -> dict[str, Any]:
    """A chat completion's answer (one choice) as a Responses API `response` object."""
    choice = chat["choices"][0] if chat["choices"] else None
    text = choice["message"]["content"] if choice else ""
    usage = chat.get("usage") or {}
    incomplete = choice is not None and choice["finish_reason"] == "length"
    message = {
        "type": "message",
        "id": "msg_" + chat["id"].split("-", 1)[-1],
        "status": "incomplete" if incomplete else status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    return {
        "id": "resp_" + chat["id"].split("-", 1)[-1],
        "object": "response",
        "created_at": chat["created"],
        "status": "incomplete" if incomplete and status == "completed" else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": chat["model"],
        "instructions": None,
        "output": [message] if choice else [],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_tokens,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0),
        }
        if usage
        else None,
    }


async def response_events(chunks: AsyncIterator[str], body: ResponsesRequest, model: str) -> AsyncIterator[str]:
    """A chat completion's server-sent chunks as the Responses API's streaming events."""
    ident = new_id("chatcmpl")
    made = now()
    item_id = "msg_" + ident.split("-", 1)[-1]
    number = 0
    text, reason, usage = "", None, None

    def event(kind: str, **fields: Any) -> str:
        nonlocal number
        data = {"type": kind, "sequence_number": number, **fields}
        number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def snapshot(status: str) -> dict[str, Any]:
        choices = [{"message": {"content": text}, "finish_reason": reason}] if status != "in_progress" else []
        chat = {"id": ident, "created": made, "model": model, "choices": choices, "usage": usage}
        return response_body(chat, body, status)

    part = {"type": "output_text", "text": "", "annotations": []}
    yield event("response.created", response=snapshot("in_progress"))
    item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
    yield event("response.output_item.added", output_index=0, item=item)
    yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part)
    at = {"item_id": item_id, "output_index": 0, "content_index": 0}
    async for raw in chunks:
        if not raw.startswith("data: {"):
            continue
        data = json.loads(raw[len("data: ") :])
        if "error" in data:
            yield event("error", message=data["error"]["message"], code=data["error"].get("code"), param=None)
            return
        usage = data.get("usage") or usage
        for choice in data.get("choices", []):
            delta = choice["delta"].get("content")
            if delta:
                text += delta
                yield event("response.output_text.delta", **at, delta=delta, logprobs=[])
            reason = choice.get("finish_reason") or reason
    yield event("response.output_text.done", **at, text=text, logprobs=[])
    yield event("response.content_part.done", **at, part=part | {"text": text})
    final = snapshot("completed")
    yield event("response.output_item.done", output_index=0, item=final["output"][0])
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
