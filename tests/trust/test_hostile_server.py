"""`llmplan serve` under hostile requests: every one refused with a 4xx in OpenAI's error shape naming the field
(or, for bytes that are not HTTP, a bounded close), never a 500, never silence.

One server per module on 127.0.0.1 (a tiny model, an API key, short header and body deadlines). Each case
runs under a time bound and an RSS bound (the server lives in this process), and after each: nothing was
logged at error level or with a traceback (uvicorn's log, asyncio's, the run's events.jsonl), no request is
left in flight, and the server still answers a normal request. Normal client calls go through the real
`openai` package; malformed bytes through httpx or a raw socket.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmplan.commands.serve.app import ServerSettings
from llmplan.commands.serve.http_guard import ENDPOINTS
from tests.commands.conftest import LiveServer, write_serve_plan
from tests.stages.tiny_run import make_tiny_model_dir
from tests.trust.hostile import assert_clean_message, memory_bound, refused, time_bound

KEY = "hostile-key-7f3a"
MODEL = "hostile"
HEADER_S = 0.8  # the server's deadlines in this module (production: 10 s and 30 s)
BODY_S = 0.8
LIMIT = 1 << 20
MAX_QUEUE = 8
AUTH = {"authorization": f"Bearer {KEY}"}
JSON_TYPE = {"content-type": "application/json", **AUTH}
CHAT = [{"role": "user", "content": "Hello model, tokens and layers."}]
DROP = object()  # a field removed from the base request
CASE_S = 10.0
CASE_MB = 48.0


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Served:
    live: LiveServer
    log: Recorder
    events: Path
    client: openai.OpenAI
    plan: Path
    seen_events: int = 0
    cases: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.live.port


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("hostile-server")
    model_dir, _ = make_tiny_model_dir(root, n_layers=1)
    plan = write_serve_plan(root, model_dir, slots=2, name=MODEL)
    settings = ServerSettings(
        api_key=KEY, max_queue=MAX_QUEUE, header_timeout_s=HEADER_S, body_timeout_s=BODY_S, strict_model=True
    )
    recorder = Recorder()
    watched = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "asyncio", "llmplan")]
    try:
        with LiveServer(plan, settings) as live:
            for logger in watched:  # after uvicorn's dictConfig, which drops the handlers its loggers had
                logger.addHandler(recorder)
            client = openai.OpenAI(base_url=live.url, api_key=KEY, max_retries=0, timeout=20)
            one = Served(live, recorder, live.host.run_dir / "events.jsonl", client, plan)
            still_answers(one)  # warm: the first request's allocations are not a case's
            still_answers(one)
            yield one
    finally:
        for logger in watched:
            logger.removeHandler(recorder)


def still_answers(served: Served) -> None:
    answer = served.client.completions.create(model=MODEL, prompt="keys", max_tokens=2)
    assert answer.usage.completion_tokens == 2 and answer.object == "text_completion"


@contextlib.contextmanager
def hostile(served: Served, seconds: float = CASE_S, memory_mb: float = CASE_MB) -> Iterator[None]:
    """One case: bounded in time and memory; afterwards a clean log, nothing in flight, and a normal answer."""
    served.log.records.clear()
    with time_bound(seconds), memory_bound(memory_mb):
        yield
    deadline = time.monotonic() + 5
    tasks = served.live.server.server_state.tasks
    while (tasks or served.live.host.in_flight) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tasks and served.live.host.in_flight == 0, "a request is still held after the case"
    for record in served.log.records:
        text = record.getMessage()
        assert record.exc_info is None and record.levelno < logging.ERROR, f"logged: {record.levelname} {text}"
        assert "Traceback" not in text and "Exception in" not in text, text
    lines = served.events.read_text(encoding="utf-8").splitlines() if served.events.exists() else []
    new, served.seen_events = lines[served.seen_events :], len(lines)
    errors = [line for line in new if json.loads(line).get("level") in ("error", "critical")]
    assert not errors, errors[:3]
    still_answers(served)


def assert_refusal(status: int, payload: bytes | str, expected: int, param: str | None, names: tuple[str, ...] = ()):
    """A 4xx of OpenAI's shape: {"error": {message, type, param, code}}, the field named and a clean message."""
    assert status == expected, f"{status}: {payload[:300]!r}"
    assert 400 <= status < 500
    body = json.loads(payload)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] == param, error
    assert_clean_message(error["message"], names=((param,) if param else ()) + names)
    return error


def post_raw(served: Served, path: str, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{served.live.base}{path}", content=content, headers=JSON_TYPE if headers is None else headers, timeout=10
    )


# --- JSON that Python's parser takes but the server cannot hold, and JSON that is not a request ---------------

