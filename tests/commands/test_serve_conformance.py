"""`llmplan serve` as OpenAI's clients see it: the real `openai` SDK, and every body checked against the SDK's
own models key for key (openai_shapes.py). One server for the module (a tiny fp32 model on 4 slots).
"""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from llmplan.commands.serve.app import Answering, ServerMetrics, ServerSettings, create_app
from llmplan.commands.serve.openai_api import CompletionRequest, chat_logprobs, completion_logprobs
from llmplan.commands.serve.request_body import validate

from .conftest import LiveServer, write_serve_plan
from .openai_shapes import conforms, conforms_event, stream_bodies

CHAT = [{"role": "user", "content": "Hello model, tokens and layers."}]
PLAN = "conform"


CONTEXT = 2048
ACCESS_LOG = io.StringIO()
PLAN_MAX_NEW = 40


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("conform")
    model_dir = root / "tiny-conform"
    shutil.copytree(tiny_model, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    # The plan's penalty is not marked as a serving default: served requests never get it.
    plan = write_serve_plan(root, model_dir, name=PLAN, context=CONTEXT, repetition_penalty=1.3)
    with LiveServer(plan, ServerSettings(max_queue=32, access_log=ACCESS_LOG)) as server:
        yield server


def sdk(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)


def post(live: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST `body`; every body that comes back (one, or each chunk of a stream) checked against OpenAI's shape."""
    kind = "chat.completion" if path == "/chat/completions" else "text_completion"
    if not body.get("stream"):
        answer = httpx.post(f"{live.url}{path}", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        made = answer.json()
        conforms(kind, made)
        return [made]
    with httpx.stream("POST", f"{live.url}{path}", json=body, timeout=60) as answer:
        assert answer.status_code == 200, answer.read()
        chunks = stream_bodies(list(answer.iter_lines()))
    for chunk in chunks:
        conforms(kind + ".chunk", chunk)
    return chunks


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"n": 2, "temperature": 1.0, "seed": 5},
        {"stop": ["e"], "max_tokens": 12},
        {"logprobs": True, "top_logprobs": 2},
    ],
    ids=["plain", "n-seed", "stop", "logprobs"],
)
def test_chat_bodies_have_openai_shapes(live: LiveServer, stream: bool, extra: dict[str, Any]) -> None:
    body = {"model": PLAN, "messages": CHAT, "max_tokens": 6, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    before = int(time.time())
    bodies = post(live, "/chat/completions", body)
    for made in bodies:
        assert before - 1 <= made["created"] <= time.time() + 1  # `created` in every body and chunk
    if not stream:
        message = bodies[0]["choices"][0]["message"]
        assert message["refusal"] is None and len(bodies[0]["choices"]) == extra.get("n", 1)
    else:
        assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "extra", [{}, {"n": 2, "temperature": 1.0, "seed": 5}, {"logprobs": 2}, {"prompt": ["keys", "layers"]}]
)
def test_completion_bodies_have_openai_shapes(live: LiveServer, stream: bool, extra: dict[str, Any]) -> None:
    body = {"model": PLAN, "prompt": "The cache keeps", "max_tokens": 5, "stream": stream, **extra}
    bodies = post(live, "/completions", body)
    assert all(isinstance(made["created"], int) for made in bodies)


def test_the_sdk_reads_created_and_the_model(live: LiveServer) -> None:
    c = sdk(live)
    chat = c.chat.completions.create(model=PLAN, messages=CHAT, max_tokens=3)
    assert chat.created > 0 and chat.model == PLAN
    for chunk in c.completions.create(model=PLAN, prompt="keys", max_tokens=3, stream=True):
        assert chunk.created > 0


@pytest.mark.parametrize("name", ["gpt-4o-mini", "gpt-3.5-turbo-instruct", "davinci-002", "x/y:latest"])
def test_any_model_name_is_answered_by_this_model(live: LiveServer, name: str) -> None:
    c = sdk(live)
    assert c.chat.completions.create(model=name, messages=CHAT, max_tokens=2).model == name
    assert c.completions.create(model=name, prompt="keys", max_tokens=2).model == name
    assert c.models.retrieve(name).id == name


def test_models_name_the_model_itself_with_the_plan_as_metadata(live: LiveServer) -> None:
    listed = httpx.get(f"{live.url}/models", timeout=10).json()
    assert listed["object"] == "list" and len(listed["data"]) == 1
    entry = listed["data"][0]
    conforms("model", entry)
    model_dir = live.host.context.model_source.model_dir
    assert entry["id"] == model_dir.name and entry["id"] != PLAN  # the model's own name, not the plan's
    assert entry["llmplan"]["plan"] == PLAN and PLAN in entry["llmplan"]["aliases"]
    one = httpx.get(f"{live.url}/models/{entry['id']}", timeout=10).json()
    assert conforms("model", one).id == entry["id"]


