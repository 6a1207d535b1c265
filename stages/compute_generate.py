"""`compute.generate`: prefill + KV-cached decode, the sampler chain or beam search, stopping, streaming.

Requests run through the continuous-batching scheduler (llm/scheduler.py) on slots of the plan's KV cache:
each request joins as soon as a slot is free and leaves the moment it ends, with its own sampler, seed and
limits; prompts sharing a prefix (a chat template's system prompt) reuse its K/V. Each sequence ends with a
finish reason: eos | length | stop_string | cache_full | error. Out-of-memory and NaN/inf logits end the
affected requests with reason `error` instead of killing the run. Beam search, and a cache with the
"slide" policy (StreamingLLM eviction over one shared write pointer), run as static batches.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import Phase, Stage
from llmplan.llm.beam_search import beam_search
from llmplan.llm.generate import Generation, generate
from llmplan.llm.sampling import SamplingParams, build_picker
from llmplan.llm.scheduler import GenerationRequest, Scheduler
from llmplan.llm.slot_cache import SlotCache
from llmplan.llm.stop_strings import StopStringStream, stop_checker
from llmplan.llm.tokenizer import StreamDecoder
from llmplan.plain_errors import plain_error

from .compute_tokenize import truncate
from .observe import finish_observing, record_steps
from .request_settings import SAMPLING_FIELDS, RequestSettings
from .slots import InferenceContext
from .types import Request, Result

ALTERNATIVES = 5  # best tokens kept per step for the run's record (the report shows them on hover)


class GenerateParams(RequestSettings):
    """The request settings (defaults for every request) and how the stage runs them."""

    logprobs: int = Field(0, ge=0, le=20, description="top-n alternatives per token (0 = only the chosen)")
    num_beams: int = Field(1, ge=1, le=64, description="beam search when > 1 (greedy beams, scored)")
    length_penalty: float = Field(1.0, ge=-10, le=10, description="beam score = logprob sum / len ** this")
    num_return_sequences: int = Field(1, ge=1, le=64, description="beam candidates returned per request")
    early_stopping: bool | Literal["never"] = Field(False, description="beam search stopping rule (as HF)")
    ignore_eos: bool = Field(False, description="generate exactly max_new_tokens (benchmarks)")
    batch_size: int | None = Field(None, ge=1, le=4096, description="requests running at once; default: cache rows")
    prefill_chunk: int | None = Field(None, ge=1, description="prefill at most this many tokens per pass")
    max_step_tokens: int = Field(
        512, ge=2, le=1 << 16, description="tokens per scheduler step: one per decoding row, the rest prompt chunks"
    )
    prefix_reuse: bool = Field(True, description="start a prompt from cached K/V of the same leading tokens")
    stream: bool = Field(True, description="print text as it is generated (single request, terminal)")

    @model_validator(mode="after")
    def _beams(self) -> GenerateParams:
        if self.num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences ({self.num_return_sequences}) exceeds num_beams ({self.num_beams})")
        if self.num_beams > 1 and self.temperature > 0:
            raise ValueError("beam search is deterministic here: use temperature 0 with num_beams > 1")
        return self


def settings_for(request: Request, params: GenerateParams, plan_seed: int) -> dict[str, Any]:
    """The request's effective generation settings: the stage's, then the request's own overrides."""
    settings = {name: getattr(params, name) for name in (*SAMPLING_FIELDS, "max_new_tokens", "stop")}
    settings["seed"] = plan_seed if params.seed is None else params.seed
    settings.update(request.overrides)
    return settings