DIGITS = "9" * 5000
RAW_JSON = [
    pytest.param(
        "/v1/completions", b'{"prompt": "keys", "seed": %s}' % DIGITS.encode(), 400, "seed", id="int-5000-digits-seed"
    ),
    pytest.param(
        "/v1/completions",
        b'{"prompt": "keys", "max_tokens": -%s}' % DIGITS.encode(),
        400,
        "max_tokens",
        id="int-5000-digits-negative",
    ),
    pytest.param(
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": %s}]}' % DIGITS.encode(),
        400,
        "messages.0.content",
        id="int-5000-digits-nested",
    ),
    pytest.param(
        "/v1/completions", b'{"prompt": "keys", "top_k": 1%s}' % (b"0" * 40), 400, "top_k", id="int-41-digits"
    ),
    pytest.param(
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "messages.0.content",
        id="lone-high-surrogate",
    ),
    pytest.param("/v1/completions", b'{"prompt": "\\udfff"}', 400, "prompt", id="lone-low-surrogate"),
    pytest.param("/v1/completions", b'{"prompt": ["ok", "\\udc80x"]}', 400, "prompt.1", id="lone-surrogate-in-list"),
    pytest.param("/v1/completions", b'{"prompt": "keys", "stop": "\\ud83d"}', 400, "stop", id="half-emoji-stop"),
    pytest.param("/v1/completions", b'{"prompt": "keys", "temperature": NaN}', 400, "temperature", id="nan-literal"),
    pytest.param(
        "/v1/completions", b'{"prompt": "keys", "temperature": Infinity}', 400, "temperature", id="infinity-literal"
    ),
    pytest.param(
        "/v1/completions", b'{"prompt": "keys", "top_p": -Infinity}', 400, "top_p", id="minus-infinity-literal"
    ),
    pytest.param(
        "/v1/completions", b'{"prompt": "keys", "temperature": 1e999}', 400, "temperature", id="float-overflow"
    ),
    pytest.param(
        "/v1/completions",
        b'{"prompt": "keys", "max_tokens": 2, "max_tokens": 30}',
        400,
        "max_tokens",
        id="duplicate-key",
    ),
    pytest.param(
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}',
        400,
        "messages.0.role",
        id="duplicate-key-nested",
    ),
    pytest.param(
        "/v1/completions",
        b'{"prompt": "keys", "metadata": ' + b"[" * 40 + b"]" * 40 + b"}",
        400,
        "metadata.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0",
        id="nested-40",
    ),
    pytest.param("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None, id="nested-100000"),
    pytest.param("/v1/completions", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, 400, None, id="nested-objects-50000"),
    pytest.param("/v1/completions", b"", 400, None, id="empty-body"),
    pytest.param("/v1/completions", b"  \r\n\t ", 400, None, id="whitespace-body"),
    pytest.param("/v1/completions", b'[{"prompt": "keys"}]', 400, None, id="top-level-array"),
    pytest.param("/v1/completions", b'"keys"', 400, None, id="top-level-string"),
    pytest.param("/v1/completions", b"12", 400, None, id="top-level-number"),
    pytest.param("/v1/completions", b"null", 400, None, id="top-level-null"),
    pytest.param("/v1/completions", b'{"prompt": "\xff\xfe keys"}', 400, None, id="invalid-utf8"),
    pytest.param("/v1/completions", '{"prompt": "keys"}'.encode("utf-16"), 400, None, id="utf16-body"),
    pytest.param("/v1/completions", b'\xef\xbb\xbf{"prompt": "keys"}', 400, None, id="utf8-bom"),
    pytest.param("/v1/completions", b'{"prompt": "ke', 400, None, id="truncated-json"),
    pytest.param("/v1/completions", b'{"prompt": "keys"} {"prompt": "more"}', 400, None, id="two-documents"),
    pytest.param("/v1/completions", b'{"prompt": "k\x00eys"}', 400, None, id="raw-nul-in-string"),
    pytest.param("/v1/completions", b"{'prompt': 'keys'}", 400, None, id="python-quotes"),
]


@pytest.mark.parametrize(("path", "content", "status", "param"), RAW_JSON)
def test_hostile_json_is_refused_naming_the_field(
    served: Served, path: str, content: bytes, status: int, param: str | None
) -> None:
    with hostile(served):
        answer = post_raw(served, path, content)
        assert_refusal(answer.status_code, answer.content, status, param)


# --- types as strictly as OpenAI's, through the real client ------------------------------------------------------


