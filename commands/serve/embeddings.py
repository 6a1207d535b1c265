"""`POST /v1/embeddings` in OpenAI's shapes, as llama-server, vLLM and Ollama serve it.

The request: `input` a string, a list of strings, a list of token ids or a list of such lists; `encoding_format`
"float" (default) or "base64" (little-endian float32, what OpenAI's Python client asks for and decodes);
`dimensions` only when it equals the model's width (a causal LM's states cannot be shortened as OpenAI's
text-embedding-3 models are trained to be); `model` and `user` as elsewhere. Each vector is the model's final
hidden states (after the final norm) mean-pooled over the input's own tokens (a BOS the tokenizer adds is run
but not pooled) and L2-normalized, as OpenAI's are: cosine similarity is then a dot product.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any

from .request_body import BodyError, json_kind

POOLING = {"pooling": "mean", "normalization": "l2", "states": "final hidden states, after the final norm"}
MAX_INPUTS = 2048  # OpenAI's limit on the items of one request
FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: list[str | list[int]]
    model: str | None
    encoding_format: str


def parse_embedding_request(data: dict[str, Any], width: int) -> EmbeddingRequest:
    """The request's fields checked; BodyError naming the field otherwise."""
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise BodyError(f"{unknown[0]}: not a field of an embeddings request ({', '.join(sorted(FIELDS))})", unknown[0])
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise BodyError(f"model: expected a string, got {json_kind(model)}", "model")
    encoding = data.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BodyError(f"encoding_format: 'float' or 'base64', got {_shown(encoding)}", "encoding_format")
    dimensions = data.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or dimensions != width):
        raise BodyError(
            f"dimensions: this model's embeddings have {width} dimensions and cannot be shortened, got "
            f"{_shown(dimensions)}",
            "dimensions",
        )
    if "input" not in data:
        raise BodyError("input: required (a string, a list of strings, or token ids)", "input")
    return EmbeddingRequest(_inputs(data["input"]), model, encoding)


def _inputs(value: Any) -> list[str | list[int]]:
    """`input` as a list of texts and token-id lists: each one embedding."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_id(v) for v in value):
        value = [value]  # one input given as token ids
    if not isinstance(value, list) or not value:
        raise BodyError(
            f"input: expected a non-empty string, list of strings or list of token ids, got {_kind(value)}", "input"
        )
    if len(value) > MAX_INPUTS:
        raise BodyError(f"input: at most {MAX_INPUTS} items, got {len(value)}", "input")
    for i, item in enumerate(value):
        ok = isinstance(item, str) or (isinstance(item, list) and all(_is_id(v) for v in item))
        if not ok:
            raise BodyError(f"input.{i}: expected a string or a list of token ids, got {_kind(item)}", f"input.{i}")
        if not item:
            raise BodyError(f"input.{i}: must not be empty", f"input.{i}")
    return value


def tokens_of(inputs: list[str | list[int]], tokenizer: Any, vocab: int, limit: int) -> list[tuple[list[int], int]]:
    """Per input: the ids the model runs and how many leading ids (a BOS added to a text) are not pooled."""
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            ids = tokenizer.encode(item, special=False)  # a user's text: never a control token
            plain = tokenizer.encode(item, add_bos=False, special=False)
            skip = len(ids) - len(plain)
        else:
            bad = next((t for t in item if t >= vocab), None)
            if bad is not None:
                raise BodyError(f"input.{i}: token id {bad} is out of the vocabulary (0..{vocab - 1})", f"input.{i}")
            ids, skip = list(item), 0
        if len(ids) > limit:
            raise BodyError(f"input.{i}: {len(ids)} tokens, the model takes at most {limit}", f"input.{i}")
        if len(ids) <= skip:  # a text of no tokens at all
            raise BodyError(f"input.{i}: no tokens to embed", f"input.{i}")
        out.append((ids, skip))
    return out


def embedding_response(vectors: list[list[float]], encoding: str, model: str, tokens: int) -> dict[str, Any]:
    """OpenAI's list of embeddings, with its usage."""
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v) if encoding == "base64" else v}
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _encoded(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _kind(value: Any) -> str:
    if isinstance(value, list) and not value:
        return "an empty array"
    if isinstance(value, list) and any(isinstance(v, int) and not isinstance(v, bool) and v < 0 for v in value):
        return "a negative token id"
    return json_kind(value)


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, (str, int, float)) else json_kind(value)