class Generate(Stage):
    """Prefill and decode with the KV cache; sample (or beam-search); stop; stream text."""

    name = "compute.generate"
    phase = Phase.COMPUTE
    Params = GenerateParams
    reads = ("model", "kv_cache", "requests", "tokenizer", "model_config")
    writes = ("generations",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        model, cache, requests, tok, cfg = ctx.model, ctx.kv_cache, ctx.requests, ctx.tokenizer, ctx.model_config
        assert model is not None and cache is not None and requests is not None and tok is not None and cfg
        eos = (
            set() if params.ignore_eos else set(cfg.eos_token_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
        )
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else (tok.pad_id or 0)
        seed = ctx.plan.plan.seed
        results: list[Result] = []
        started = time.perf_counter()
        if params.num_beams > 1:
            if cache in _SERVED:
                raise StageFailure("beam search cannot run beside a served scheduler (it uses the whole cache)")
            if cache.max_batch < params.num_beams:
                raise StageFailure(
                    f"num_beams {params.num_beams} needs {params.num_beams} KV-cache rows; "
                    f"the cache has {cache.max_batch} (set max_batch on the load.to_device stage)"
                )
            for request in requests:
                results.append(self._beams(ctx, model, cache, request, params, eos, seed))
        else:
            size = min(params.batch_size or cache.max_batch, cache.max_batch)
            stream = params.stream and len(requests) == 1 and not ctx.json_mode
            if cache.policy == "slide":
                for first in range(0, len(requests), size):
                    group = requests[first : first + size]
                    results += self._batch(ctx, model, cache, group, params, eos, pad, seed, stream)
            else:
                results = self._scheduled(ctx, model, cache, requests, params, eos, seed, stream, size)
        ctx.generations = results
        # generations.json; timings / attention files when observed
        finish_observing(ctx, results, shared_model=cache in _SERVED)
        total = sum(len(r.tokens) for r in results)
        wall = time.perf_counter() - started
        ctx.metrics.set("generated_tokens", total)
        ctx.metrics.set("tokens_per_s", total / wall if wall > 0 else 0.0)
        ctx.metrics.set("finish_reasons", [r.finish_reason for r in results])
        ctx.metrics.set("per_request", [{"id": r.request_id, **r.timings} for r in results])

    # --- sampling / greedy, through the scheduler -------------------------------------------------

    def _scheduled(
        self,
        ctx: InferenceContext,
        model: Any,
        cache: Any,
        requests: list[Request],
        params: GenerateParams,
        eos: set[int],
        seed: int,
        stream: bool,
        running: int,
    ) -> list[Result]:
        tok = ctx.tokenizer
        assert tok is not None
        served = _SERVED.get(cache)
        scheduler = served or new_scheduler(model, cache, params, running)
        if served is None:
            scheduler.timeline = []  # every step's passes, for the trace and the report
        settings_of = [settings_for(r, params, seed) for r in requests]
        decoder = StreamDecoder(tok, skip_special_tokens=True) if stream else None
        # Only a single request streams: its stop strings are never shown, even in part.
        shown = StopStringStream(ctx.stream, settings_of[0]["stop"] if stream else [])
        eos_ids = frozenset(eos)
        left = [len(requests)]
        all_done = threading.Event()

        def on_finish(_seq: Any) -> None:  # on the stepping thread, one request at a time
            left[0] -= 1
            if left[0] == 0:
                all_done.set()

        def on_token(token: int) -> None:
            if decoder is not None and token not in eos_ids:
                piece = decoder.push(token)
                if piece:
                    shown.push(piece)

        submitted = []
        for request, settings in zip(requests, settings_of, strict=True):
            prompt = self._fit(ctx, request, cache.max_tokens)
            sampling = SamplingParams(
                **{k: settings[k] for k in SAMPLING_FIELDS}, logprobs_top_n=max(params.logprobs, ALTERNATIVES)
            )
            seq = scheduler.submit(
                GenerationRequest(
                    prompt=prompt,
                    picker=build_picker(sampling, len(prompt)),
                    max_new_tokens=settings["max_new_tokens"],
                    eos_ids=eos_ids,
                    stop=stop_checker(tok, settings["stop"]),
                    on_token=on_token if stream else None,
                    on_finish=on_finish,
                    tag=request.id,
                )
            )
            submitted.append((request, seq, settings))
        if served is None:
            scheduler.run()
        else:  # another thread steps the served scheduler: wait, and give the slots back if nobody wants the answer
            while not all_done.wait(0.05):  # wakes the moment the last one ends; checks for a cancel meanwhile
                if ctx.cancel.is_set():
                    for _, seq, _ in submitted:
                        scheduler.cancel(seq)
                    all_done.wait()
        if decoder is not None and served is None:
            # A served answer's tail comes from its final text instead: an incomplete character held back
            # here is dropped there, and the client must get exactly the final text.
            shown.push(decoder.flush())
            shown.end()
            ctx.stream("\n")
        elif decoder is not None:
            shown.end()
        if scheduler.timeline is not None:
            record_steps(ctx, scheduler.timeline)
        stats = scheduler.stats
        ctx.metrics.set(
            "scheduler",
            {
                "slots": scheduler.cache.slots,
                "steps": stats.steps,
                "busy_max": stats.busy_max,
                "prefill_tokens": stats.prefill_tokens,
                "reused_prefix_tokens": stats.reused_tokens,
            },
        )
        out = []
        for request, seq, settings in submitted:
            gen = seq.generation
            computed = gen.prompt_tokens - seq.reused
            result = _result(request, gen, gen.prompt_tokens, settings, stats.busy_max, computed, params.logprobs)
            result.streamed = stream
            if gen.finish_reason == "error":
                ctx.log.warning("generation_error", request=request.id, error=gen.error)
            out.append(result)
        return out

    # --- sampling / greedy, static batches (the "slide" cache policy) ------------------------------

    def _batch(
        self,
        ctx: InferenceContext,
        model: Any,
        cache: Any,
        group: list[Request],
        params: GenerateParams,
        eos: set[int],
        pad: int,
        seed: int,
        stream: bool,
    ) -> list[Result]:
        tok = ctx.tokenizer
        settings = [settings_for(r, params, seed) for r in group]
        prompts = [self._fit(ctx, r, cache.max_tokens) for r, s in zip(group, settings, strict=True)]
        pickers = [
            build_picker(
                SamplingParams(**{k: s[k] for k in SAMPLING_FIELDS}, logprobs_top_n=max(params.logprobs, ALTERNATIVES)),
                len(p),
            )
            for s, p in zip(settings, prompts, strict=True)
        ]
        stops = [stop_checker(tok, s["stop"]) for s in settings]
        decoders = [StreamDecoder(tok, skip_special_tokens=True) for _ in group] if stream else []
        shown = StopStringStream(ctx.stream, settings[0]["stop"] if stream else [])

        def stop_fn(row: int, ids: list[int]) -> bool:
            check = stops[row]
            return check is not None and check(ids)

        def on_token(row: int, token: int) -> None:
            if decoders and token not in eos:
                piece = decoders[row].push(token)
                if piece:
                    shown.push(piece)

        cache.reset(len(group))
        with torch.inference_mode():
            gens = generate(
                model,
                cache,
                prompts,
                pickers=pickers,
                max_new_tokens=[s["max_new_tokens"] for s in settings],
                eos_ids=eos,
                pad_id=pad,
                stop_fn=stop_fn if any(c is not None for c in stops) else None,
                on_token=on_token if stream else None,
                prefill_chunk=params.prefill_chunk,
            )
        if decoders:
            shown.push(decoders[0].flush())
            shown.end()
            ctx.stream("\n")
        out = []
        for request, gen, prompt, s in zip(group, gens, prompts, settings, strict=True):
            result = _result(request, gen, len(prompt), s, len(group), sum(len(p) for p in prompts), params.logprobs)
            result.streamed = stream
            if gen.finish_reason == "error":
                ctx.log.warning("generation_error", request=request.id, error=gen.error)
            out.append(result)
        return out

    def _fit(self, ctx: InferenceContext, request: Request, capacity: int) -> list[int]:
        """Leave room for at least one generated token; with policy stop, the rest ends as cache_full."""
        limit = capacity - 1
        ids, dropped = truncate(request.prompt_ids, limit, "keep_end", 1 if request.prompt_ids[:1] else 0)
        if dropped:
            ctx.log.warning("prompt_truncated", request=request.id, dropped=dropped, kept=len(ids), limit=limit)
            request.truncated += dropped
        return ids

    # --- beam search --------------------------------------------------------------------------------

    def _beams(
        self,
        ctx: InferenceContext,
        model: Any,
        cache: Any,
        request: Request,
        params: GenerateParams,
        eos: set[int],
        seed: int,
    ) -> Result:
        settings = settings_for(request, params, seed)
        max_new = settings["max_new_tokens"]
        prompt = self._fit(ctx, request, cache.max_tokens - max_new + 1)
        cache.reset(params.num_beams)
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                candidates = beam_search(
                    model,
                    cache,
                    prompt,
                    num_beams=params.num_beams,
                    max_new_tokens=max_new,
                    eos_ids=eos,
                    length_penalty=params.length_penalty,
                    num_return_sequences=params.num_return_sequences,
                    early_stopping=params.early_stopping,
                )
        except (torch.OutOfMemoryError, RuntimeError) as bad:
            ctx.log.warning("generation_error", request=request.id, error=str(bad))
            return Result(request.id, len(prompt), [], "error", error=plain_error(bad))
        wall = time.perf_counter() - start
        best = candidates[0]
        return Result(
            request_id=request.id,
            prompt_tokens=len(prompt),
            tokens=list(best.tokens),
            finish_reason=best.finish_reason,
            candidates=list(candidates),
            timings={"wall_s": wall, "decode_tokens_per_s": len(best.tokens) / wall if wall > 0 else 0.0},
            params=settings | {"num_beams": params.num_beams, "length_penalty": params.length_penalty},
        )


_SERVED: weakref.WeakKeyDictionary[Any, Scheduler] = weakref.WeakKeyDictionary()
"""Schedulers that a resident plan steps in a thread of its own, by the KV cache whose slots they own."""


def new_scheduler(model: Any, cache: Any, params: GenerateParams, running: int) -> Scheduler:
    try:
        return Scheduler(
            model,
            SlotCache.over(cache),
            max_step_tokens=params.max_step_tokens,
            prefill_chunk=params.prefill_chunk,
            max_running=running,
            prefix_reuse=params.prefix_reuse,
        )
    except ValueError as bad:
        raise StageFailure(f"compute.generate: {bad}") from None


def serve_scheduler(model: Any, cache: Any, params: GenerateParams) -> Scheduler:
    """The scheduler every later run of this stage on `cache` submits to instead of running its own; the
    caller steps it (`Scheduler.serve`) and calls `unserve` when done. Its slots span the whole cache."""
    if params.num_beams > 1:
        raise StageFailure("beam search runs as a static batch over the whole cache: it cannot be served")
    if cache.policy == "slide":
        raise StageFailure('the "slide" KV-cache policy evicts over a shared write pointer: it cannot be served')
    scheduler = new_scheduler(model, cache, params, cache.max_batch)
    _SERVED[cache] = scheduler
    return scheduler


def unserve(cache: Any) -> None:
    _SERVED.pop(cache, None)


def _result(
    request: Request,
    gen: Generation,
    prompt_len: int,
    settings: dict[str, Any],
    batch: int,
    batch_prompt: int,
    logprobs: int,
) -> Result:
    """Per-request timings. batch_prompt: the prompt tokens the prefill time covers (a static batch's prefill
    is one pass for all its rows; a scheduled request's is its own, less any reused prefix)."""
    decoded = max(len(gen.tokens) - 1, 0)
    timings = {
        "queue_s": gen.queued_s,  # submitted -> admitted into a slot (0 for a static batch)
        "prefill_s": gen.prefill_s,
        "ttft_s": gen.ttft_s if gen.ttft_s is not None else 0.0,
        "decode_s": gen.decode_s,
        "prefill_tokens_per_s": batch_prompt / gen.prefill_s if gen.prefill_s > 0 else 0.0,
        "decode_tokens_per_s": decoded / gen.decode_s if gen.decode_s > 0 else 0.0,
        "batch": float(batch),
    }
    return Result(
        request_id=request.id,
        prompt_tokens=prompt_len,
        tokens=list(gen.tokens),
        finish_reason=gen.finish_reason or "length",
        logprobs=list(gen.logprobs),
        top_logprobs=[(t or [])[:logprobs] for t in gen.top_logprobs] if logprobs and any(gen.top_logprobs) else None,
        error=gen.error,
        timings=timings,
        params=settings,
        alternatives=[t or [] for t in gen.top_logprobs] if any(gen.top_logprobs) else None,
        token_times=list(gen.token_times),
    )
