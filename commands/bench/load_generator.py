"""A load generator for OpenAI-compatible servers on loopback: C concurrent streaming clients, bounded.

Pure client side (httpx + asyncio, nothing of llmplan's server), so the same code measures `llmplan serve`
and llama.cpp's `llama-server` alike. Each request is a `POST /v1/chat/completions` with `stream: true`,
`stream_options: {include_usage: true}` and `temperature: 0`, plus `extra_body` (default `{"ignore_eos":
true}`, which llama-server and vLLM honour and OpenAI-style servers ignore) so every answer is `max_tokens`
long.

Per request it records the time to first token (first non-empty content delta, from the moment the request
is sent), every gap between content deltas (inter-token latency), the output token count (the final usage
chunk's `completion_tokens`, else the number of content deltas) and how it ended:

- ``ok``: HTTP 200 and a stream that ends with ``data: [DONE]``.
- ``refused``: an HTTP error status (429 queue full, 503, 400 ...): answered, just not served.
- ``lost``: no complete answer and no status that says why: connection refused or dropped, a stream cut
  before ``[DONE]``, an error event inside a 200 stream, a malformed chunk, a request timeout.
- ``cancelled``: still in flight when the run's own time bound hit (the client's limit, not the server's
  fault, so it is kept apart from lost).
- ``unsent``: never sent, because the time bound hit first.

`errors` in the summary is refused + lost. A server under test should lose nothing: every request answered
or refused with a status.

    summary = run_load("http://127.0.0.1:8080", "smollm2", prompts, max_tokens=128, concurrency=4,
                       requests=8, time_limit_s=300)
    print(summary.as_dict())

or from a shell: `python -m llmplan.commands.bench.load_generator --url http://127.0.0.1:8080 --model m
--concurrency 4 --requests 8 --prompt-tokens 128 --max-tokens 128`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import random
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

Message = Mapping[str, Any]
Prompt = str | Sequence[Message]
Outcome = Literal["ok", "refused", "lost", "cancelled", "unsent"]

DEFAULT_EXTRA_BODY: Mapping[str, Any] = {"ignore_eos": True}

# Plain English words that tokenize to about one token each, so a prompt's length is easy to steer.
_FILLER = (
    "the model reads a prompt and writes text one token at a time while the server schedules many requests "
    "together so that every client sees its answer stream as soon as each token is ready river mountain "
    "engine garden window paper light number seven blue quiet market signal table orange winter"
)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; `start`/`end` are relative to the run's start."""

    index: int
    client: int
    outcome: Outcome = "unsent"
    status: int | None = None
    start: float | None = None
    end: float | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    content_chunks: int = 0
    output_tokens: int = 0
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None


@dataclass
class LoadSummary:
    """The run's totals. Rates use the wall time from the first request sent to the last one finished."""

    base_url: str
    model: str
    concurrency: int
    requests: int
    max_tokens: int
    wall_s: float
    ok: int
    refused: int
    lost: int
    cancelled: int
    unsent: int
    errors: int
    refused_by_status: dict[int, int]
    lost_by_kind: dict[str, int]
    requests_per_s: float
    output_tokens: int
    output_tok_per_s: float
    prompt_tokens_mean: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    records: list[RequestRecord] = field(repr=False, default_factory=list)

    def as_dict(self, records: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not records:
            out.pop("records")
        return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def check_loopback(base_url: str) -> None:
    """Refuse any target that is not this machine: a load test must never leave the loopback interface."""
    host = urlsplit(base_url).hostname
    if not host:
        raise ValueError(f"load generator: no host in base URL {base_url!r}")
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        raise ValueError(f"load generator: cannot resolve {host!r}: {e}") from None
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not addr.is_loopback:
            raise ValueError(f"load generator: {host!r} resolves to {addr}, not a loopback address; refusing")


def build_prompts(count: int, target_tokens: int, count_tokens: Callable[[str], int], seed: int = 0) -> list[str]:
    """`count` distinct texts of about `target_tokens` tokens each as `count_tokens` counts them.

    Distinct seeded word sequences, so no server can answer one request from another's prefix cache beyond
    what the chat template shares. Words are appended until the count reaches the target, then the text is
    trimmed word by word while it is over it.
    """
    rng = random.Random(seed)
    words = _FILLER.split()
    prompts = []
    for _ in range(count):
        text_words: list[str] = []
        while count_tokens(" ".join(text_words)) < target_tokens:
            text_words.extend(rng.choice(words) for _ in range(8))
        while len(text_words) > 1 and count_tokens(" ".join(text_words)) > target_tokens:
            text_words.pop()
        prompts.append(" ".join(text_words))
    return prompts


def _messages(prompt: Prompt) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


async def _one_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    t0: float,
    timeout_s: float,
) -> None:
    """Send one streaming request and fill `rec`; never raises except on cancellation."""
    sent = time.perf_counter()
    rec.start = sent - t0
    last: float | None = None
    done = False
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", url, json=body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace").strip().replace("\n", " ")
                rec.outcome, rec.error = "refused", f"HTTP {resp.status_code}: {detail[:200]}"
                return
            async for line in resp.aiter_lines():
                # SSE: only `data:` lines matter here; comments (`:`), `event:` and blank separators are skipped.
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk, lost = _parse_chunk(data)
                if chunk is None:
                    rec.outcome, rec.error = "lost", lost
                    return
                last = _record_chunk(rec, chunk, sent, last)
        if done:
            rec.outcome = "ok"
        else:
            rec.outcome, rec.error = "lost", "truncated: stream ended before data: [DONE]"
    except (TimeoutError, httpx.TimeoutException):
        # Our per-request bound or httpx's connect/read timeout (set to the same bound): either way no answer.
        rec.outcome, rec.error = "lost", f"timeout: no complete answer within {timeout_s:g} s"
    except httpx.HTTPError as e:
        # Connection refused/reset, a peer that closes mid-body, protocol errors: no status tells why.
        rec.outcome, rec.error = "lost", f"transport: {type(e).__name__}: {e}"[:300]
    finally:
        rec.end = time.perf_counter() - t0
        n = rec.usage_completion_tokens
        rec.output_tokens = n if isinstance(n, int) else rec.content_chunks


