"""The load generator against a fake OpenAI-compatible SSE server on loopback whose timing and failures are known.

The fake server is plain asyncio (no web framework): it parses one HTTP/1.1 request per connection and answers
as `behave(index, body)` says: a stream of chunks with set delays (chunked transfer encoding, as uvicorn and
llama-server send), a 429, a connection dropped mid-stream, a stream without `[DONE]`, or silence. Timing
windows are generous: they check that the generator measures the right gaps, not how fast this machine is.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from llmplan.commands.bench.load_generator import (
    LoadSummary,
    build_prompts,
    check_loopback,
    format_summary,
    percentile,
    run_load_async,
)


@dataclass
class Stream:
    """A 200 stream: a role-only delta, `tokens` content deltas (`first_delay` before the first, `gap` between)."""

    tokens: int = 8
    first_delay: float = 0.0
    gap: float = 0.0
    usage: bool = True
    drop_after: int | None = None  # close the socket after this many content deltas, mid-body
    done: bool = True  # send `data: [DONE]`
    error_event: bool = False  # an error object instead of the content


@dataclass
class Refuse:
    status: int = 429


@dataclass
class Hang:
    seconds: float = 5.0


Behaviour = Stream | Refuse | Hang


@dataclass
class FakeServer:
    behave: Callable[[int, dict[str, Any]], Behaviour]
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.decode().split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length))
            index = len(self.bodies)
            self.bodies.append(body)
            await self.answer(self.behave(index, body), writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.in_flight -= 1
            writer.close()

    async def answer(self, b: Behaviour, writer: asyncio.StreamWriter) -> None:
        if isinstance(b, Hang):
            await asyncio.sleep(b.seconds)
            return
        if isinstance(b, Refuse):
            payload = json.dumps({"error": {"message": "queue full", "type": "rate_limit", "code": b.status}}).encode()
            writer.write(
                f"HTTP/1.1 {b.status} Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )

        async def event(obj: Any) -> None:
            data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": "c1",
                "object": "chat.completion.chunk",
                "model": "fake",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }

        await event(chunk({"role": "assistant", "content": ""}))
        if b.error_event:
            await event({"error": {"message": "slot failed", "type": "server_error"}})
        else:
            for i in range(b.tokens):
                await asyncio.sleep(b.first_delay if i == 0 else b.gap)
                if b.drop_after is not None and i == b.drop_after:
                    writer.transport.abort()  # a reset, not a clean end of the chunked body
                    return
                await event(chunk({"content": f" t{i}"}, "length" if i == b.tokens - 1 else None))
            if b.usage:
                await event(
                    {
                        "id": "c1",
                        "object": "chat.completion.chunk",
                        "choices": [],
                        "usage": {"prompt_tokens": 40, "completion_tokens": b.tokens, "total_tokens": 40 + b.tokens},
                    }
                )
        if b.done:
            await event("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def run_against(behave: Callable[[int, dict[str, Any]], Behaviour], **kwargs: Any) -> tuple[LoadSummary, FakeServer]:
    """Start the fake server on a free loopback port, run the load generator against it, stop the server."""
    fake = FakeServer(behave)

    async def main() -> LoadSummary:
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        fake.port = server.sockets[0].getsockname()[1]
        try:
            prompts = kwargs.pop("prompts", ["hello there"])
            return await run_load_async(fake.url, "fake", prompts, **kwargs)
        finally:
            server.close()

    return asyncio.run(main()), fake


def always(b: Behaviour) -> Callable[[int, dict[str, Any]], Behaviour]:
    return lambda _i, _body: b


def test_timing_and_counts_follow_the_server() -> None:
    s, fake = run_against(always(Stream(tokens=8, first_delay=0.06, gap=0.02)), concurrency=4, requests=8, max_tokens=8)
    assert (s.ok, s.refused, s.lost, s.cancelled, s.unsent, s.errors) == (8, 0, 0, 0, 0, 0)
    assert s.output_tokens == 64
    assert all(len(r.itl_s) == 7 and r.text == "".join(f" t{i}" for i in range(8)) for r in s.records)
    assert all(r.finish_reason == "length" and r.usage_prompt_tokens == 40 for r in s.records)
    # asyncio.sleep never wakes early by more than the clock's resolution; the upper bounds only catch a
    # generator that measures the wrong thing (e.g. the whole request, or from the run's start).
    assert 0.055 <= s.ttft_p50_s <= 0.5
    assert 0.012 <= s.itl_p50_s <= 0.2
    assert s.itl_p50_s < s.ttft_p50_s
    # Each request's first token and gaps fall inside its own lifetime (not measured from the run's start).
    assert all(r.ttft_s + sum(r.itl_s) <= r.end - r.start for r in s.records)
    assert sorted(r.client for r in s.records) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert s.ttft_p99_s >= s.ttft_p50_s and s.itl_p99_s >= s.itl_p50_s
    assert fake.max_in_flight == 4  # 4 clients, each request ~0.2 s: all four are in flight at the start
    # Two rounds of four ~0.2 s requests: the rates come from that wall time, not per-request sums.
    assert 0.3 <= s.wall_s <= 3.0
    assert s.requests_per_s == pytest.approx(8 / s.wall_s)
    assert s.output_tok_per_s == pytest.approx(64 / s.wall_s)
    assert s.prompt_tokens_mean == 40
    assert "C=4 n=8" in format_summary(s)


def test_request_body_asks_for_a_greedy_stream_with_usage_and_ignore_eos() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    _, fake = run_against(always(Stream(tokens=2)), prompts=["plain text", messages], requests=3, max_tokens=16)
    b0, b1, b2 = fake.bodies
    assert b0["messages"] == [{"role": "user", "content": "plain text"}]
    assert b1["messages"] == messages  # message lists are sent as given
    assert b2["messages"] == b0["messages"]  # request i takes prompt i % len(prompts)
    assert b0["stream"] is True and b0["stream_options"] == {"include_usage": True}
    assert (b0["temperature"], b0["max_tokens"], b0["model"], b0["ignore_eos"]) == (0, 16, "fake", True)

    _, fake = run_against(always(Stream(tokens=2)), requests=1, extra_body={"top_k": 1})
    assert "ignore_eos" not in fake.bodies[0] and fake.bodies[0]["top_k"] == 1


def test_without_usage_the_content_chunks_are_counted() -> None:
    s, _ = run_against(always(Stream(tokens=5, usage=False)), requests=2)
    assert s.ok == 2 and s.output_tokens == 10
    assert all(r.usage_completion_tokens is None and r.output_tokens == 5 for r in s.records)
    assert s.prompt_tokens_mean is None


def test_429_is_refused_not_lost() -> None:
    s, _ = run_against(lambda i, _b: Refuse(429) if i % 3 == 1 else Stream(tokens=3), concurrency=2, requests=9)
    assert (s.ok, s.refused, s.lost, s.errors) == (6, 3, 0, 3)
    assert s.refused_by_status == {429: 3}
    refused = [r for r in s.records if r.outcome == "refused"]
    assert all(r.status == 429 and "queue full" in (r.error or "") and r.ttft_s is None for r in refused)
    assert s.output_tokens == 18  # refused requests add no tokens


def test_connection_dropped_mid_stream_is_lost() -> None:
    s, _ = run_against(lambda i, _b: Stream(tokens=6, drop_after=3) if i == 1 else Stream(tokens=6), requests=3)
    assert (s.ok, s.refused, s.lost, s.errors) == (2, 0, 1, 1)
    bad = s.records[1]
    assert bad.outcome == "lost" and bad.status == 200 and bad.content_chunks == 3
    assert s.lost_by_kind == {"transport": 1}
    assert s.output_tokens == 12  # only answered requests count


def test_stream_without_done_or_with_an_error_event_is_lost() -> None:
    s, _ = run_against(
        lambda i, _b: [Stream(tokens=2, done=False), Stream(error_event=True), Stream(tokens=2)][i], requests=3
    )
    assert [r.outcome for r in s.records] == ["lost", "lost", "ok"]
    assert s.lost_by_kind == {"stream_error": 1, "truncated": 1}
    assert "slot failed" in (s.records[1].error or "")


def test_time_limit_cancels_in_flight_and_leaves_the_rest_unsent() -> None:
    t = time.perf_counter()
    s, fake = run_against(always(Stream(tokens=20, gap=0.2)), concurrency=2, requests=6, time_limit_s=0.4)
    assert time.perf_counter() - t < 3.0  # stops by itself at the bound, not after the 4 s streams
    assert (s.ok, s.cancelled, s.unsent, s.lost) == (0, 2, 4, 0)
    assert len(fake.bodies) == 2
    assert all(r.start is None for r in s.records if r.outcome == "unsent")


def test_request_timeout_is_lost_and_a_closed_port_is_lost_fast() -> None:
    s, _ = run_against(always(Hang(5.0)), requests=2, concurrency=2, request_timeout_s=0.3)
    assert (s.ok, s.lost) == (0, 2) and s.lost_by_kind == {"timeout": 2}

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t = time.perf_counter()
    s = asyncio.run(run_load_async(f"http://127.0.0.1:{port}", "m", ["x"], requests=3, request_timeout_s=5))
    assert (s.ok, s.lost, s.lost_by_kind) == (0, 3, {"transport": 3})
    assert time.perf_counter() - t < 3.0


@pytest.mark.parametrize("url", ["http://192.0.2.1:8080", "http://10.0.0.1", "no-host"])
def test_only_loopback_targets(url: str) -> None:
    with pytest.raises(ValueError, match=r"loopback|no host"):
        check_loopback(url)
    with pytest.raises(ValueError):
        asyncio.run(run_load_async(url, "m", ["x"], requests=1))


def test_loopback_names_pass() -> None:
    for url in ["http://127.0.0.1:1", "http://localhost:8000", "http://[::1]:8000"]:
        check_loopback(url)


def test_bad_arguments_are_refused() -> None:
    run: Callable[..., Awaitable[LoadSummary]] = run_load_async
    for kwargs in ({"concurrency": 0}, {"max_tokens": 0}, {"requests": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            asyncio.run(run("http://127.0.0.1:1", "m", ["x"], **kwargs))
    with pytest.raises(ValueError, match="no prompts"):
        asyncio.run(run("http://127.0.0.1:1", "m", []))


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 99) == 99.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_build_prompts_reach_the_token_target_and_differ() -> None:
    def count(text: str) -> int:  # a stand-in tokenizer: one token per word
        return len(text.split())

    prompts = build_prompts(5, 128, count, seed=1)
    assert [count(p) for p in prompts] == [128] * 5
    assert len(set(prompts)) == 5
    assert build_prompts(5, 128, count, seed=1) == prompts  # seeded
