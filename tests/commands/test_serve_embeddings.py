"""`POST /v1/embeddings` through the real `openai` client: OpenAI's shapes, unit vectors, refusals naming the field."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from .conftest import LiveServer


def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)


def test_embeddings_in_openai_shape_unit_norm(served: LiveServer) -> None:
    c = client(served)
    width = served.host.context.model_config.dim
    texts = ["The cache keeps keys and values.", "Hello world, hello model.", "The cache keeps keys and values."]
    answer = c.embeddings.create(model="tiny-serve", input=texts)  # the client asks for base64 and decodes it
    assert answer.object == "list" and answer.model == "tiny-serve"
    assert [d.index for d in answer.data] == [0, 1, 2] and all(d.object == "embedding" for d in answer.data)
    vectors = [d.embedding for d in answer.data]
    assert all(len(v) == width for v in vectors)
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-5) for v in vectors)  # L2-normalized
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]  # same text, same vector; others differ
    tok = served.host.context.tokenizer
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(tok.encode(t)) for t in texts)
    floats = c.embeddings.create(model="tiny-serve", input=texts[0], encoding_format="float").data[0].embedding
    assert floats == pytest.approx(vectors[0], abs=1e-6)  # float and base64 (float32) say the same vector


def test_embedding_is_the_mean_of_the_final_hidden_states(served: LiveServer) -> None:
    """Token ids as input: the final norm's output averaged over every token, then scaled to norm 1."""
    ids = [5, 40, 41, 50, 60]
    got = client(served).embeddings.create(model="tiny-serve", input=ids, encoding_format="float")
    model = served.host.context.model
    with torch.inference_mode():
        pooled = model.hidden(torch.tensor([ids])).float()[0].mean(0)
    expected = (pooled / pooled.norm()).tolist()
    assert got.data[0].embedding == pytest.approx(expected, abs=1e-5) and got.usage.prompt_tokens == len(ids)
    both = client(served).embeddings.create(model="tiny-serve", input=[ids, ids[:3]], encoding_format="float")
    assert both.data[0].embedding == pytest.approx(expected, abs=1e-5) and len(both.data) == 2


def test_models_say_how_embeddings_are_made(served: LiveServer) -> None:
    entry = httpx.get(f"{served.url}/models").json()["data"][0]
    assert entry["llmplan"]["embeddings"] == {
        "pooling": "mean",
        "normalization": "l2",
        "states": "final hidden states, after the final norm",
        "dimensions": served.host.context.model_config.dim,
    }


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "non-empty"),
        ({"input": ""}, "input.0", "must not be empty"),
        ({"input": [1.5]}, "input.0", "a decimal number"),
        ({"input": ["ok", 3]}, "input.1", "a string or a list of token ids"),
        ({"input": [[1, 2], [99999]]}, "input.1", "out of the vocabulary"),
        ({"input": "x", "dimensions": 7}, "dimensions", "cannot be shortened"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "x", "temperature": 1}, "temperature", "not a field"),
        ({}, "input", "required"),
    ],
)
def test_a_bad_input_is_a_400_naming_the_field(served: LiveServer, body: dict, param: str, words: str) -> None:
    answer = httpx.post(f"{served.url}/embeddings", json={"model": "tiny-serve", **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:") and words in error["message"]


def test_the_client_raises_on_a_bad_input(served: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client(served).embeddings.create(model="tiny-serve", input="x", dimensions=3)
