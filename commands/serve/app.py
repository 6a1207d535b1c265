"""The OpenAI-compatible HTTP API over a `ModelHost` (FastAPI; streaming as server-sent events).

Every request runs the plan's request stages in a worker thread of its own (they wait on the shared
scheduler, which a single thread steps), so the event loop only moves bytes. Errors take OpenAI's shape
and say which field: 400 for the request's own values (and malformed JSON or HTTP), 401 without the key,
404 for another model or path, 408 for a request that does not arrive in time, 413 for a body too large,
415 for a body that is not JSON, 429 with Retry-After when the bounded queue is full, 500 only for the
server's own failures. Every read is bounded before it reaches a route: the headers' time and size
(http_protocol.py), the body's time and size and the API key (http_guard.py), the JSON itself
(request_body.py). A client that goes away cancels its request, which frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException

from llmplan.engine.messages import shown
from llmplan.engine.serving import RequestError, RequestRun

from .access_log import AccessLog
from .embeddings import POOLING, embedding_response, parse_embedding_request, tokens_of
from .host import ModelHost, RequestFailed
from .http_guard import OPEN_PATHS, RequestGate
from .http_protocol import protocol_kwargs
from .model_card import model_card
from .openai_api import (
    INT64,
    ChatRequest,
    CompletionRequest,
    FieldError,
    api_defaults,
    chat_logprobs,
    completion_logprobs,
    error_body,
    finish_reason,
    new_id,
    now,
)
from .request_body import BodyError, parse_body, validate
from .responses_api import ResponsesRequest, response_body, response_events, responses_name
from .responses_api import as_chat as responses_as_chat
from .responses_api import check_body as check_responses_body
from .structured_output import ShapeError, compile_shape
from .tool_calls import MARKER, NATIVE_END, CallStream, RepeatStop, ToolMode

# Stage parameter names back to the request's own, for error messages.
FIELD_NAMES = {"max_new_tokens": "max_tokens", "messages": "messages", "text": "prompt", "logprobs": "top_logprobs"}


@dataclass
class ServerSettings:
    api_key: str | None = None
    max_queue: int = 64  # requests in flight (running or waiting for a slot); more get 429
    max_body_bytes: int = 1 << 20
    header_timeout_s: float = 10.0  # from a connection's idle start to its request's last header
    body_timeout_s: float = 30.0  # from the last header to the body's last byte
    keep_alive_s: float | None = None
    keep_alive_check_s: float = 1.0
    strict_model: bool = False  # refuse (404) a model name that is not the model's id or an alias
    open_metrics: bool = False  # /metrics without the API key (a Prometheus scraper on a trusted network)
    access_log: TextIO | None = field(default_factory=lambda: sys.stderr)  # one JSON line per request; None: off


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.kind, self.param), status_code=self.status, headers=headers)


def server_folders(host: ModelHost) -> list[Path]:
    """The folders of this server a refusal's message may name: never shown to a client (`_for_client`)."""
    from llmplan.cache_home import cache_home

    folders = [host.run_dir, cache_home(), Path.home()]
    source = getattr(host.context, "model_source", None) if host.context is not None else None
    if source is not None:
        folders.append(Path(source.model_dir))
    plan_file = getattr(host.bound.source, "file", None)
    if plan_file:
        folders.append(Path(plan_file).resolve().parent)
    return folders