def _with(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = {**base, **change}
    return {k: v for k, v in out.items() if v is not DROP}


CHAT_CASES = [
    pytest.param({"max_tokens": "5"}, "max_tokens", id="max_tokens-string"),
    pytest.param({"max_tokens": 5.0}, "max_tokens", id="max_tokens-decimal"),
    pytest.param({"max_tokens": True}, "max_tokens", id="max_tokens-bool"),
    pytest.param({"max_tokens": 0}, "max_tokens", id="max_tokens-zero"),
    pytest.param({"max_tokens": -3}, "max_tokens", id="max_tokens-negative"),
    pytest.param({"max_tokens": 10**9}, "max_tokens", id="max_tokens-over-plan"),
    pytest.param({"max_completion_tokens": [5]}, "max_completion_tokens", id="max_completion_tokens-array"),
    pytest.param({"temperature": True}, "temperature", id="temperature-bool"),
    pytest.param({"temperature": "0.5"}, "temperature", id="temperature-string"),
    pytest.param({"temperature": 2.5}, "temperature", id="temperature-over-2"),
    pytest.param({"temperature": None, "top_p": 0}, "top_p", id="top_p-zero"),
    pytest.param({"stream": "yes"}, "stream", id="stream-yes"),
    pytest.param({"stream": 1}, "stream", id="stream-one"),
    pytest.param({"n": 1.0}, "n", id="n-decimal"),
    pytest.param({"n": "2"}, "n", id="n-string"),
    pytest.param({"n": 0}, "n", id="n-zero"),
    pytest.param({"n": 17}, "n", id="n-17"),
    pytest.param({"seed": 2**63}, "seed", id="seed-2-63"),
    pytest.param({"seed": 2**64 + 5}, "seed", id="seed-2-64"),
    pytest.param({"seed": -(2**63) - 1}, "seed", id="seed-below-int64"),
    pytest.param({"seed": 1.5}, "seed", id="seed-decimal"),
    pytest.param({"seed": "7"}, "seed", id="seed-string"),
    pytest.param({"stop": 5}, "stop", id="stop-number"),
    pytest.param({"stop": ["a", 5]}, "stop.1", id="stop-item-number"),
    pytest.param({"stop": list("abcde")}, "stop", id="stop-five"),
    pytest.param({"stop": [""]}, "stop", id="stop-empty"),
    pytest.param({"logprobs": "true"}, "logprobs", id="logprobs-string"),
    pytest.param({"logprobs": True, "top_logprobs": 21}, "top_logprobs", id="top_logprobs-21"),
    pytest.param({"top_logprobs": 2}, "top_logprobs", id="top_logprobs-without-logprobs"),
    pytest.param(
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
        id="include_usage-yes",
    ),
    pytest.param({"stream_options": {"include_usage": True}}, "stream_options", id="stream_options-without-stream"),
    pytest.param({"stream": True, "stream_options": "usage"}, "stream_options", id="stream_options-string"),
    pytest.param({"presence_penalty": "high"}, "presence_penalty", id="presence_penalty-string"),
    pytest.param({"frequency_penalty": -2.5}, "frequency_penalty", id="frequency_penalty-range"),
    pytest.param({"user": 42}, "user", id="user-number"),
    pytest.param({"model": 42}, "model", id="model-number"),
    pytest.param({"messages": None}, "messages", id="messages-null"),
    pytest.param({"messages": "hello"}, "messages", id="messages-string"),
    pytest.param({"messages": []}, "messages", id="messages-empty"),
    pytest.param({"messages": ["hello"]}, "messages.0", id="message-string"),
    pytest.param({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", id="tool-without-id"),
    pytest.param({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", id="role-unknown"),
    pytest.param({"messages": [{"role": "USER", "content": "x"}]}, "messages.0.role", id="role-uppercase"),
    pytest.param({"messages": [{"content": "x"}]}, "messages.0.role", id="role-missing"),
    pytest.param({"messages": [{"role": None, "content": "x"}]}, "messages.0.role", id="role-null"),
    pytest.param({"messages": [{"role": "user"}]}, "messages.0.content", id="content-missing"),
    pytest.param({"messages": [{"role": "user", "content": 42}]}, "messages.0.content", id="content-number"),
    pytest.param({"messages": [{"role": "user", "content": None}]}, "messages.0.content", id="content-null"),
    pytest.param({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages.0.content", id="content-object"),
    pytest.param({"messages": [{"role": "user", "content": [5]}]}, "messages.0.content.0", id="content-part-number"),
    pytest.param(
        {"messages": [{"role": "user", "content": [{"type": 3}]}]},
        "messages.0.content.0.type",
        id="content-part-type-number",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages.0.content",
        id="content-part-image",
    ),
    pytest.param(
        {"messages": [*CHAT, {"role": "assistant", "content": ["a", "b"]}]},
        "messages.1.content.0",
        id="second-message-bad",
    ),
]


@pytest.mark.parametrize(("change", "param"), CHAT_CASES)
def test_chat_fields_are_typed_as_openai_types_them(served: Served, change: dict[str, Any], param: str) -> None:
    body = _with({"model": MODEL, "messages": CHAT, "max_tokens": 2}, change)
    with hostile(served):
        with pytest.raises(openai.APIStatusError) as refused:
            served.client.chat.completions.create(**body)
        answer = refused.value.response
        assert_refusal(answer.status_code, answer.content, 400, param)
        assert refused.value.param == param  # the client reads it back as OpenAI's own errors


COMPLETION_CASES = [
    pytest.param({"prompt": DROP}, "prompt", id="prompt-missing"),
    pytest.param({"prompt": None}, "prompt", id="prompt-null"),
    pytest.param({"prompt": 42}, "prompt", id="prompt-number"),
    pytest.param({"prompt": [1, 2, 3]}, "prompt.0", id="prompt-token-ids"),
    pytest.param({"prompt": []}, "prompt", id="prompt-empty-list"),
    pytest.param({"prompt": ["keys"] * 20, "n": 1}, "prompt", id="prompts-over-queue"),
    pytest.param({"logprobs": True}, "logprobs", id="logprobs-bool-for-int"),
    pytest.param({"logprobs": 6}, "logprobs", id="logprobs-6"),
    pytest.param({"echo": "no"}, "echo", id="echo-string"),
    pytest.param({"extra_body": {"top_k": 1.5}}, "top_k", id="top_k-decimal"),
    pytest.param({"extra_body": {"ignore_eos": "no"}}, "ignore_eos", id="ignore_eos-string"),
    pytest.param({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", id="repetition_penalty-zero"),
    pytest.param({"extra_body": {"min_p": True}}, "min_p", id="min_p-bool"),
]


@pytest.mark.parametrize(("change", "param"), COMPLETION_CASES)
def test_completion_fields_are_typed_as_openai_types_them(served: Served, change: dict[str, Any], param: str) -> None:
    body = _with({"model": MODEL, "prompt": "keys", "max_tokens": 2}, change)
    with hostile(served):
        with pytest.raises(openai.APIStatusError) as refused:
            if "prompt" not in body:  # the client insists on the argument; send the body as it is
                served.client.post("/completions", body=body, cast_to=httpx.Response)
            else:
                served.client.completions.create(**body)
        answer = refused.value.response
        assert_refusal(answer.status_code, answer.content, 400, param)


def test_another_model_is_a_404_naming_model(served: Served) -> None:
    with hostile(served):
        with pytest.raises(openai.NotFoundError) as refused:
            served.client.completions.create(model="x" * 100_000, prompt="keys", max_tokens=2)
        error = assert_refusal(404, refused.value.response.content, 404, "model")
        assert len(error["message"]) < 300  # the 100 kB name is not echoed back


# --- the benign twins: what OpenAI accepts must still work -------------------------------------------------------

BENIGN = [
    pytest.param({"n": None, "stream": None, "logprobs": None}, id="null-means-default"),
    pytest.param({"temperature": 1, "seed": 3}, id="integer-temperature"),
    pytest.param({"temperature": 1.0, "seed": -(2**63)}, id="seed-int64-min"),
    pytest.param({"temperature": 1.0, "seed": 2**63 - 1}, id="seed-int64-max"),
    pytest.param({"messages": [{"role": "user", "content": "keys \U0001f600 \u00e9"}]}, id="astral-and-accents"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "text", "text": "keys"}]}]}, id="content-parts"),
    pytest.param({"messages": [{"role": "developer", "content": "Be short."}, *CHAT]}, id="developer-role"),
    pytest.param({"unknown_field": {"anything": [1, 2]}, "tools": []}, id="unknown-fields-ignored"),
]


@pytest.mark.parametrize("change", BENIGN)
def test_what_openai_accepts_is_answered(served: Served, change: dict[str, Any]) -> None:
    body = _with({"model": MODEL, "messages": CHAT, "max_tokens": 2}, change)
    extra = {k: body.pop(k) for k in ("unknown_field", "tools") if k in body}
    with hostile(served):
        answer = served.client.chat.completions.create(**body, extra_body=extra or None)
        assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens == 2


# --- the content type -------------------------------------------------------------------------------------------

GOOD_BODY = json.dumps({"model": MODEL, "prompt": "keys", "max_tokens": 2}).encode()
CONTENT_TYPES = [
    pytest.param(None, GOOD_BODY, id="no-content-type"),
    pytest.param("text/plain", GOOD_BODY, id="text-plain"),
    pytest.param("text/plain;charset=UTF-8", GOOD_BODY, id="text-plain-charset"),
    pytest.param("application/x-www-form-urlencoded", b"prompt=keys&max_tokens=2", id="form"),
    pytest.param(
        "multipart/form-data; boundary=x",
        b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nkeys\r\n--x--\r\n',
        id="multipart",
    ),
    pytest.param("application/xml", b"<request><prompt>keys</prompt></request>", id="xml"),
    pytest.param("application/json; charset=latin-1", GOOD_BODY, id="json-latin1"),
    pytest.param("application/jsonp", GOOD_BODY, id="jsonp"),
    pytest.param("application/json-patch+json", GOOD_BODY, id="json-patch"),
    pytest.param("", GOOD_BODY, id="empty-content-type"),
]


@pytest.mark.parametrize(("kind", "content"), CONTENT_TYPES)
def test_a_body_that_is_not_declared_json_is_415(served: Served, kind: str | None, content: bytes) -> None:
    headers = dict(AUTH) if kind is None else {**AUTH, "content-type": kind}
    with hostile(served):
        answer = post_raw(served, "/v1/completions", content, headers)
        error = assert_refusal(answer.status_code, answer.content, 415, None, ("Content-Type", "application/json"))
        assert error["code"] == "unsupported_media_type" and answer.headers["connection"] == "close"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "gzip, gzip"])
def test_a_compressed_body_is_415_never_inflated(served: Served, encoding: str) -> None:
    import gzip

    bomb = gzip.compress(b"{" + b" " * (64 << 20) + b"}")  # 64 MiB of JSON whitespace in ~64 kB
    headers = {**JSON_TYPE, "content-encoding": encoding}
    with hostile(served, memory_mb=16):
        answer = post_raw(served, "/v1/completions", bomb, headers)
        assert_refusal(answer.status_code, answer.content, 415, None, ("Content-Encoding", "uncompressed"))


def test_json_with_its_charset_in_any_case_is_answered(served: Served) -> None:
    headers = {**AUTH, "content-type": 'Application/JSON ; Charset="UTF-8"'}
    with hostile(served):
        answer = post_raw(served, "/v1/completions", GOOD_BODY, headers)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


# --- the API key guards every path but /health -----------------------------------------------------------------

GUARDED = [
    pytest.param("GET", "/docs", {}, id="docs"),
    pytest.param("GET", "/redoc", {}, id="redoc"),
    pytest.param("GET", "/openapi.json", {}, id="openapi"),
    pytest.param("GET", "/metrics", {}, id="metrics"),
    pytest.param("GET", "/v1/models", {"authorization": "Bearer wrong"}, id="models-wrong-key"),
    pytest.param("GET", "/v1/models", {"authorization": f"Bearer {KEY}x"}, id="key-with-suffix"),
    pytest.param("GET", "/v1/models", {"authorization": f"Bearer {KEY[:-1]}"}, id="key-prefix"),
    pytest.param("GET", "/v1/models", {"authorization": KEY}, id="key-without-bearer"),
    pytest.param("GET", "/v1/models", {"authorization": f"Basic {KEY}"}, id="key-as-basic"),
    pytest.param("GET", "/v1/models", {"authorization": b"Bearer \xff\xfe"}, id="key-latin1-bytes"),
    pytest.param("GET", "/not-a-path", {}, id="unknown-path"),
    pytest.param("POST", "/v1/completions", {"content-type": "application/json"}, id="completion-no-key"),
]


@pytest.mark.parametrize(("method", "path", "headers"), GUARDED)
def test_every_path_but_health_needs_the_key(served: Served, method: str, path: str, headers: dict[str, str]) -> None:
    with hostile(served):
        answer = httpx.request(method, f"{served.live.base}{path}", headers=headers, content=GOOD_BODY, timeout=10)
        error = assert_refusal(answer.status_code, answer.content, 401, None, ("API key",))
        assert error["type"] == "authentication_error"


def test_health_needs_no_key_and_the_rest_opens_with_it(served: Served) -> None:
    with hostile(served):
        assert httpx.get(f"{served.live.base}/health", timeout=10).json() == {"status": "ready"}
        assert "llmplan_slots 2.0" in httpx.get(f"{served.live.base}/metrics", headers=AUTH, timeout=10).text
        assert httpx.get(f"{served.live.base}/openapi.json", headers=AUTH, timeout=10).json()["info"]["title"]


def test_the_key_is_compared_in_constant_time(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every check compares two SHA-256 digests with `secrets.compare_digest`: constant time, and equal lengths
    whatever the client sent (compare_digest returns at once on a length mismatch, which would time the key's
    length)."""
    from llmplan.commands.serve import http_guard

    compared: list[tuple[int, int, bool]] = []
    real = http_guard.secrets.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        same = real(a, b)
        compared.append((len(a), len(b), same))
        return same

    monkeypatch.setattr(http_guard.secrets, "compare_digest", spy)
    tries = [b"", b"B", b"Bearer " + KEY.encode()[:-1], b"Bearer " + KEY.encode() + b"x", b"B" * 8000]
    with hostile(served):
        for given in tries:
            answer = httpx.get(f"{served.live.base}/v1/models", headers={"authorization": given}, timeout=10)
            assert answer.status_code == 401
        right = httpx.get(f"{served.live.base}/v1/models", headers=AUTH, timeout=10)
        assert right.status_code == 200
    wrong, good = compared[: len(tries)], compared[len(tries) : len(tries) + 1]
    assert all(a == b == 32 and not same for a, b, same in wrong), wrong
    assert good == [(32, 32, True)]


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("", id="empty"),
        pytest.param("two words", id="space"),
        pytest.param("clé-secrète", id="non-ascii"),
        pytest.param("key\n", id="newline"),
        pytest.param("k" * 257, id="257-chars"),
    ],
)
def test_a_key_no_client_can_send_is_refused_at_start(
    served: Served, key: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    with hostile(served):
        refused(["serve", str(served.plan), "--api-key", key, "--set", f"runs_dir={runs}"], capsys, names=["--api-key"])
    assert not runs.exists()  # refused before the plan made a run directory


def test_metric_labels_stay_a_fixed_set(served: Served) -> None:
    def series() -> set[str]:
        text = httpx.get(f"{served.live.base}/metrics", headers=AUTH, timeout=10).text
        return {line.split(" ")[0] for line in text.splitlines() if line.startswith("llmplan_requests_total{")}

    with hostile(served, seconds=30):
        before = series()
        big = {**JSON_TYPE, "content-length": str(LIMIT + 1)}
        with httpx.Client(timeout=10) as http:
            for i in range(100):
                http.get(f"{served.live.base}/v1/random-{i}")  # 401 (no key)
                http.get(f"{served.live.base}/v1/models/{i}", headers=AUTH)  # 404
                with contextlib.suppress(httpx.TransportError):  # 413 before the body: the server closes
                    http.post(f"{served.live.base}/v1/x{i}", headers=big, content=b"{}" + b" " * (LIMIT - 1))
        after = series()
        grown = after - before
        assert len(grown) <= 3, grown  # at most endpoint="other" with 401, 404 and 413
        labels = {part.split('"')[1] for s in after for part in s.split(",") if part.lstrip("{").startswith("endpoint")}
        assert labels <= {*ENDPOINTS, "other"}, labels


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        pytest.param("GET", "/v1/completions", 405, id="get-on-post-route"),
        pytest.param("DELETE", "/v1/models", 405, id="delete-models"),
        pytest.param("GET", "/v1/chat/completion", 404, id="misspelt-path"),
        pytest.param("GET", "/%ff%fe", 404, id="percent-garbage-path"),
    ],
)
def test_wrong_method_or_path_is_openai_shaped(served: Served, method: str, path: str, status: int) -> None:
    with hostile(served):
        answer = httpx.request(method, f"{served.live.base}{path}", headers=AUTH, timeout=10)
        assert_refusal(answer.status_code, answer.content, status, None)


# --- bytes that are not a well-formed HTTP request: raw sockets ----------------------------------------------


@dataclass
class Exchange:
    data: bytes
    closed: bool
    seconds: float

    @property
    def status(self) -> int | None:
        if not self.data.startswith(b"HTTP/1.1 "):
            return None
        return int(self.data[9:12])

    @property
    def body(self) -> bytes:
        return self.data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in self.data else b""


def exchange(served: Served, parts: list[bytes | float], wait_s: float = 5.0) -> Exchange:
    """Send the parts (a float: pause that long), then read until the server closes (or `wait_s` passes)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", served.port), timeout=wait_s) as sock:
        for part in parts:
            if isinstance(part, float):
                time.sleep(part)
                continue
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server closed mid-send: what it said is still to be read
        data, closed = b"", False
        sock.settimeout(wait_s)
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    closed = True
                    break
                data += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            closed = True
    return Exchange(data, closed, time.monotonic() - start)


def request_head(length: int | None = None, extra: str = "", path: str = "/v1/completions") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY}\r\n"
    )
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + extra + "\r\n").encode()


