"""What a client is told when its request is refused (#56): `/v1/responses` as strict as chat completions, each
error named in the Responses API's own terms; and no error body shows the server's folders (a template that
refuses a message names its file, `tokenizer_config.json`, not where the model lives)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmplan.commands.serve.app import ServerSettings

from .conftest import LiveServer, write_serve_plan

# The tiny template, with a turn that makes it try an unsafe operation (the sandbox refuses it).
HOSTILE = (
    "{% for m in messages %}{% if m['content'] == 'attack' %}{{ m.__class__.__mro__ }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("client-errors")
    model_dir = tmp / "secret-model-folder"
    shutil.copytree(tiny_model, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HOSTILE}), "utf-8")
    with LiveServer(write_serve_plan(tmp, model_dir), ServerSettings(max_queue=8)) as server:
        yield server


def refused(live: LiveServer, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    answer = httpx.post(f"{live.url}/{path}", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    return error["message"], error["param"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "instructions": 5}, "instructions"),
        ({"input": "hi", "instructions": ["be brief"]}, "instructions"),
        ({"input": "hi", "text": 5}, "text"),
        ({"input": "hi", "text": {"fromat": {"type": "text"}}}, "text.fromat"),
        ({"input": 5}, "input"),
        ({"instructions": "be brief"}, "input"),
        ({"input": [{"role": "user", "content": 5}]}, "input.0.content"),
        ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}], "instructions": "x"},
         "input.1.content"),
        ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "hi", "text": {"verbosity": 5}}, "text.verbosity"),
        ({"input": "hi", "text": {"verbosity": "loud"}}, "text.verbosity"),
    ],
)  # fmt: skip
def test_responses_refuse_in_their_own_terms(live: LiveServer, body: dict[str, Any], param: str) -> None:
    message, named = refused(live, "responses", body)
    assert named == param and message.startswith(f"{param}:"), message
    assert "messages" not in message and "max_tokens" not in message.replace("max_output_tokens", "")


def test_the_sdk_sees_the_same_400(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="m", input="hi", instructions=5)  # type: ignore[arg-type]
    assert "instructions: expected a string" in str(bad.value)
    assert client.responses.create(model="m", input="hi", instructions="be brief", max_output_tokens=3).output_text
    assert client.responses.create(model="m", input="hi", text={"verbosity": "low"}, max_output_tokens=3).output_text


def test_a_template_refusal_names_no_server_folder(live: LiveServer) -> None:
    model_dir = str(live.host.context.model_source.model_dir)
    chat = {"model": "m", "messages": [{"role": "user", "content": "attack"}], "max_tokens": 3}
    for path, body in (("chat/completions", chat), ("responses", {"input": "attack", "max_output_tokens": 3})):
        answer = httpx.post(f"{live.url}/{path}", json=body, timeout=60)
        assert answer.status_code == 400, answer.text
        assert "secret-model-folder" not in answer.text and model_dir not in answer.text, answer.text
        assert "tokenizer_config.json" in answer.json()["error"]["message"] and "template" in answer.text
    streamed = httpx.post(f"{live.url}/chat/completions", json={**chat, "stream": True}, timeout=60)
    assert "secret-model-folder" not in streamed.text and "tokenizer_config.json" in streamed.text