class ServerMetrics:
    """Prometheus metrics, in a registry of this app's own (several apps may live in one process)."""

    def __init__(self, host: ModelHost) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "llmplan_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("llmplan_prompt_tokens", "prompt tokens processed", registry=r)
        self.output_tokens = Counter("llmplan_generation_tokens", "tokens generated", registry=r)
        # Speculative decoding (llm/generation/speculative.py): how many guesses were verified and how many kept.
        self.guessed = Counter("llmplan_speculative_guessed_tokens", "speculative guesses verified", registry=r)
        self.accepted = Counter("llmplan_speculative_accepted_tokens", "speculative guesses accepted", registry=r)
        self._speculated = [0, 0]  # (guessed, accepted) since start, for the ratio
        Gauge(
            "llmplan_speculative_acceptance_ratio", "speculative guesses accepted / verified, since start", registry=r
        ).set_function(lambda: self._speculated[1] / self._speculated[0] if self._speculated[0] else 0.0)
        self.ttft = Histogram(
            "llmplan_time_to_first_token_seconds",
            "request arrival to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.itl = Histogram(
            "llmplan_inter_token_latency_seconds",
            "time between consecutive tokens of one request",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.5),
            registry=r,
        )

        def scheduler_value(read: Callable[[Any], float]) -> Callable[[], float]:
            return lambda: read(host.scheduler) if host.scheduler is not None else 0.0

        Gauge("llmplan_queue_depth", "requests waiting for a slot", registry=r).set_function(
            scheduler_value(lambda s: s.waiting)
        )
        Gauge("llmplan_slots_busy", "slots holding a running request", registry=r).set_function(
            scheduler_value(lambda s: s.busy_slots)
        )
        Gauge("llmplan_slots", "slots of the KV cache", registry=r).set_function(
            scheduler_value(lambda s: s.cache.slots)
        )
        Gauge(
            "llmplan_kv_cache_usage_ratio", "cached tokens of running requests / cache capacity", registry=r
        ).set_function(scheduler_value(lambda s: s.kv_usage))
        Gauge("llmplan_requests_in_flight", "HTTP requests being answered", registry=r).set_function(
            lambda: host.in_flight
        )
        Gauge("llmplan_model_loaded", "1 when the weights are loaded", registry=r).set_function(
            lambda: 1.0 if host.state == "ready" else 0.0
        )

    def count_generation(self, result: Any) -> None:
        """A finished request's tokens, and its speculative guesses where it made any (not on a replay)."""
        self.prompt_tokens.inc(result.prompt_tokens)
        self.output_tokens.inc(len(result.tokens))
        spec = result.speculative
        if spec and spec["guessed"]:
            self.guessed.inc(spec["guessed"])
            self.accepted.inc(spec["accepted"])
            self._speculated[0] += spec["guessed"]
            self._speculated[1] += spec["accepted"]


class TokenClock:
    """Records time to first token and inter-token gaps of one request from its stream callbacks."""

    def __init__(self, metrics: ServerMetrics, arrived: float) -> None:
        self.metrics, self.arrived, self.last = metrics, arrived, None

    def tick(self) -> None:
        t = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(t - self.arrived)
        else:
            self.metrics.itl.observe(t - self.last)
        self.last = t