def test_a_body_shorter_than_its_content_length_is_408(served: Served) -> None:
    with hostile(served):
        got = exchange(served, [request_head(len(GOOD_BODY) + 50) + GOOD_BODY])
        assert got.closed and got.seconds < BODY_S + 3
        error = assert_refusal(got.status or 0, got.body, 408, None, ("did not arrive",))
        assert error["code"] == "request_timeout"


def test_expect_100_continue_then_no_body_is_408(served: Served) -> None:
    with hostile(served):
        got = exchange(served, [request_head(len(GOOD_BODY), "Expect: 100-continue\r\n")])
        assert got.closed and got.data.startswith(b"HTTP/1.1 100 ")  # asked for the body, then gave up on it
        assert b"HTTP/1.1 408 " in got.data and got.seconds < BODY_S + 3


def test_a_client_gone_mid_body_leaves_nothing_behind(served: Served) -> None:
    with hostile(served):
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
            sock.sendall(request_head(len(GOOD_BODY)) + GOOD_BODY[:10])
            time.sleep(0.1)
        time.sleep(
            BODY_S + 0.3
        )  # past the body deadline: the gate has seen the disconnect, sent nothing, logged nothing


def test_a_mib_of_small_values_is_parsed_in_bounded_time(served: Served) -> None:
    body = b'{"model": "hostile", "prompt": "keys", "max_tokens": 2, "junk": [' + b"0," * 500_000 + b"0]}"
    assert len(body) <= LIMIT
    with hostile(served, seconds=8):
        start = time.monotonic()
        answer = post_raw(served, "/v1/completions", body)
        assert answer.status_code == 200 and time.monotonic() - start < 5