def test_strict_model_refuses_other_names(live: LiveServer) -> None:
    strict = TestClient(create_app(live.host, ServerSettings(strict_model=True)))
    model_id = live.host.context.model_source.model_dir.name
    for name in (model_id, PLAN):  # the id and its aliases
        answer = strict.post("/v1/completions", json={"model": name, "prompt": "keys", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
    refused = strict.post("/v1/completions", json={"model": "gpt-4o-mini", "prompt": "keys", "max_tokens": 2})
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
    conforms("error", refused.json()["error"])
    assert strict.get("/v1/models/gpt-4o-mini").status_code == 404
    assert strict.get(f"/v1/models/{model_id}").json()["id"] == model_id


NULLS = {
    "model": None,
    "n": None,
    "stream": None,
    "stream_options": None,
    "logprobs": None,
    "top_logprobs": None,
    "temperature": None,
    "top_p": None,
    "seed": None,
    "stop": None,
    "max_tokens": None,
    "max_completion_tokens": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "user": None,
}
UNKNOWN = {"metadata": {"run": "a"}, "store": False, "parallel_tool_calls": True, "x_vendor": [1, {"a": None}]}


def test_explicit_nulls_are_absent_and_unknown_fields_ignored(live: LiveServer) -> None:
    plain = post(live, "/chat/completions", {"messages": CHAT, "max_tokens": 4})[0]
    nulled = post(live, "/chat/completions", {"messages": CHAT, **NULLS, **UNKNOWN, "max_tokens": 4})[0]
    assert nulled["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    completion_nulls = {k: v for k, v in NULLS.items() if k not in ("top_logprobs", "max_completion_tokens")}
    body = {"prompt": "keys", **completion_nulls, "echo": None, "max_tokens": 4}
    assert post(live, "/completions", body)[0]["usage"]["completion_tokens"] == 4


def test_a_tool_result_turn_is_rendered_through_the_template(live: LiveServer) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    turns = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, nineteen degrees and a light wind."},
    ]
    c = sdk(live)
    answer = c.chat.completions.create(model=PLAN, messages=turns, max_tokens=3)
    assert answer.choices[0].message.role == "assistant"
    without = c.chat.completions.create(model=PLAN, messages=turns[:1], max_tokens=3)
    # the tool's answer reached the prompt: the template rendered its turn
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens + 8
    streamed = post(live, "/chat/completions", {"messages": turns, "max_tokens": 3, "stream": True})
    assert streamed[-1]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages.1.tool_call_id"),
        ({"role": "assistant", "content": None}, "messages.1.content"),
        ({"role": "user", "content": None}, "messages.1.content"),
    ],
)
def test_an_incomplete_turn_is_refused_by_name(live: LiveServer, message: dict[str, Any], param: str) -> None:
    answer = httpx.post(f"{live.url}/chat/completions", json={"messages": [*CHAT, message]}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    conforms("error", json.loads(answer.text)["error"])


def long_prompt(live: LiveServer, tokens: int) -> str:
    """A raw prompt of exactly `tokens` tokens under the served tokenizer."""
    tok = live.host.context.tokenizer
    ids = tok.encode("layers and tokens " * tokens, add_bos=False)[:tokens]
    text = tok.decode(ids)
    assert len(tok.encode(text, add_bos=False)) >= tokens
    return text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_a_prompt_longer_than_the_context_is_a_400_with_both_numbers(live: LiveServer, path: str, stream: bool) -> None:
    text = long_prompt(live, 3000)
    body: dict[str, Any] = {"max_tokens": 2, "stream": stream}
    body |= {"prompt": text} if path == "/completions" else {"messages": [{"role": "user", "content": text}]}
    answer = httpx.post(f"{live.url}{path}", json=body, timeout=60)  # streamed too: a status, before any byte
    assert answer.status_code == 400, answer.text[:300]
    error = conforms("error", answer.json()["error"])
    assert "prompt has 3" in error.message and f"the limit is {CONTEXT - 1}" in error.message
    assert answer.headers["content-type"].startswith("application/json")


def test_truncation_asked_explicitly_keeps_the_end(live: LiveServer) -> None:
    body = {"prompt": long_prompt(live, 3000), "max_tokens": 2, "truncate_prompt_tokens": 100}
    assert post(live, "/completions", body)[0]["usage"]["prompt_tokens"] == 100


def test_max_tokens_defaults_to_the_plan_and_may_go_up_to_the_context(live: LiveServer) -> None:
    c = sdk(live)
    plain = c.completions.create(model=PLAN, prompt="keys", extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == PLAN_MAX_NEW
    more = c.completions.create(
        model=PLAN, prompt="keys", max_tokens=PLAN_MAX_NEW + 60, extra_body={"ignore_eos": True}
    )
    assert more.usage.completion_tokens == PLAN_MAX_NEW + 60
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model=PLAN, prompt="keys", max_tokens=CONTEXT)
    assert refused.value.param == "max_tokens" and str(CONTEXT - 1) in refused.value.message


def test_greedy_is_greedy_whatever_the_plan_samples_with(live: LiveServer) -> None:
    body = {"messages": CHAT, "max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    content = post(live, "/chat/completions", body)[0]["choices"][0]["logprobs"]["content"]
    assert len(content) > 10
    for item in content:  # the plan's repetition_penalty 1.3 would pick other tokens than the top one
        assert (
            item["token"] == item["top_logprobs"][0]["token"] and item["logprob"] == item["top_logprobs"][0]["logprob"]
        )


def test_omitted_sampling_fields_take_the_api_defaults(live: LiveServer) -> None:
    service = Answering(live.host, ServerSettings(), ServerMetrics(live.host))
    body = validate(CompletionRequest, {"prompt": "keys", "top_k": 3})
    overrides = service._jobs(body)[0][live.host.generate_id]
    # the plan's repetition penalty is not marked: OpenAI's default (off); its temperature is marked: the plan's
    assert overrides["repetition_penalty"] == 1.0 and overrides["top_k"] == 3 and overrides["stop"] == []
    assert "temperature" not in overrides and "max_new_tokens" not in overrides  # the plan's 0 and its 40
    unmarked = validate(CompletionRequest, {"prompt": "keys"})
    service.defaults = {**service.defaults, "temperature": 1.0}  # as a plan that marks nothing
    assert service._jobs(unmarked)[0][live.host.generate_id]["temperature"] == 1.0
    service.executor.shutdown()


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/v1/nowhere", {}, 404),
        ("DELETE", "/v1/models", {}, 405),
        ("GET", "/v1/chat/completions", {}, 405),
        ("POST", "/v1/completions", {"content-type": "text/plain"}, 415),
    ],
)
def test_every_route_answers_errors_in_openai_shape(
    live: LiveServer, method: str, path: str, headers: dict[str, str], status: int
) -> None:
    answer = httpx.request(method, f"{live.base}{path}", headers=headers, content=b"{}", timeout=10)
    assert answer.status_code == status and set(answer.json()) == {"error"}, answer.text
    conforms("error", answer.json()["error"])