def _parse_chunk(data: str) -> tuple[dict[str, Any] | None, str | None]:
    """One `data:` payload: (the chunk, None), or (None, why the answer counts as lost)."""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return None, f"malformed: not JSON: {data[:80]!r}"
    if not isinstance(chunk, dict):
        return None, f"malformed: not a JSON object: {data[:80]!r}"
    if "error" in chunk:
        return None, f"stream_error: {json.dumps(chunk['error'])[:200]}"
    return chunk, None


def _record_chunk(rec: RequestRecord, chunk: dict[str, Any], sent: float, last: float | None) -> float | None:
    """Fold one chunk into `rec` (usage, finish reason, text, TTFT / inter-token gaps); returns when the
    last content arrived (`last`, unchanged by a chunk without content)."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        rec.usage_completion_tokens = usage.get("completion_tokens")
        rec.usage_prompt_tokens = usage.get("prompt_tokens")
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        content = delta.get("content") if "delta" in choice else choice.get("text")
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
        if not content:
            continue  # the role-only first delta, or an empty keep-alive delta
        now = time.perf_counter()
        if last is None:
            rec.ttft_s = now - sent
        else:
            rec.itl_s.append(now - last)
        last = now
        rec.content_chunks += 1
        rec.text += content
    return last


def _summarize(
    records: list[RequestRecord], base_url: str, model: str, concurrency: int, max_tokens: int
) -> LoadSummary:
    by: Counter[str] = Counter(r.outcome for r in records)
    ok = [r for r in records if r.outcome == "ok"]
    sent = [r for r in records if r.start is not None]
    wall = (max(r.end or 0.0 for r in sent) - min(r.start or 0.0 for r in sent)) if sent else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = [r.usage_prompt_tokens for r in ok if isinstance(r.usage_prompt_tokens, int)]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    lost_kinds = Counter((r.error or "unknown").split(":", 1)[0] for r in records if r.outcome == "lost")
    refused_status = Counter(r.status for r in records if r.outcome == "refused" and r.status is not None)
    return LoadSummary(
        base_url=base_url,
        model=model,
        concurrency=concurrency,
        requests=len(records),
        max_tokens=max_tokens,
        wall_s=wall,
        ok=by["ok"],
        refused=by["refused"],
        lost=by["lost"],
        cancelled=by["cancelled"],
        unsent=by["unsent"],
        errors=by["refused"] + by["lost"],
        refused_by_status=dict(sorted(refused_status.items())),
        lost_by_kind=dict(sorted(lost_kinds.items())),
        requests_per_s=len(ok) / wall if wall > 0 else 0.0,
        output_tokens=out_tokens,
        output_tok_per_s=out_tokens / wall if wall > 0 else 0.0,
        prompt_tokens_mean=sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile(itl, 50),
        itl_p99_s=percentile(itl, 99),
        records=records,
    )


def _request_count(prompts: Sequence[Prompt], concurrency: int, max_tokens: int, requests: int | None) -> int:
    """How many requests to send (default: one per prompt); ValueError for arguments that cannot run."""
    if not prompts:
        raise ValueError("load generator: no prompts")
    if concurrency < 1 or max_tokens < 1:
        raise ValueError(f"load generator: concurrency and max_tokens must be >= 1 (got {concurrency}, {max_tokens})")
    n = len(prompts) if requests is None else requests
    if n < 1:
        raise ValueError(f"load generator: requests must be >= 1 (got {n})")
    return n


def _body(model: str, prompt: Prompt, max_tokens: int, extra: Mapping[str, Any]) -> dict[str, Any]:
    """One greedy streaming chat request that asks for its usage at the end."""
    return {
        "model": model,
        "messages": _messages(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def run_load_async(
    base_url: str,
    model: str,
    prompts: Sequence[Prompt],
    *,
    max_tokens: int = 128,
    concurrency: int = 1,
    requests: int | None = None,
    time_limit_s: float = 300.0,
    request_timeout_s: float = 120.0,
    extra_body: Mapping[str, Any] | None = None,
    api_key: str | None = None,
) -> LoadSummary:
    """Run `requests` streaming chat requests (default: one per prompt) over `concurrency` clients.

    Request i uses prompts[i % len(prompts)]. Each client sends its next request as soon as its previous one
    ends (a closed loop: the offered load is exactly C requests in flight). Stops when all are done or at
    `time_limit_s`, whichever is first; a single request gives up after `request_timeout_s`.
    """
    n = _request_count(prompts, concurrency, max_tokens, requests)
    check_loopback(base_url)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    extra = dict(DEFAULT_EXTRA_BODY if extra_body is None else extra_body)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    records = [RequestRecord(index=i, client=-1) for i in range(n)]
    next_index = 0
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s

    async def client_loop(cid: int, client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < n and time.perf_counter() < deadline:
            rec = records[next_index]
            next_index += 1  # single-threaded event loop: no lock needed between the check and the increment
            rec.client = cid
            body = _body(model, prompts[rec.index % len(prompts)], max_tokens, extra)
            try:
                await _one_request(client, url, body, rec, t0, request_timeout_s)
            except asyncio.CancelledError:
                rec.outcome, rec.error = "cancelled", f"cancelled: run time limit {time_limit_s:g} s"
                rec.end = time.perf_counter() - t0
                raise

    # trust_env=False: a proxy from the environment must not take loopback traffic anywhere else.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=min(10.0, request_timeout_s))
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers, trust_env=False) as client:
        tasks = [asyncio.create_task(client_loop(c, client)) for c in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]  # a bug here, not a server failure
    return _summarize(records, base_url, model, concurrency, max_tokens)


def run_load(base_url: str, model: str, prompts: Sequence[Prompt], **kwargs: Any) -> LoadSummary:
    """`run_load_async` from synchronous code (its own event loop)."""
    return asyncio.run(run_load_async(base_url, model, prompts, **kwargs))


def format_summary(s: LoadSummary) -> str:
    """One line per run, milliseconds for latencies."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    return (
        f"C={s.concurrency} n={s.requests}: {s.requests_per_s:.2f} req/s, {s.output_tok_per_s:.1f} out tok/s, "
        f"TTFT p50/p99 {ms(s.ttft_p50_s)}/{ms(s.ttft_p99_s)} ms, ITL p50/p99 {ms(s.itl_p50_s)}/{ms(s.itl_p99_s)} ms, "
        f"ok {s.ok}, refused {s.refused}, lost {s.lost}, cancelled {s.cancelled}, unsent {s.unsent}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="load_generator", description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="base URL on loopback, e.g. http://127.0.0.1:8080")
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests", type=int, default=None, help="total requests (default 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=100, help="words per generated prompt (no tokenizer here)")
    ap.add_argument("--prompts", help="JSONL file: one {'messages': [...]} or {'prompt': '...'} per line")
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    n = args.requests or 2 * args.concurrency
    prompts: list[Prompt]
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts = [r["messages"] if "messages" in r else r["prompt"] for r in rows]
    else:
        prompts = build_prompts(n, args.prompt_words, lambda t: len(t.split()))
    try:
        s = run_load(
            args.url,
            args.model,
            prompts,
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
            requests=n,
            time_limit_s=args.time_limit,
            extra_body={} if args.no_ignore_eos else None,
        )
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(s.as_dict(), indent=2) if args.json else format_summary(s))
    return 0 if s.lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