def test_two_hundred_thousand_prompts_are_refused_before_any_work(served: Served) -> None:
    body = json.dumps({"model": MODEL, "prompt": ["a"] * 200_000, "max_tokens": 2}).encode()
    assert len(body) <= LIMIT
    with hostile(served, memory_mb=32):
        answer = post_raw(served, "/v1/completions", body)
        assert_refusal(answer.status_code, answer.content, 400, "prompt", ("200000 choices",))


def test_a_prompt_of_a_mib_is_refused_for_its_length(served: Served) -> None:
    """Refused by the tokenize stage after encoding (the tokenizer's own objects take ~110-160 MiB for 140k
    tokens): bounded by the body limit, not by the context."""
    body = json.dumps({"model": MODEL, "prompt": "layers " * 140_000, "max_tokens": 2}).encode()
    assert len(body) <= LIMIT
    with hostile(served, seconds=20, memory_mb=256):
        answer = post_raw(served, "/v1/completions", body)
        error = assert_refusal(answer.status_code, answer.content, 400, None, ("prompt has", "limit is"))
        assert len(error["message"]) < 300


def test_a_trickling_body_is_cut_at_the_deadline(served: Served) -> None:
    trickle: list[bytes | float] = [request_head(len(GOOD_BODY))]
    for byte in GOOD_BODY:
        trickle += [bytes([byte]), 0.05]
    with hostile(served):
        got = exchange(served, trickle)
        assert got.closed and got.status == 408


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param([b"GETX" + bytes(range(0x21, 0x7F)) * 3], id="binary-no-line-end"),
        pytest.param([b"POST /v1/compl"], id="partial-request-line"),
        pytest.param([b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"], id="headers-never-end"),
        pytest.param([b"P", 0.3, b"O", 0.3, b"S", 0.3, b"T", 0.3, b" ", 0.3, b"/"], id="slowloris-request-line"),
        pytest.param(
            [b"GET /health HTTP/1.1\r\n", 0.3, b"X-a: 1\r\n", 0.3, b"X-b: 2\r\n", 0.3, b"X-c: 3\r\n"],
            id="slowloris-headers",
        ),
    ],
)
def test_a_request_that_never_completes_its_headers_gets_a_bounded_close(served: Served, parts: list) -> None:
    with hostile(served):
        got = exchange(served, parts)
        assert got.closed, "the connection was held open"
        assert got.seconds < HEADER_S + 2.5
        assert_refusal(got.status or 0, got.body, 408, None, ("headers",))


