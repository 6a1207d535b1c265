"""`llmplan serve` through the real `openai` client (and raw HTTP where the client hides the status).

The tiny model is fp32 and greedy unless a test says otherwise, so the same request gives the same tokens
however it is scheduled: concurrent answers must equal the answers given one at a time, exactly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmplan.commands.serve.app import ServerSettings

from .conftest import MAX_NEW, LiveServer, free_port, hold_after, write_serve_plan

CHAT = [{"role": "user", "content": "Hello model, tokens and layers."}]
PROMPTS = [
    "A language model turns a prompt into text.",
    "The cache keeps keys and values.",
    "Hello world, hello model.",
    "注意力机制 看 每个 词。",
    "one token at a time",
    "keys",
    "Hello tokens and layers, hello cache.",
    "言語モデルは文章を作ります。",
]


def client(live: LiveServer, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url, api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60, **kw)


def test_chat_and_completions_in_openai_shapes(served: LiveServer) -> None:
    c = client(served)
    chat = c.chat.completions.create(model="tiny-serve", messages=CHAT, max_tokens=12)
    assert chat.object == "chat.completion" and chat.model == "tiny-serve"
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert chat.usage.completion_tokens == 12 and chat.usage.prompt_tokens > 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 12
    text = c.completions.create(model="tiny-serve", prompt="The cache keeps", max_tokens=7)
    assert text.object == "text_completion" and text.choices[0].text and text.usage.completion_tokens == 7
    assert [m.id for m in c.models.list().data] == [served.host.context.model_source.model_dir.name]
    assert httpx.get(f"{served.base}/health").json() == {"status": "ready"}


def test_streamed_chunks_add_up_to_the_answer(served: LiveServer) -> None:
    c = client(served)
    whole = c.chat.completions.create(model="tiny-serve", messages=CHAT, max_tokens=20).choices[0].message.content
    stream = c.chat.completions.create(
        model="tiny-serve", messages=CHAT, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    streamed = list(c.completions.create(model="tiny-serve", prompt="The cache keeps", max_tokens=9, stream=True))
    plain = c.completions.create(model="tiny-serve", prompt="The cache keeps", max_tokens=9).choices[0].text
    assert "".join(ch.choices[0].text for ch in streamed) == plain


def test_eight_concurrent_streams_equal_the_same_requests_one_at_a_time(served: LiveServer) -> None:
    c = client(served)
    alone = [
        c.completions.create(model="tiny-serve", prompt=p, max_tokens=24 + i).choices[0].text
        for i, p in enumerate(PROMPTS)
    ]
    together: dict[int, str] = {}

    def stream(i: int) -> None:
        parts = c.completions.create(model="tiny-serve", prompt=PROMPTS[i], max_tokens=24 + i, stream=True)
        together[i] = "".join(ch.choices[0].text for ch in parts)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [together.get(i) for i in range(len(PROMPTS))] == alone  # 8 clients on 4 slots: queued and joined


def test_stop_seed_and_n(served: LiveServer) -> None:
    c = client(served)
    full = c.completions.create(model="tiny-serve", prompt="Hello world", max_tokens=30).choices[0].text
    stop = full[8:11]
    cut = c.completions.create(model="tiny-serve", prompt="Hello world", max_tokens=30, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]  # OpenAI: the stop is not returned
    parts = c.completions.create(model="tiny-serve", prompt="Hello world", max_tokens=30, stop=[stop], stream=True)
    assert "".join(p.choices[0].text for p in parts) == cut.text  # nor streamed, not even in part
    sampled = dict(model="tiny-serve", messages=CHAT, max_tokens=16, temperature=1.0, n=3, seed=7)
    first = [ch.message.content for ch in c.chat.completions.create(**sampled).choices]
    again = [ch.message.content for ch in c.chat.completions.create(**sampled).choices]
    assert first == again and len(first) == 3  # same seed, same texts
    assert len(set(first)) > 1  # the n choices are sampled apart (each its own seed)
    other = [ch.message.content for ch in c.chat.completions.create(**{**sampled, "seed": 8}).choices]
    assert other != first


def test_logprobs_in_both_shapes(served: LiveServer) -> None:
    c = client(served)
    chat = c.chat.completions.create(model="tiny-serve", messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True) and item.logprob == pytest.approx(tops[0])  # greedy: the best
    text = c.completions.create(model="tiny-serve", prompt="keys", max_tokens=5, logprobs=2).choices[0].logprobs
    assert len(text.tokens) == 5 and len(text.token_logprobs) == 5 and all(len(t) <= 2 for t in text.top_logprobs)
    assert "".join(text.tokens).startswith(text.tokens[0]) and text.text_offset[0] == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": CHAT, "temperature": 5}, 400, "temperature"),
        ({"messages": CHAT, "max_tokens": 128}, 400, "max_tokens"),  # the context is 128: at most 127
        ({"messages": []}, 400, "messages"),
        ({"max_tokens": 3}, 400, "messages"),
        ({"messages": CHAT, "top_k": -1}, 400, "top_k"),
        ({"messages": CHAT, "stop": [""]}, 400, "stop"),
        ({"messages": [{"role": "user", "content": "layers " * 400}]}, 400, None),
    ],
)
def test_bad_requests_name_the_field(served: LiveServer, body: dict, status: int, param: str | None) -> None:
    answer = httpx.post(f"{served.url}/chat/completions", json=body, timeout=30)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param and param in error["message"]
    else:  # the prompt longer than the context: both numbers
        assert "prompt has" in error["message"] and "limit is" in error["message"]


def test_malformed_and_oversized_bodies(served: LiveServer) -> None:
    json_type = {"content-type": "application/json"}  # without it: 415 (tests/trust/test_hostile_server.py)
    bad = httpx.post(f"{served.url}/chat/completions", content=b"{not json", headers=json_type, timeout=30)
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    big = httpx.post(f"{served.url}/completions", content=b"x" * (2 << 20), headers=json_type, timeout=30)
    assert big.status_code == 413


def test_curl_d_without_a_content_type_is_answered_as_json(served: LiveServer) -> None:
    """`curl -d '{...}'` sends its default `application/x-www-form-urlencoded`: a JSON object body is answered
    (as llama-server does); a form body, a browser's request (it sends Origin) and other types stay 415."""
    body = json.dumps({"model": "tiny-serve", "prompt": "The cache keeps", "max_tokens": 5}).encode()
    curl = {"content-type": "application/x-www-form-urlencoded"}
    plain = httpx.post(
        f"{served.url}/completions", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    answer = httpx.post(f"{served.url}/completions", content=body, headers=curl, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    embedded = httpx.post(f"{served.url}/embeddings", content=b'{"input": "keys"}', headers=curl, timeout=30)
    assert embedded.status_code == 200 and len(embedded.json()["data"]) == 1
    refused = {
        "form": (b"prompt=keys&max_tokens=2", curl, "'application/x-www-form-urlencoded'"),
        "browser": (body, {**curl, "origin": "https://example.com"}, "'application/x-www-form-urlencoded'"),
        "text": (body, {"content-type": "text/plain"}, "'text/plain'"),
        "none": (body, {}, "got none"),
    }
    for name, (content, headers, said) in refused.items():
        answer = httpx.post(f"{served.url}/completions", content=content, headers=headers, timeout=30)
        message = answer.json()["error"]["message"]
        assert answer.status_code == 415 and said in message and "application/json" in message, (name, message)


def test_a_client_that_goes_away_frees_its_slot(tiny_model: Path, tmp_path: Path) -> None:
    plan = write_serve_plan(tmp_path, tiny_model, name="tiny-gone")
    with LiveServer(plan, ServerSettings()) as live:
        scheduler = live.host.scheduler
        assert scheduler is not None
        gate = hold_after(live.host.loop, 3)  # the request has tokens out and cannot end by itself
        body = {"prompt": "Hello world", "max_tokens": MAX_NEW, "stream": True}
        with httpx.stream("POST", f"{live.url}/completions", json=body, timeout=30) as answer:
            lines = answer.iter_lines()
            while '"text": ""' in (line := next(lines)) or not line.startswith("data: {"):
                pass  # until the first token's text arrives
            assert scheduler.busy_slots == 1
        time.sleep(0.3)  # the server notices the closed connection
        gate.set()
        deadline = time.monotonic() + 10
        while (scheduler.busy_slots or scheduler.pending) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scheduler.busy_slots == 0 and scheduler.pending == 0 and scheduler.stats.cancelled == 1
        metrics = httpx.get(f"{live.base}/metrics").text
        assert "llmplan_slots_busy 0.0" in metrics and 'status="499"' in metrics


def test_metrics_count_requests_tokens_and_latency(served: LiveServer) -> None:
    client(served).completions.create(model="tiny-serve", prompt="keys", max_tokens=5, stream=True).close()
    client(served).completions.create(model="tiny-serve", prompt="keys", max_tokens=5)
    text = httpx.get(f"{served.base}/metrics").text
    for name in (
        "llmplan_requests_total",
        "llmplan_generation_tokens_total",
        "llmplan_prompt_tokens_total",
        "llmplan_time_to_first_token_seconds_bucket",
        "llmplan_inter_token_latency_seconds_bucket",
        "llmplan_queue_depth",
        "llmplan_kv_cache_usage_ratio",
        "llmplan_slots 4.0",
    ):
        assert name in text, name
    assert 'llmplan_requests_total{endpoint="/v1/completions",status="200"}' in text


def test_metrics_count_speculative_guesses(served: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmplan.llm.generation import speculative

    # Every match guessed in full: whether guesses pay on this random model and machine is not the point here.
    monkeypatch.setattr(speculative, "best_guesses", lambda p, most, cost: most)

    def counted() -> dict[str, float]:
        text = httpx.get(f"{served.base}/metrics").text
        names = ("guessed_tokens_total", "accepted_tokens_total", "acceptance_ratio")
        return {n: float(re.search(rf"^llmplan_speculative_{n} (\S+)$", text, re.M).group(1)) for n in names}

    before = counted()
    spec = {"speculative": {"tokens": 4, "ngram": 2}}
    prompt = "keys and locks, keys and locks, keys and locks, keys and"
    client(served).completions.create(
        model="tiny-serve", prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body=spec
    )
    after = counted()
    guessed = after["guessed_tokens_total"] - before["guessed_tokens_total"]
    accepted = after["accepted_tokens_total"] - before["accepted_tokens_total"]
    assert guessed > 0 and 0 <= accepted <= guessed  # the repeated prompt's n-grams were guessed
    assert 0 <= after["acceptance_ratio"] <= 1
    assert after["acceptance_ratio"] == pytest.approx(after["accepted_tokens_total"] / after["guessed_tokens_total"])


def test_a_draft_request_on_a_plan_without_a_draft_is_a_400(served: LiveServer) -> None:
    body = {"prompt": "keys", "max_tokens": 4, "speculative": {"method": "draft"}}
    answer = httpx.post(f"{served.url}/completions", json=body, timeout=30)
    assert answer.status_code == 400
    assert "speculative.method: draft needs the plan's draft model" in answer.json()["error"]["message"]


def test_a_served_draft_plan_answers_as_the_plain_one(
    served: LiveServer, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrent requests through a plan whose generate drafts (its own model in int8 as the draft): the
    answers equal the plain server's, guesses made and counted."""
    import yaml

    from llmplan.llm.generation import speculative

    # A tiny model's draft step costs what its target step does, so no guess would pay: guess in full.
    monkeypatch.setattr(speculative, "best_guesses", lambda p, most, cost: most)

    draft = tmp_path / "draft.yaml"
    stages = [
        s
        for s in yaml.safe_load(write_serve_plan(tmp_path, tiny_model).read_text())["stages"]
        if "load." in s["uses"] or s["uses"] == "env.check" or s["uses"] == "model.source"
    ]
    next(s for s in stages if s["id"] == "convert")["with"]["dtype"] = "int8"
    draft.write_text(yaml.safe_dump({"name": "draft", "device": "cpu", "seed": 0, "threads": 1, "stages": stages}))
    plan = write_serve_plan(tmp_path, tiny_model, name="tiny-draft", speculative={"method": "draft", "tokens": 3})
    data = yaml.safe_load(plan.read_text())
    at = next(i for i, s in enumerate(data["stages"]) if s["uses"] == "load.to_device") + 1
    data["stages"].insert(at, {"id": "draft", "uses": "load.draft", "with": {"plan": "draft.yaml"}})
    plan.write_text(yaml.safe_dump(data, sort_keys=False))

    def answers(live: LiveServer, **extra: Any) -> list[str]:
        out: dict[int, str] = {}

        def ask(i: int) -> None:
            reply = client(live).completions.create(
                model="m", prompt=PROMPTS[i], max_tokens=MAX_NEW, temperature=0, extra_body=extra or None
            )
            out[i] = reply.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return [out[i] for i in range(len(PROMPTS))]

    with LiveServer(plan, ServerSettings(max_queue=32)) as live:
        drafted = answers(live, speculative={"method": "draft", "tokens": 3})  # the API's default: none
        text = httpx.get(f"{live.base}/metrics").text
        guessed = float(re.search(r"^llmplan_speculative_guessed_tokens_total (\S+)$", text, re.M).group(1))
    assert drafted == answers(served)
    assert guessed > 0


def test_a_full_queue_answers_429(tiny_model: Path, tmp_path: Path) -> None:
    plan = write_serve_plan(tmp_path, tiny_model, slots=1, name="tiny-one")
    with LiveServer(plan, ServerSettings(max_queue=1)) as live:
        scheduler = live.host.scheduler
        assert scheduler is not None
        gate = hold_after(live.host.loop, 0)  # the first request is held
        answers: list[httpx.Response] = []
        first = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{live.url}/completions", json={"prompt": "Hello world", "max_tokens": 5}, timeout=30)
            )
        )
        first.start()
        deadline = time.monotonic() + 10
        while live.host.in_flight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = httpx.post(f"{live.url}/completions", json={"prompt": "keys", "max_tokens": 2}, timeout=30)
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
        assert second.json()["error"]["type"] == "rate_limit_error"
        gate.set()
        first.join(30)
        assert answers[0].status_code == 200
        after = httpx.post(f"{live.url}/completions", json={"prompt": "keys", "max_tokens": 2}, timeout=30)
        assert after.status_code == 200  # the place came back when the first request ended


def test_the_api_key_is_enforced(tiny_model: Path, tmp_path: Path) -> None:
    plan = write_serve_plan(tmp_path, tiny_model, name="tiny-key")
    with LiveServer(plan, ServerSettings(api_key="s3cret")) as live:
        with pytest.raises(openai.AuthenticationError):
            client(live, api_key="wrong").completions.create(model="tiny-key", prompt="keys", max_tokens=2)
        ok = client(live, api_key="s3cret").completions.create(model="tiny-key", prompt="keys", max_tokens=2)
        assert ok.usage.completion_tokens == 2
        assert httpx.get(f"{live.base}/health").status_code == 200  # health needs no key


def test_keep_alive_unloads_and_the_next_request_reloads(tiny_model: Path, tmp_path: Path) -> None:
    plan = write_serve_plan(tmp_path, tiny_model, name="tiny-idle")
    with LiveServer(plan, ServerSettings(keep_alive_s=0.3, keep_alive_check_s=0.05)) as live:
        c = client(live)
        first = c.completions.create(model="tiny-idle", prompt="keys", max_tokens=6).choices[0].text
        deadline = time.monotonic() + 10
        while httpx.get(f"{live.base}/health").json()["status"] != "unloaded":
            assert time.monotonic() < deadline, "never unloaded"
            time.sleep(0.05)
        assert live.host.context is None and live.host.scheduler is None
        again = c.completions.create(model="tiny-idle", prompt="keys", max_tokens=6).choices[0].text
        assert again == first and live.host.loads == 2


def test_serve_command_stops_on_sigterm_and_releases(tiny_model: Path, tmp_path: Path) -> None:
    plan = write_serve_plan(tmp_path, tiny_model, name="tiny-cli")
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmplan", "serve", str(plan), "--port", str(port), "--quiet"],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        body = {"prompt": "keys", "max_tokens": 3}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "released model" in err and "stopped" in err and "Traceback" not in err
    assert out == ""  # the terminal sink does not print served answers


def test_a_plan_that_cannot_serve_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llmplan.engine.cli import main

    repo = Path(__file__).resolve().parents[2]
    plan = repo / "plans" / "llama-beam.yaml"
    runs = tmp_path / "runs"
    assert main(["serve", str(plan), "--port", str(free_port()), "--set", f"runs_dir={runs}"]) == 1
    assert "beam search" in capsys.readouterr().err
    assert not runs.exists()  # refused before anything was created
    with socket_taken() as port:
        assert main(["serve", str(repo / "plans" / "llama-int8.yaml"), "--port", str(port)]) == 1
        assert f"127.0.0.1:{port}: cannot listen" in capsys.readouterr().err


class socket_taken:
    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_the_results_cache_keys_on_each_requests_own_parameters(tiny_model: Path, tmp_path: Path) -> None:
    plan = write_serve_plan(tmp_path, tiny_model, name="tiny-cached", cache_db=tmp_path / "results.sqlite")
    with LiveServer(plan, ServerSettings()) as live:
        url = f"{live.url}/completions"
        greedy = {"prompt": "Hello world", "max_tokens": 12}
        first = httpx.post(url, json=greedy, timeout=30)
        again = httpx.post(url, json=greedy, timeout=30)
        assert first.headers["x-llmplan-replayed"] == "false" and again.headers["x-llmplan-replayed"] == "true"
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        sampled = httpx.post(url, json={**greedy, "temperature": 1.0, "seed": 3}, timeout=30)
        assert sampled.headers["x-llmplan-replayed"] == "false"  # other parameters: never the greedy answer
        assert sampled.json()["choices"][0]["text"] != first.json()["choices"][0]["text"]
        shorter = httpx.post(url, json={**greedy, "max_tokens": 5}, timeout=30)
        assert shorter.headers["x-llmplan-replayed"] == "false" and shorter.json()["usage"]["completion_tokens"] == 5


def test_a_cancelled_answer_is_never_replayed(tiny_model: Path, tmp_path: Path) -> None:
    plan = write_serve_plan(tmp_path, tiny_model, name="tiny-cut", cache_db=tmp_path / "results.sqlite")
    with LiveServer(plan, ServerSettings()) as live:
        scheduler = live.host.scheduler
        assert scheduler is not None
        gate = hold_after(live.host.loop, 3)
        body = {"prompt": "Hello world", "max_tokens": MAX_NEW, "stream": True}
        with httpx.stream("POST", f"{live.url}/completions", json=body, timeout=30) as answer:
            next(line for line in answer.iter_lines() if line.startswith("data: {"))
        time.sleep(0.3)
        gate.set()
        deadline = time.monotonic() + 10
        while scheduler.stats.cancelled == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)  # the cancelled request's remaining stages (and its store) finish
        again = httpx.post(f"{live.url}/completions", json={**body, "stream": False}, timeout=30)
        assert again.headers["x-llmplan-replayed"] == "false"
        assert again.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_request_without_max_tokens_runs_to_the_context(tiny_model: Path, tmp_path: Path) -> None:
    """#57: an API request that sends no max_tokens is not cut at a default (it was "length 128"): with the plan's
    max_new_tokens null (the default) it runs to EOS or the slot's context."""
    plan = write_serve_plan(tmp_path, tiny_model, slots=1, context=64, max_new_tokens=None, ignore_eos=True)
    with LiveServer(plan, ServerSettings(max_queue=4)) as live:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(f"{live.url}/chat/completions", json=body, timeout=120).json()
    usage = answer["usage"]
    assert answer["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] >= 64  # the slot's context, not a default cap