def test_metrics_need_the_key_unless_opened(live: LiveServer) -> None:
    keyed = TestClient(create_app(live.host, ServerSettings(api_key="k3y", access_log=None)))
    refused = keyed.get("/metrics")
    assert refused.status_code == 401 and conforms("error", refused.json()["error"]).type == "authentication_error"
    assert "llmplan_slots" in keyed.get("/metrics", headers={"authorization": "Bearer k3y"}).text
    opened = TestClient(create_app(live.host, ServerSettings(api_key="k3y", open_metrics=True, access_log=None)))
    assert opened.get("/metrics").status_code == 200 and opened.get("/v1/models").status_code == 401


def test_one_access_log_line_per_request(live: LiveServer) -> None:
    before = len(ACCESS_LOG.getvalue().splitlines())
    post(live, "/completions", {"prompt": "keys", "max_tokens": 2, "stream": True})
    httpx.get(f"{live.base}/v1/nowhere?api_key=secret", timeout=10)
    # The line is written once the response has gone out: the client may read its answer first.
    deadline = time.monotonic() + 10
    while len(ACCESS_LOG.getvalue().splitlines()) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    lines = [json.loads(line) for line in ACCESS_LOG.getvalue().splitlines()[before:]]
    assert [(e["event"], e["method"], e["path"], e["status"]) for e in lines] == [
        ("http_request", "POST", "/v1/completions", 200),
        ("http_request", "GET", "/v1/nowhere", 404),  # the query string (a key, maybe) is not logged
    ]
    assert lines[0]["bytes"] > 100 and lines[0]["ms"] > 0 and "timestamp" in lines[0]