def test_a_get_with_an_endless_body_is_answered_then_closed(served: Served) -> None:
    """The body of a GET is never read; the connection is closed at the header deadline of the next request
    (uvicorn alone would read and discard it for as long as it came)."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n"
    parts: list[bytes | float] = [head]
    for _ in range(8):
        parts += [b"x" * 65536, 0.2]
    with hostile(served):
        got = exchange(served, parts)
        assert got.status == 200 and got.closed and got.seconds < HEADER_S + 4


def test_an_idle_connection_is_closed(served: Served) -> None:
    with hostile(served):
        got = exchange(served, [])
        assert got.closed and got.data == b"" and got.seconds < HEADER_S + 2.5


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n", id="tls-hello-to-http"
        ),
        pytest.param(request_head(None, "Content-Length: abc\r\n") + b"{}", id="content-length-letters"),
        pytest.param(request_head(None, "Content-Length: -1\r\n") + b"{}", id="content-length-negative"),
        pytest.param(
            request_head(None, "Content-Length: 2\r\nContent-Length: 3\r\n") + b"{}", id="content-length-twice"
        ),
        pytest.param(request_head(None, "Content-Length: " + "9" * 5000 + "\r\n"), id="content-length-5000-digits"),
        pytest.param(
            request_head(None, "Transfer-Encoding: chunked\r\n") + b"zz\r\n{}\r\n0\r\n\r\n", id="bad-chunk-size"
        ),
        pytest.param(request_head(None, "Transfer-Encoding: gzip\r\n") + b"{}", id="unknown-transfer-encoding"),
        pytest.param(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: x\r\n\r\n", id="space-in-header-name"),
        pytest.param(b"GET /health\xff HTTP/1.1\r\nHost: x\r\n\r\n", id="non-ascii-target"),
        pytest.param(b"GET /health HTTP/1.1\r\n\r\n", id="no-host-header"),
        pytest.param(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", id="http2-preface"),
        pytest.param(b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", id="http-9-9"),
        pytest.param(b"\x00\x01\x02\x03\xff\xfe" * 100, id="binary-rejected-at-once"),
    ],
)
def test_what_is_not_http_gets_a_400_and_a_close(served: Served, raw: bytes) -> None:
    with hostile(served):
        got = exchange(served, [raw])
        assert got.closed and got.seconds < HEADER_S + 2.5
        error = assert_refusal(got.status or 0, got.body, 400, None)
        assert error["code"] == "malformed_request"
        if error["message"].startswith("malformed HTTP request"):  # h11's refusal: uvicorn's warning was seen
            assert any("Invalid HTTP request" in r.getMessage() for r in served.log.records)


HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
OVERSIZED = [
    pytest.param(HEAD + b"X-Big: " + b"a" * 20_000 + b"\r\n\r\n", id="one-header-20k"),
    pytest.param(HEAD + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 80) for i in range(300)) + b"\r\n", id="300-headers"),
    pytest.param(b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", id="request-line-20k"),
    pytest.param(b"GET /v1/models?" + b"q=1&" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", id="query-20k"),
    pytest.param(
        HEAD + b"Cookie: " + b"c" * 15_000 + b"\r\nX-More: " + b"m" * 3000 + b"\r\n\r\n", id="cookie-and-more"
    ),
]


@pytest.mark.parametrize("raw", OVERSIZED)
def test_headers_over_16_kib_are_431(served: Served, raw: bytes) -> None:
    with hostile(served):
        got = exchange(served, [raw])
        assert got.closed
        assert_refusal(got.status or 0, got.body, 431, None, ("16 KiB",))


def test_headers_trickling_past_16_kib_are_cut_there(served: Served) -> None:
    parts: list[bytes | float] = [HEAD]
    for i in range(200):  # 200 headers of 1 kB, sent one by one: h11 holds at most 16 KiB of them
        parts += [b"X-%d: %s\r\n" % (i, b"v" * 1000), 0.001]
    with hostile(served):
        got = exchange(served, parts)
        assert got.closed
        assert_refusal(got.status or 0, got.body, 400, None, ("16 KiB",))


def test_content_length_and_chunks_together_are_refused(served: Served) -> None:
    smuggled = b'{"prompt": "keys", "max_tokens": 2}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(smuggled), smuggled)
    with hostile(served):
        got = exchange(served, [request_head(5, "Transfer-Encoding: chunked\r\n") + chunked])
        assert got.closed
        assert_refusal(got.status or 0, got.body, 400, None, ("Content-Length", "Transfer-Encoding"))


def test_a_declared_length_over_the_limit_is_refused_before_reading(served: Served) -> None:
    with hostile(served):
        got = exchange(served, [request_head(1 << 40)])  # nothing of the body is ever sent
        assert got.closed and got.seconds < 2
        assert_refusal(got.status or 0, got.body, 413, None, ("over",))


def test_a_64_mib_chunked_body_stops_at_the_limit(served: Served) -> None:
    """The old server read all 64 MiB (RSS +124 MiB) before answering 413; now it stops at the first chunk past
    1 MiB and closes, so memory stays near the limit and the rest of the body is never read."""
    chunk = b"x" * 65536
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    parts: list[bytes | float] = [request_head(None, "Transfer-Encoding: chunked\r\n")]
    parts += [framed] * 1024 + [b"0\r\n\r\n"]  # 64 MiB, sent as the server takes it
    with hostile(served, seconds=20, memory_mb=16):
        got = exchange(served, parts)
        assert got.closed
        assert_refusal(got.status or 0, got.body, 413, None, ("over",))


def test_pipelined_requests_after_a_refusal_are_not_read(served: Served) -> None:
    """A refusal closes the connection: a request smuggled behind a refused body is never answered."""
    refused = request_head(2).replace(b"application/json", b"text/plain") + b"{}"
    behind = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    with hostile(served):
        got = exchange(served, [refused + behind])
        assert got.closed and got.data.count(b"HTTP/1.1 ") == 1 and got.status == 415


def test_a_normal_stream_after_all_this(served: Served) -> None:
    with hostile(served):
        parts = list(served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True))
        assert [p.choices[0].finish_reason for p in parts if p.choices and p.choices[0].finish_reason] == ["length"]
        assert parts[0].choices[0].delta.role == "assistant"
