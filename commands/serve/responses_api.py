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

from .openai_api import ChatRequest, FieldError, new_id, now


class ResponsesRequest(ChatRequest):
    responses_tools: Any = None  # the request's `tools`, which are refused

    def check_combination(self) -> None:
        if self.responses_tools:  # its function calls would be other output items, not a chat message
            raise FieldError("tools", "not supported on /v1/responses here; call tools through /v1/chat/completions")
        super().check_combination()

    @model_validator(mode="before")
    @classmethod
    def _as_chat(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("previous_response_id") is not None:
            raise ValueError("previous_response_id: responses are not stored here; send the whole input")
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