def test_logprobs_never_hold_special_tokens_text(live: LiveServer) -> None:
    tok = live.host.context.tokenizer
    word = tok.encode("keys", add_bos=False)
    ids = [*word, tok.eos_id]
    top = [[(tok.eos_id, -0.5), (word[0], -1.0)] for _ in ids]
    chat = chat_logprobs(tok, ids, [-0.1] * len(ids), top)["content"]
    assert len(chat) == len(word) and "".join(e["token"] for e in chat) == "keys"
    assert all(alt["token"] in ("", tok.decode([word[0]])) for e in chat for alt in e["top_logprobs"])
    legacy = completion_logprobs(tok, ids, [-0.1] * len(ids), top)
    assert "".join(legacy["tokens"]) == "keys" and all(len(t) == 1 for t in legacy["top_logprobs"])


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_streamed_logprobs_equal_the_whole_answers(live: LiveServer, path: str) -> None:
    chat = path == "/chat/completions"
    asked = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    body = {"max_tokens": 8, "temperature": 0, **asked, **({"messages": CHAT} if chat else {"prompt": "keys"})}
    whole = post(live, path, body)[0]["choices"][0]["logprobs"]
    chunks = post(live, path, body | {"stream": True})
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    if chat:
        assert [e for p in parts for e in p["content"]] == whole["content"] and len(whole["content"]) == 8
    else:
        assert [t for p in parts for t in p["tokens"]] == whole["tokens"] and len(whole["tokens"]) == 8