def create_app(host: ModelHost, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(host)
    service = Answering(host, settings, metrics)
    app = FastAPI(title="llmplan", lifespan=_lifespan(host, settings, service))
    app.state.host, app.state.metrics = host, metrics
    _add_gates(app, settings, metrics)
    _add_info_routes(app, host, settings, metrics, service.card)
    _add_answer_routes(app, service)
    return app


def _lifespan(
    host: ModelHost, settings: ServerSettings, service: Answering
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: the keep-alive watcher while it serves; the request threads shut down after."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(_keep_alive(host, settings)) if settings.keep_alive_s is not None else None
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            service.executor.shutdown(wait=False, cancel_futures=True)  # the model thread's owner releases the model

    return lifespan


def _add_gates(app: FastAPI, settings: ServerSettings, metrics: ServerMetrics) -> None:
    """The request gate (key, body size and time), and the access log outside it when one is asked for."""
    app.add_middleware(
        RequestGate,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
        count=lambda endpoint, status: metrics.requests.labels(endpoint, status).inc(),
        open_paths=OPEN_PATHS | {"/metrics"} if settings.open_metrics else OPEN_PATHS,
    )
    if settings.access_log is not None:  # outermost: the gate's refusals are logged too
        app.add_middleware(AccessLog, stream=settings.access_log)


def _add_info_routes(
    app: FastAPI, host: ModelHost, settings: ServerSettings, metrics: ServerMetrics, card: Any
) -> None:
    """The routes that answer without the model: errors in OpenAI's shape, health, metrics, the model list."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, bad: HTTPException) -> JSONResponse:
        """Starlette's own 404 / 405 in OpenAI's shape (its default is `{"detail": ...}`)."""
        what = {404: "no such endpoint", 405: "method not allowed"}.get(bad.status_code, str(bad.detail))
        message = f"{request.method} {shown(request.url.path)}: {what}; see GET /v1/models and POST /v1/completions"
        kind = "not_found_error" if bad.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(message, kind), status_code=bad.status_code, headers=bad.headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        state = host.state
        return JSONResponse({"status": state}, status_code=503 if state == "loading" else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card.entry()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Response:
        if settings.strict_model and not card.answers_to(name):
            return ApiError(
                404, f"model {shown(name)} not found (this server has {card.id!r})", "not_found_error", "model"
            ).response()
        return JSONResponse(card.entry() | ({} if card.answers_to(name) else {"id": card.shown_name(name)}))


def _add_answer_routes(app: FastAPI, service: Answering) -> None:
    """The OpenAI endpoints that run the plan, and the embeddings that run its model."""

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await service.answer(request, "/v1/chat/completions", ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await service.answer(request, "/v1/completions", CompletionRequest)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await service.answer(request, "/v1/responses", ResponsesRequest)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await service.embed(request)


class Answering:
    """The OpenAI-compatible answers of one server: admission, parsing, running the plan, the response shapes."""

    def __init__(self, host: ModelHost, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.host, self.settings, self.metrics = host, settings, metrics
        self.executor = ThreadPoolExecutor(max_workers=settings.max_queue + 4, thread_name_prefix="llmplan-request")
        self.created = now()
        source = getattr(host.context, "model_source", None) if host.context is not None else None
        ctx = host.context
        self.width = ctx.model_config.dim if ctx is not None and ctx.model_config else None
        embeddings = None if self.width is None else POOLING | {"dimensions": self.width}
        self.card = model_card(source, host.bound.plan.name, self.created, embeddings)
        # The context one request has: its slot's rows of the KV cache (a prompt leaves room for one token).
        self.context_tokens = ctx.kv_cache.max_tokens if ctx is not None and ctx.kv_cache is not None else None
        self.model_context = ctx.model_config.max_position_embeddings if ctx is not None and ctx.model_config else None
        self.vocab = ctx.model_config.vocab_size if ctx is not None and ctx.model_config else None
        marked = set(host.generate_params.serving_defaults)
        self.defaults = {name: value for name, value in api_defaults().items() if name not in marked}
        self.admitted = threading.Semaphore(settings.max_queue)
        template = ctx.tokenizer.chat_template if ctx is not None and ctx.tokenizer is not None else None
        self.renders_calls = template is not None and "tool_calls" in template  # else calls go in as text
        # A template with Hermes' tool format of its own (Qwen2.5's): the tools go to it, calls in its tags.
        self.template_calls = self.renders_calls and all(w in template for w in ("tools", MARKER, NATIVE_END))
        tok = ctx.tokenizer if ctx is not None else None
        self.tag_tokens = tok is not None and all(tok.token_to_id(tag) is not None for tag in (MARKER, NATIVE_END))

    async def answer(
        self, request: Request, endpoint: str, schema: type[ChatRequest] | type[CompletionRequest]
    ) -> Response:
        arrived = time.perf_counter()
        taken = 0
        try:
            body = await self._parse(request, schema)
            self._refuse_unanswerable(body)
            await self._compile_shape(body)
            jobs = self._jobs(body)
            for _ in jobs:  # one queue place per choice; all or none
                if not self.admitted.acquire(blocking=False):
                    raise ApiError(
                        429, f"the queue is full ({self.settings.max_queue} requests in flight)", "rate_limit_error"
                    )
                taken += 1
            if body.stream:
                queue, cancels, seen = await self._open_stream(jobs, arrived, _calling(body))
                release, taken = taken, 0  # the stream gives its places back when it ends
                return self._streaming_response(body, jobs, (queue, cancels, seen), endpoint, release)
            runs = await self._run_all(request, jobs, arrived, _calling(body))
            self.metrics.requests.labels(endpoint, "200").inc()
            replayed = all(r.context.generations[0].from_cache for r in runs)
            # A replay from the plan's results cache says so (the body keeps OpenAI's shape).
            answer = self._response(body, jobs, runs)
            if isinstance(body, ResponsesRequest):
                answer = response_body(answer, body)
            return JSONResponse(answer, headers={"X-Llmplan-Replayed": str(replayed).lower()})
        except ApiError as bad:
            self.metrics.requests.labels(endpoint, str(bad.status)).inc()
            return bad.response({"Retry-After": "1"} if bad.status == 429 else None)
        finally:
            for _ in range(taken):
                self.admitted.release()

    async def _compile_shape(self, body: Any) -> None:
        """The shape compiled against the tokenizer off the event loop (a large grammar takes a second); a 400
        naming the field when it cannot be kept."""
        ignore = bool(getattr(body, "ignore_eos", None) or self.host.generate_params.ignore_eos)
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, compile_shape, body, self.host.context, ignore
            )
        except ShapeError as bad:
            raise ApiError(400, str(bad), param=bad.field) from None

    def _refuse_unanswerable(self, body: Any) -> None:
        """ApiError for a request no wait could answer: another model (when strict), more choices than the queue."""
        if self.settings.strict_model and body.model is not None and not self.card.answers_to(body.model):
            raise ApiError(
                404,
                f"model {shown(body.model)} not found (this server has {self.card.id!r})",
                "not_found_error",
                "model",
            )
        choices = body.prompt_count * body.n
        if choices > self.settings.max_queue:  # could never be admitted: the request's fault, not load
            field = "n" if body.prompt_count == 1 else "prompt"
            raise ApiError(
                400,
                f"{field}: {choices} choices (prompts x n) are more than this server's queue of "
                f"{self.settings.max_queue}; send fewer",
                param=field,
            )

    async def _open_stream(
        self, jobs: list[Any], arrived: float, mode: ToolMode | None
    ) -> tuple[asyncio.Queue[tuple[str, int, Any]], list[threading.Event], list[tuple[str, int, Any]]]:
        """Start the jobs of a streamed answer and wait until each prompt is known to fit: a refusal (a prompt
        too long) is a status, not an event after a 200. The queue, the jobs' cancels and the events seen."""
        queue: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()
        cancels = [threading.Event() for _ in jobs]
        self._start_streaming(jobs, queue, cancels, arrived, mode)
        try:
            seen = await self._opened(queue, len(jobs))
        except BaseException:
            for ev in cancels:
                ev.set()
            raise
        return queue, cancels, seen

    def _streaming_response(
        self,
        body: Any,
        jobs: list[Any],
        opened: tuple[asyncio.Queue[tuple[str, int, Any]], list[threading.Event], list[tuple[str, int, Any]]],
        endpoint: str,
        release: int,
    ) -> StreamingResponse:
        """The server-sent events of opened jobs; the stream gives back its `release` queue places when it ends."""
        queue, cancels, seen = opened

        def on_end() -> None:
            for _ in range(release):
                self.admitted.release()

        stream = self._stream(body, jobs, queue, cancels, seen, endpoint, on_end)
        if isinstance(body, ResponsesRequest):
            stream = response_events(stream, body, self.card.shown_name(body.model))
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _parse(self, request: Request, schema: type[Any]) -> Any:
        raw = await request.body()  # read (bounded in size and time) by the RequestGate already
        data: Any = None
        try:
            data = parse_body(raw)
            chat = data
            if schema is ResponsesRequest:  # validated as the chat request it is answered as
                check_responses_body(data)
                chat = responses_as_chat(data)
            body = validate(schema, chat)
            body.check_combination()
        except BodyError as bad:
            raise self._refusal(schema, data, str(bad), bad.param) from None
        except FieldError as bad:
            raise self._refusal(schema, data, str(bad), bad.field) from None
        room = None if self.context_tokens is None else self.context_tokens - 1
        if body.token_limit is not None and room is not None and body.token_limit > room:
            field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            field = responses_name(field, data) if schema is ResponsesRequest else field
            raise ApiError(
                400,
                f"{field}: at most {room} (the context is {self.context_tokens} tokens), got {body.token_limit}",
                param=field,
            )
        return body

    @staticmethod
    def _refusal(schema: type[Any], data: Any, message: str, param: str | None) -> ApiError:
        """A 400 naming the field as the client named it: a Responses request's `input.0.content`, not the chat
        request's `messages.0.content` it was validated as."""
        if schema is ResponsesRequest and param is not None:
            named = responses_name(param, data)
            if named != param and message.startswith(f"{param}:"):
                message = f"{named}:{message[len(param) + 1 :]}"
            param = named
        return ApiError(400, message, param=param)

    def _prompt_limit(self, body: Any) -> dict[str, Any]:
        """The tokenize stage's limit and policy: the context (a prompt that does not fit is refused with both
        numbers), cut only where truncation is asked explicitly (the request's `truncate_prompt_tokens`, or a
        tokenize stage of the plan that sets `truncation` itself)."""
        plan = self.host.plan.params(self.host.tokenize_id)
        limits = [n for n in (plan.max_prompt_tokens, self.model_context) if n is not None]
        if self.context_tokens is not None:
            limits.append(self.context_tokens - 1)
        limit = min(limits) if limits else None
        if body.truncate_prompt_tokens is not None:
            return {"truncation": "keep_end", "max_prompt_tokens": min([body.truncate_prompt_tokens, *limits])}
        explicit = "truncation" in plan.model_fields_set and plan.truncation != "error"
        return {"truncation": plan.truncation if explicit else "error", "max_prompt_tokens": limit}

    def _jobs(self, body: Any) -> list[dict[str, dict[str, Any]]]:
        """Per choice: the stage overrides it runs with. n choices of one prompt differ by seed."""
        try:
            if isinstance(body, ChatRequest):
                if self.template_calls:
                    body.calls_in_template_style(self.tag_tokens)
                prompts = [
                    body.tokenize_overrides(self.host.plan.params(self.host.tokenize_id).system, self.renders_calls)
                ]
            else:
                prompts = [CompletionRequest.tokenize_overrides(p) for p in body.prompts()]
        except FieldError as bad:
            raise ApiError(400, str(bad), param=bad.field) from None
        limit = self._prompt_limit(body)
        prompts = [prompt | limit for prompt in prompts]
        generate = self.defaults | body.generate_overrides() | {"stream": True}
        try:
            bias = body.bias(self.vocab)
        except FieldError as bad:
            raise ApiError(400, str(bad), param=bad.field) from None
        if bias:
            generate["logit_bias"] = bias
        top = body.logprobs_wanted()
        if top is not None:
            generate["logprobs"] = top
        # Seeds: the request's own (choice j gets seed + j, so n choices differ yet repeat); else, when sampling,
        # a fresh one per request as OpenAI and vLLM do. Greedy needs none (and keeps its results-cache key).
        sampling = generate.get("temperature", self.host.generate_params.temperature) > 0
        base = body.sampling_seed if body.seed is not None else (secrets.randbelow(1 << 31) if sampling else None)
        jobs = []
        for prompt in prompts:
            for j in range(body.n):
                seeded = generate if base is None else generate | {"seed": (base + j) % INT64}
                jobs.append({self.host.tokenize_id: prompt, self.host.generate_id: seeded})
        return jobs

    def _start(self, job: dict[str, Any], on_text: Callable[[str], None], cancel: threading.Event) -> Any:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self.executor, lambda: self.host.run(job, stream=on_text, cancel=cancel))

    async def _run_all(
        self, request: Request, jobs: list[dict[str, Any]], arrived: float, mode: ToolMode | None
    ) -> list[RequestRun]:
        cancels = [threading.Event() for _ in jobs]
        clocks = [TokenClock(self.metrics, arrived) for _ in jobs]
        futures = [
            self._start(job, _watched(lambda _t, c=c: c.tick(), mode, ev), ev)
            for job, c, ev in zip(jobs, clocks, cancels, strict=True)
        ]
        try:
            pending = set(futures)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=0.25)
                if pending and await request.is_disconnected():
                    for ev in cancels:
                        ev.set()
            return [self._result(f) for f in futures]
        finally:
            for ev in cancels:
                ev.set()

    def _result(self, future: Any) -> RequestRun:
        try:
            run = future.result()
        except RequestError as bad:
            field = FIELD_NAMES.get(bad.field.split(".")[0], bad.field)
            message = self._for_client(str(bad).split(": ", 1)[-1])
            raise ApiError(400, f"{field}: {message}", param=field) from None
        except RequestFailed as bad:
            raise ApiError(
                400 if bad.client_error else 500,
                self._for_client(str(bad)),
                "invalid_request_error" if bad.client_error else "server_error",
            ) from None
        except Exception as bug:
            self.host.plan.log.error("request_failed", error=f"{type(bug).__name__}: {bug}")
            message = "internal error; the run directory's events.jsonl has the details"
            raise ApiError(500, message, "server_error") from None
        generation = run.context.generations[0]
        if generation.finish_reason == "error":
            raise ApiError(500, self._for_client(f"generation failed: {generation.error}"), "server_error")
        self.metrics.count_generation(generation)
        return run

    def _for_client(self, message: str) -> str:
        """`message` without the server's own folders (the model's, the plan's, the run's, the cache, $HOME): a
        file is named by its name in the model folder (`tokenizer_config.json`), and the whole message is logged
        here for the operator. A client learns what it sent was refused, not where this server keeps things."""
        roots = {str(p) for p in server_folders(self.host)} | {os.path.realpath(p) for p in server_folders(self.host)}
        told = message
        for root in sorted((r.rstrip("/") for r in roots if len(r) > 1), key=len, reverse=True):
            told = told.replace(root + "/", "").replace(root, "the server's folder")
        if told != message:
            self.host.plan.log.warning("request_refused", error=message)
        return told

    def _tokenizer(self, run: RequestRun) -> Any:
        return self.host.context.tokenizer if self.host.context is not None else run.context.tokenizer

    def _choice_parts(self, run: RequestRun) -> tuple[str, str, Any]:
        ctx = run.context
        generation = ctx.generations[0]
        if ctx.completions:
            # The completion, not the generation, for logprobs too: an output filter redacted its tokens and
            # alternatives where they would spell what it withheld.
            completion = ctx.completions[0]
            return completion.text, completion.finish_reason, completion  # content_filter once a filter acted
        # a plan without output stages: the generated ids as text
        text = ctx.tokenizer.decode(generation.tokens, skip_special_tokens=True)
        return text, finish_reason(generation.finish_reason), generation

    async def embed(self, request: Request) -> Response:
        """`POST /v1/embeddings` (commands/serve/embeddings.py): one queue place, the pass on the model thread."""
        endpoint = "/v1/embeddings"
        try:
            if self.width is None:
                raise ApiError(503, "the model's width is not known until it is loaded", "server_error")
            try:
                body = parse_embedding_request(parse_body(await request.body()), self.width)
            except BodyError as bad:
                raise ApiError(400, str(bad), param=bad.param) from None
            self._refuse_unanswerable_model(body.model)
            if not self.admitted.acquire(blocking=False):
                raise ApiError(
                    429, f"the queue is full ({self.settings.max_queue} requests in flight)", "rate_limit_error"
                )
            try:
                run = asyncio.get_running_loop().run_in_executor(self.executor, self._embed_inputs, body.inputs)
                inputs, vectors = await run
            except BodyError as bad:
                raise ApiError(400, str(bad), param=bad.param) from None
            finally:
                self.admitted.release()
        except ApiError as bad:
            self.metrics.requests.labels(endpoint, str(bad.status)).inc()
            return bad.response({"Retry-After": "1"} if bad.status == 429 else None)
        self.metrics.requests.labels(endpoint, "200").inc()
        tokens = sum(len(ids) for ids, _ in inputs)
        return JSONResponse(embedding_response(vectors, body.encoding_format, self.card.shown_name(body.model), tokens))

    def _embed_inputs(self, items: list[Any]) -> tuple[list[tuple[list[int], int]], list[list[float]]]:
        """In a request thread: load if unloaded (the tokenizer comes with the model), tokenize, embed."""
        self.host.load()
        ctx = self.host.context
        limit = getattr(ctx.model, "max_seq_len", None) or self.model_context or 0
        inputs = tokens_of(items, ctx.tokenizer, self.vocab or 0, limit)
        return inputs, self.host.embed(inputs)

    def _refuse_unanswerable_model(self, name: str | None) -> None:
        if self.settings.strict_model and name is not None and not self.card.answers_to(name):
            raise ApiError(
                404, f"model {shown(name)} not found (this server has {self.card.id!r})", "not_found_error", "model"
            )

    def _usage(self, runs: list[RequestRun], prompts: int) -> dict[str, int]:
        gens = [r.context.generations[0] for r in runs]
        # n choices of one prompt count its tokens once, as OpenAI does
        prompt = sum(g.prompt_tokens for g in gens[:: max(1, len(gens) // prompts)])
        completion = sum(len(g.tokens) for g in gens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def _logprobs(body: Any, tok: Any, gen: Any) -> dict[str, Any] | None:
        """A choice's `logprobs` in its endpoint's shape, when the request asked for them."""
        if body.logprobs_wanted() is None:
            return None
        shape = chat_logprobs if isinstance(body, ChatRequest) else completion_logprobs
        return shape(tok, gen.tokens, gen.logprobs, gen.top_logprobs)

    def _response(self, body: Any, jobs: list[Any], runs: list[RequestRun]) -> dict[str, Any]:
        tok = self._tokenizer(runs[0])
        choices = []
        for index, run in enumerate(runs):
            text, reason, gen = self._choice_parts(run)
            if isinstance(body, ChatRequest):
                message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
                calls = body.tool_mode.read(text) if body.tool_mode is not None else None
                if calls is not None:
                    message |= {"content": None, "tool_calls": calls}
                    reason = "tool_calls"
                choice: dict[str, Any] = {
                    "index": index,
                    "message": message,
                    "finish_reason": reason,
                    "logprobs": self._logprobs(body, tok, gen),
                }
            else:
                choice = {
                    "index": index,
                    "text": text,
                    "finish_reason": reason,
                    "logprobs": self._logprobs(body, tok, gen),
                }
            choices.append(choice)
        chat = isinstance(body, ChatRequest)
        prompts = 1 if chat else len(body.prompts())
        return {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": self.card.shown_name(body.model),
            "choices": choices,
            "usage": self._usage(runs, prompts),
            "system_fingerprint": f"llmplan-{self.card.plan}",
        }

    def _start_streaming(
        self,
        jobs: list[Any],
        queue: asyncio.Queue[tuple[str, int, Any]],
        cancels: list[threading.Event],
        arrived: float,
        mode: ToolMode | None,
    ) -> None:
        """Start every job; each puts ("text", index, text) on `queue` per piece of text and ("done", index,
        its future) when it ends, from whichever thread it runs on."""
        loop = asyncio.get_running_loop()
        clocks = [TokenClock(self.metrics, arrived) for _ in jobs]

        def on_text(index: int) -> Callable[[str], None]:
            def push(text: str) -> None:
                if text:  # an empty one only says the prompt is queued
                    clocks[index].tick()
                loop.call_soon_threadsafe(queue.put_nowait, ("text", index, text))

            return push

        for index, job in enumerate(jobs):
            future = self._start(job, _watched(on_text(index), mode, cancels[index]), cancels[index])
            future.add_done_callback(lambda f, i=index: loop.call_soon_threadsafe(queue.put_nowait, ("done", i, f)))

    async def _opened(self, queue: asyncio.Queue[tuple[str, int, Any]], count: int) -> list[tuple[str, int, Any]]:
        """The events until every job's prompt is known to fit (its first text, even an empty one, which the
        generate stage sends once its prompts are queued) or the job ended; ApiError when one was refused."""
        seen: list[tuple[str, int, Any]] = []
        opened: set[int] = set()
        while len(opened) < count:
            event = await queue.get()
            seen.append(event)
            what, index, payload = event
            if index in opened:
                continue
            opened.add(index)
            if what == "done" and payload.exception() is not None:
                self._result(payload)  # raises the ApiError the job's failure maps to
        return seen

    async def _stream(
        self,
        body: Any,
        jobs: list[Any],
        queue: asyncio.Queue[tuple[str, int, Any]],
        cancels: list[threading.Event],
        seen: list[tuple[str, int, Any]],
        endpoint: str,
        on_end: Callable[[], None],
    ) -> AsyncIterator[str]:
        chat = isinstance(body, ChatRequest)
        replay = list(seen)
        chunks = _StreamChunks(chat, self.card.shown_name(body.model), self.card.plan, body.include_usage)
        chunk, delta = chunks.chunk, chunks.delta
        streamed = [""] * len(jobs)  # the content shown so far
        mode = body.tool_mode if chat else None
        calling = [CallStream(mode) if mode is not None else None for _ in jobs]
        runs: list[RequestRun | None] = [None] * len(jobs)
        status = "200"
        try:
            if chat:
                yield chunk([delta(i, None, role=True) for i in range(len(jobs))])
            remaining = len(jobs)
            while remaining:
                what, index, payload = replay.pop(0) if replay else await queue.get()
                if what == "text":
                    for piece in _text_chunks(chunks, index, payload, calling[index], streamed):
                        yield piece
                    continue
                remaining -= 1
                try:
                    run = self._result(payload)
                except ApiError as bad:
                    status = str(bad.status)
                    yield f"data: {json.dumps(error_body(str(bad), bad.kind, bad.param))}\n\n"
                    continue
                runs[index] = run
                for piece in self._final_chunks(body, chunks, index, run, calling[index], streamed[index]):
                    yield piece
            done = [r for r in runs if r is not None]
            if body.include_usage and done:
                prompts = 1 if chat else len(body.prompts())
                yield chunk([], self._usage(done, prompts))
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            status = "499"  # the client went away
            raise
        finally:
            for ev in cancels:
                ev.set()
            self.metrics.requests.labels(endpoint, status).inc()
            on_end()

    def _final_chunks(
        self, body: Any, chunks: _StreamChunks, index: int, run: RequestRun, held: CallStream | None, streamed: str
    ) -> Iterator[str]:
        """The events that end one choice of a stream: what its calls still owe or the text not shown yet
        (`streamed` is what was), its logprobs, its finish reason."""
        chunk, delta = chunks.chunk, chunks.delta
        text, reason, gen = self._choice_parts(run)
        calls = None
        if held is not None:  # what the calls' stream still owes: their rest, or calls not begun
            calls, owed, agreed = held.finish(text)
            if not agreed:
                self.host.plan.log.warning("tool_call_stream_disagreed", choice=index, text=text)
            for event in owed:
                yield chunk([delta(index, None) | {"delta": {"tool_calls": [event.delta()]}}])
        if calls is not None:
            reason = "tool_calls"
        elif held is not None and held.started:
            pass  # calls the token limit cut short: sent as far as they went, the reason says "length"
        # The final text is the answer: send what the stream has not shown yet (the whole text for a
        # results-cache replay, which streams nothing; a character completed only at the end; text
        # held back as it could have been a call).
        elif text.startswith(streamed) and len(text) > len(streamed):
            yield chunk([delta(index, text[len(streamed) :])])
        logprobs = self._logprobs(body, self._tokenizer(run), gen)
        if logprobs is not None:  # the choice's logprobs, all tokens in one chunk before its last
            yield chunk([delta(index, None) | {"logprobs": logprobs}])
        yield chunk([delta(index, None, reason)])


def _calling(body: Any) -> ToolMode | None:
    """The request's tool mode, when it may answer with calls."""
    return body.tool_mode if isinstance(body, ChatRequest) else None


def _watched(push: Callable[[str], None], mode: ToolMode | None, cancel: threading.Event) -> Callable[[str], None]:
    """`push` (a job's text as it is generated), and under a tool mode a call that repeats an earlier one ends the
    job there (RepeatStop sets its `cancel`, on the model thread: the next step ends it)."""
    if mode is None:
        return push
    stop = RepeatStop(mode, cancel)

    def both(text: str) -> None:
        stop(text)
        push(text)

    return both


def _text_chunks(
    chunks: _StreamChunks, index: int, payload: str, held: CallStream | None, streamed: list[str]
) -> Iterator[str]:
    """The events of one piece of a choice's text: the text to show (adding it to `streamed`), then the pieces
    of any tool call the text holds."""
    chunk, delta = chunks.chunk, chunks.delta
    shown, events = held.push(payload) if held is not None else (payload, [])
    if shown:
        streamed[index] += shown
        yield chunk([delta(index, shown)])
    for event in events:  # a call's header once its name is known, then its arguments' pieces
        yield chunk([delta(index, None) | {"delta": {"tool_calls": [event.delta()]}}])


class _StreamChunks:
    """The server-sent events of one streamed answer: every chunk carries the same id, kind and time."""

    def __init__(self, chat: bool, model_name: str, plan: str, include_usage: bool) -> None:
        self.chat, self.model_name, self.include_usage = chat, model_name, include_usage
        self.fingerprint = f"llmplan-{plan}"
        self.ident, self.made = new_id("chatcmpl" if chat else "cmpl"), now()
        self.kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        data: dict[str, Any] = {
            "id": self.ident,
            "object": self.kind,
            "created": self.made,
            "model": self.model_name,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if usage is not None or self.include_usage:
            data["usage"] = usage
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def delta(self, index: int, text: str | None, reason: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            first = {"role": "assistant", "content": "", "refusal": None}
            d: dict[str, Any] = first if role else ({"content": text} if text else {})
            return {"index": index, "delta": d, "finish_reason": reason, "logprobs": None}
        return {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}


async def _keep_alive(host: ModelHost, settings: ServerSettings) -> None:
    """Unload the model after `keep_alive_s` without requests (Ollama's keep_alive)."""
    loop = asyncio.get_running_loop()
    assert settings.keep_alive_s is not None
    interval = min(settings.keep_alive_check_s, max(settings.keep_alive_s / 4, 0.05))
    while True:
        await asyncio.sleep(interval)
        try:
            await loop.run_in_executor(None, host.maybe_unload)
        except Exception as bad:  # a failed release must not kill the server; it says so in the log
            host.plan.log.error("keep_alive_unload_failed", error=f"{type(bad).__name__}: {bad}")


def uvicorn_config(app: FastAPI, settings: ServerSettings, host: str, port: int, **options: Any) -> uvicorn.Config:
    """uvicorn's settings for this app: the bounded HTTP protocol (header time and size), warnings only."""
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", **protocol_kwargs(settings.header_timeout_s), **options
    )


class ThreadedServer(uvicorn.Server):
    """uvicorn in a thread of its own: the main thread belongs to the model (see host.py) and handles
    SIGINT / SIGTERM itself, so uvicorn installs no signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