def test_suffix_is_refused_by_name(live: LiveServer) -> None:
    answer = httpx.post(f"{live.url}/completions", json={"prompt": "keys", "suffix": " end."}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "suffix", answer.text
    empty = {"prompt": "keys", "suffix": "", "max_tokens": 2}  # nothing asked
    assert post(live, "/completions", empty)[0]["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_logit_bias_is_honoured(live: LiveServer, path: str) -> None:
    tok = live.host.context.tokenizer
    forced = tok.encode(" keys", add_bos=False)[-1]
    prompt = {"messages": CHAT} if path == "/chat/completions" else {"prompt": "The cache keeps"}
    greedy = {**prompt, "max_tokens": 6, "temperature": 0, "extra": 1}
    plain = post(live, path, greedy)[0]
    pushed = post(live, path, {**greedy, "logit_bias": {str(forced): 100}})[0]
    text = pushed["choices"][0].get("text") or pushed["choices"][0]["message"]["content"]
    assert text == tok.decode([forced] * 6)  # +100: that token every time
    first = tok.encode(plain["choices"][0].get("text") or plain["choices"][0]["message"]["content"], add_bos=False)[0]
    banned = post(live, path, {**greedy, "logit_bias": {str(first): -100}})[0]
    again = banned["choices"][0].get("text") or banned["choices"][0]["message"]["content"]
    assert tok.encode(again, add_bos=False)[:1] != [first]  # -100: never that token


@pytest.mark.parametrize(
    ("bias", "says"), [({"x": 1}, "token ids"), ({"5": 101}, "[-100, 100]"), ({"99999999": 1}, "vocabulary")]
)
def test_a_bad_logit_bias_is_refused_by_name(live: LiveServer, bias: dict[str, float], says: str) -> None:
    answer = httpx.post(f"{live.url}/completions", json={"prompt": "keys", "logit_bias": bias}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "logit_bias", answer.text
    assert says in answer.json()["error"]["message"]


def test_slots_size_the_kv_cache(tiny_model: Path, tmp_path: Path) -> None:
    from llmplan.commands.serve.command import build_host

    plan = write_serve_plan(tmp_path, tiny_model, name="slotted", slots=1)
    host = build_host(str(plan), [], keep_alive_s=None, run_dir=tmp_path / "run", slots=3)
    try:
        host.load()
        assert host.scheduler is not None and host.scheduler.cache.slots == 3
    finally:
        host.close()


def test_slots_default_to_what_the_memory_allows_unless_the_plan_sets_them(tiny_model: Path, tmp_path: Path) -> None:
    from llmplan.commands.serve.command import build_host
    from llmplan.commands.serve.slot_sizing import MAX_AUTO_SLOTS, auto_slots
    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover

    chosen = write_serve_plan(tmp_path, tiny_model, name="chosen", slots=2)
    free = tmp_path / "free.yaml"  # the same plan without place.max_batch
    free.write_text(chosen.read_text().replace("max_batch: 2,", "").replace("max_batch: 2", ""))
    assert "max_batch" not in free.read_text()
    assert auto_slots(load_plan(str(chosen), discover(), [])) is None  # the plan's choice stands
    choice = auto_slots(load_plan(str(free), discover(), []))
    assert choice is not None and choice.slots == MAX_AUTO_SLOTS  # a tiny model's cache: the cap
    assert "quarter" in choice.why and "128 tokens" in choice.why
    host = build_host(str(free), [], keep_alive_s=None, run_dir=tmp_path / "run", slots="auto")
    try:
        host.load()
        assert host.scheduler is not None and host.scheduler.cache.slots == MAX_AUTO_SLOTS
    finally:
        host.close()


def test_responses_answer_text_in_openai_shapes(live: LiveServer) -> None:
    c = sdk(live)
    chat = c.chat.completions.create(
        model=PLAN,
        messages=[{"role": "system", "content": "Be brief."}, *CHAT],
        max_tokens=6,
        temperature=0,
    )
    made = httpx.post(
        f"{live.url}/responses",
        json={"model": PLAN, "input": CHAT[0]["content"], "instructions": "Be brief.", "max_output_tokens": 6},
        timeout=60,
    )
    assert made.status_code == 200, made.text
    response = conforms("response", made.json())
    assert response.output_text == chat.choices[0].message.content  # the same chat underneath
    assert response.usage.input_tokens == chat.usage.prompt_tokens and response.usage.output_tokens == 6
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    parts = [{"type": "input_text", "text": CHAT[0]["content"]}]
    again = c.responses.create(
        model=PLAN,
        input=[{"role": "user", "content": parts}],
        instructions="Be brief.",
        max_output_tokens=6,
        temperature=0,
    )
    assert again.output_text == response.output_text and again.created_at > 0


def test_responses_stream_their_events(live: LiveServer) -> None:
    body = {"model": PLAN, "input": "keys and layers", "max_output_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{live.url}/responses", json=body, timeout=60) as answer:
        assert answer.status_code == 200
        lines = list(answer.iter_lines())
    events = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]
    for e in events:
        conforms_event(e)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == events[-1]["response"]["output"][0]["content"][0]["text"]
    streamed = sdk(live).responses.create(model=PLAN, input="keys and layers", max_output_tokens=5, stream=True)
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == deltas


def test_the_sdk_end_to_end_with_every_field_at_once(live: LiveServer) -> None:
    """The `openai` client's own calls (raw bodies checked too): n, stop, seed, logprobs, logit_bias,
    stream_options, explicit nulls and unknown fields together, on chat and completions, whole and streamed."""
    c = sdk(live)
    tok = live.host.context.tokenizer
    ban = tok.encode(" the", add_bos=False)[-1]
    fields = dict(n=2, seed=11, temperature=0.8, stop=["\n\n"], logit_bias={str(ban): -100}, max_tokens=6)
    extra = {"user": None, "x_vendor": {"a": 1}}
    raw = c.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=CHAT, logprobs=True, top_logprobs=2, extra_body=extra, **fields
    )
    conforms("chat.completion", json.loads(raw.text))
    chat = raw.parse()
    assert len(chat.choices) == 2 and all(len(ch.logprobs.content) <= 6 for ch in chat.choices)
    assert all(ban not in tok.encode(ch.message.content or "", add_bos=False) for ch in chat.choices)
    again = c.chat.completions.create(model="gpt-4o-mini", messages=CHAT, extra_body=extra, **fields)
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in chat.choices]  # seed
    chunks = list(
        c.completions.create(
            model="davinci-002",
            prompt="keys",
            stream=True,
            stream_options={"include_usage": True},
            logprobs=1,
            **fields,
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    texts = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in (0, 1)}
    whole = c.completions.create(model="davinci-002", prompt="keys", **fields)
    assert [texts[0], texts[1]] == [ch.text for ch in whole.choices]  # streamed = whole, choice by choice


def test_an_imported_gguf_is_named_by_its_file_not_the_cache_directory(tmp_path: Path) -> None:
    from llmplan.commands.serve.model_card import model_card
    from llmplan.stages.types import ModelSource

    imported = tmp_path / "b179c9523d0e6a0f-f2-Model.Q8_0"  # the importer's cache directory
    source = ModelSource(imported, "package", "fp", gguf_file=tmp_path / "Model.Q8_0.gguf")  # unreadable: no name
    card = model_card(source, "my-plan", 0)
    assert card.id == "Model.Q8_0" and card.aliases == ("my-plan",)
    assert card.answers_to("my-plan") and not card.answers_to(imported.name)
