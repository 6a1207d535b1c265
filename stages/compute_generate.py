"""`compute.generate`: prefill + KV-cached decode, the sampler chain or beam search, stopping, streaming.

Requests run through the engine loop (llm/generation/engine_loop.py: continuous batching) on slots of the plan's KV
cache: each request joins as soon as a slot is free and leaves the moment it ends, with its own sampler,
seed and limits; prompts sharing a prefix (a chat template's system prompt) reuse its K/V. Each sequence
ends with a finish reason: eos | length | stop_string | cache_full | error. Out-of-memory and NaN/inf logits
end the affected requests with reason `error` instead of killing the run. Beam search, and a cache with the
"slide" policy (StreamingLLM eviction over one shared write pointer), run as static batches.

Whoever owns the loop steps it: a resident plan's host puts the loop it steps into the context
(`engine_loop`), and this stage submits to it and waits for its requests to end (a cancel ends them at the
loop's next step); otherwise (`llmplan run`) the stage makes a loop of its own and steps it to the end.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, model_validator

from llmplan.engine.findings import InputRefused, StageFailure
from llmplan.engine.stage import Phase, Stage
from llmplan.llm.generation.beam_search import beam_search
from llmplan.llm.generation.draft_model import DraftModel
from llmplan.llm.generation.engine_loop import EngineLoop
from llmplan.llm.generation.model_runner import ModelRunner
from llmplan.llm.generation.scheduler import GenerationRequest, Sequence
from llmplan.llm.generation.static_batch import Generation, generate
from llmplan.llm.kv.slot_cache import SlotCache
from llmplan.llm.sampling.chain import build_picker
from llmplan.llm.sampling.constrained_format import OutputFormat, UnsupportedFormat
from llmplan.llm.sampling.format_compiler import CompiledFormat, compile_format, complete
from llmplan.llm.sampling.params import Speculation
from llmplan.llm.sampling.picks import TokenPicker
from llmplan.llm.text.stop_strings import StopStringStream, stop_checker
from llmplan.llm.text.tokenizer import StreamDecoder
from llmplan.plain_errors import plain_error

from .compute_tokenize import truncate
from .observe import finish_observing, record_steps
from .request_settings import RequestSettings, plain_settings, sampling_params
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
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] = Field(
        default_factory=dict, description="token id -> a number added to its logit (-100 bans it); OpenAI's logit_bias"
    )
    serving_defaults: list[str] = Field(
        default_factory=list,
        description="settings of this stage a served request takes when it omits them (others: the API's defaults)",
    )

    @model_validator(mode="after")
    def _beams(self) -> GenerateParams:
        if self.num_return_sequences > self.num_beams:
            raise ValueError(f"num_return_sequences ({self.num_return_sequences}) exceeds num_beams ({self.num_beams})")
        if self.num_beams > 1 and self.temperature > 0:
            raise ValueError("beam search is deterministic here: use temperature 0 with num_beams > 1")
        if self.num_beams > 1 and self.speculative is not None:
            raise ValueError("speculative decoding runs in the engine loop, beam search apart: not both")
        unknown = [name for name in self.serving_defaults if name not in RequestSettings.model_fields]
        if unknown:
            known = ", ".join(RequestSettings.model_fields)
            raise ValueError(f"serving_defaults: {', '.join(map(repr, unknown))} is not a request setting ({known})")
        return self


def settings_for(request: Request, params: GenerateParams, plan_seed: int) -> dict[str, Any]:
    """The request's effective generation settings: the stage's, then the request's own overrides."""
    settings = plain_settings({name: getattr(params, name) for name in RequestSettings.model_fields})
    settings["seed"] = plan_seed if params.seed is None else params.seed
    settings.update(request.overrides)
    return settings


def picker_for(
    settings: dict[str, Any], params: GenerateParams, prompt_len: int, grammar: CompiledFormat | None = None
) -> TokenPicker:
    """The request's token picker, from its effective settings (and its format, compiled: `grammar_for`)."""
    bias = tuple(sorted(params.logit_bias.items()))
    top_n = max(params.logprobs, ALTERNATIVES)
    return build_picker(sampling_params(settings, logprobs_top_n=top_n, logit_bias=bias, grammar=grammar), prompt_len)


def grammar_for(ctx: InferenceContext, settings: dict[str, Any], eos: set[int]) -> CompiledFormat | None:
    """The request's `format` compiled against the model's tokenizer (cached per tokenizer and format), or
    None. Refused before any token is generated when it cannot be enforced (fail closed)."""
    fmt = OutputFormat.of(settings.get("format"))
    if fmt is None:
        return None
    if not eos:
        raise InputRefused("format: a constrained answer ends with its end-of-sequence token (not with ignore_eos)")
    assert ctx.tokenizer is not None and ctx.model_config is not None
    try:
        return compile_format(fmt, ctx.tokenizer, frozenset(eos), ctx.model_config.vocab_size)
    except UnsupportedFormat as bad:
        raise InputRefused(f"format: {bad}") from None


@dataclass
class _Streaming:
    """A single request's text, shown as it is generated (its stop strings never shown, even in part)."""

    shown: StopStringStream
    decoder: StreamDecoder | None
    eos_ids: frozenset[int] = field(default_factory=frozenset)

    def on_token(self, token: int) -> None:
        if self.decoder is not None and token not in self.eos_ids:
            piece = self.decoder.push(token)
            if piece:
                self.shown.push(piece)


class Generate(Stage):
    """Prefill and decode with the KV cache; sample (or beam-search); stop; stream text."""

    name = "compute.generate"
    phase = Phase.COMPUTE
    Params = GenerateParams
    reads = ("model", "kv_cache", "requests", "tokenizer", "model_config")
    optional_reads = ("model_runner", "engine_loop", "draft_model")

    @classmethod
    def needs(cls, params: Any) -> tuple[str, ...]:
        """A plan whose default speculation drafts needs a draft model (a load.draft stage)."""
        spec = params.speculative
        return ("draft_model",) if spec is not None and spec.method == "draft" else ()
    writes = ("generations",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        model, cache, requests, tok, cfg = ctx.model, ctx.kv_cache, ctx.requests, ctx.tokenizer, ctx.model_config
        assert model is not None and cache is not None and requests is not None and tok is not None and cfg
        eos = (
            set() if params.ignore_eos else set(cfg.eos_token_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
        )
        seed = ctx.plan.plan.seed
        runner = ctx.model_runner or ModelRunner(model, cache)
        started = time.perf_counter()
        if params.num_beams > 1:
            results = self._all_beams(ctx, runner, requests, params, eos, seed)
        else:
            size = min(params.batch_size or cache.max_batch, cache.max_batch)
            stream = params.stream and len(requests) == 1 and not ctx.json_mode
            if cache.policy == "slide":
                if any(settings_for(r, params, seed)["speculative"] for r in requests):
                    raise StageFailure('speculative decoding runs in the engine loop: not under the "slide" policy')
                pad = cfg.pad_token_id if cfg.pad_token_id is not None else (tok.pad_id or 0)
                results = []
                for first in range(0, len(requests), size):
                    group = requests[first : first + size]
                    results += self._batch(ctx, runner, group, params, eos, pad, seed, stream)
            else:
                results = self._scheduled(ctx, runner, requests, params, eos, seed, stream, size)
        ctx.generations = results
        # generations.json; timings / attention files when observed
        finish_observing(ctx, results, shared_model=ctx.engine_loop is not None)
        total = sum(len(r.tokens) for r in results)
        wall = time.perf_counter() - started
        ctx.metrics.set("generated_tokens", total)
        ctx.metrics.set("tokens_per_s", total / wall if wall > 0 else 0.0)
        ctx.metrics.set("finish_reasons", [r.finish_detail for r in results])  # the detail: what the report says
        ctx.metrics.set("per_request", [{"id": r.request_id, **r.timings} for r in results])

    # --- sampling / greedy, through the engine loop ------------------------------------------------

    def _scheduled(
        self,
        ctx: InferenceContext,
        runner: ModelRunner,
        requests: list[Request],
        params: GenerateParams,
        eos: set[int],
        seed: int,
        stream: bool,
        running: int,
    ) -> list[Result]:
        tok = ctx.tokenizer
        assert tok is not None and ctx.kv_cache is not None
        served = ctx.engine_loop
        loop = served or new_loop(runner, ctx.kv_cache, params, running, ctx.draft_model)
        if served is None:
            loop.timeline = []  # every step's passes, for the trace and the report
        settings_of = [settings_for(r, params, seed) for r in requests]
        grammars = [grammar_for(ctx, s, eos) for s in settings_of]  # every refusal before the first submit
        if loop.scheduler.draft is None and any(_drafts(s) for s in settings_of):
            raise InputRefused("speculative.method: draft needs the plan's draft model (a load.draft stage)")
        decoder = StreamDecoder(tok, skip_special_tokens=True) if stream else None
        shown = _Streaming(
            StopStringStream(ctx.stream, settings_of[0]["stop"] if stream else []), decoder, frozenset(eos)
        )
        ended = _Countdown(len(requests))
        # Served: a cancel (the client went away) ends the requests at the loop's next step, which wakes us.
        cancel = ctx.cancel if served is not None else None
        submitted = []
        for request, settings, grammar in zip(requests, settings_of, grammars, strict=True):
            prompt = self._fit(ctx, request, ctx.kv_cache.max_tokens)
            seq = loop.submit(
                GenerationRequest(
                    prompt=prompt,
                    picker=picker_for(settings, params, len(prompt), grammar),
                    max_new_tokens=settings["max_new_tokens"],
                    eos_ids=shown.eos_ids,
                    stop=stop_checker(tok, settings["stop"]),
                    on_token=shown.on_token if stream else None,
                    on_finish=ended.one,
                    tag=request.id,
                    cancel=cancel,
                    speculation=Speculation.of(settings["speculative"]),
                )
            )
            submitted.append((request, seq, settings))
        if served is None:
            loop.run()
        else:  # the host's thread steps the served loop: wait for the last request to end
            ctx.stream("")  # every prompt fit and is queued: the server may start its answer's stream now
            ended.all.wait()
        self._end_stream(ctx, shown, served is None)
        return self._collect(ctx, loop, submitted, params, stream)

    @staticmethod
    def _end_stream(ctx: InferenceContext, shown: _Streaming, own_loop: bool) -> None:
        if shown.decoder is None:
            return
        if own_loop:
            # A served answer's tail comes from its final text instead: an incomplete character held back
            # here is dropped there, and the client must get exactly the final text.
            shown.shown.push(shown.decoder.flush())
            shown.shown.end()
            ctx.stream("\n")
        else:
            shown.shown.end()

    @staticmethod
    def _collect(
        ctx: InferenceContext,
        loop: EngineLoop,
        submitted: list[tuple[Request, Sequence, dict[str, Any]]],
        params: GenerateParams,
        stream: bool,
    ) -> list[Result]:
        if loop.timeline is not None:
            record_steps(ctx, loop.timeline)
        stats = loop.stats
        ctx.metrics.set(
            "scheduler",
            {
                "slots": loop.cache.slots,
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
            result = _result(request, gen, settings, stats.busy_max, computed, params.logprobs)
            _record_format(result, seq.request.picker)
            result.streamed = stream
            if gen.finish_reason == "error":
                ctx.log.warning("generation_error", request=request.id, error=gen.error)
            out.append(result)
        return out

    # --- sampling / greedy, static batches (the "slide" cache policy) ------------------------------

    def _batch(
        self,
        ctx: InferenceContext,
        runner: ModelRunner,
        group: list[Request],
        params: GenerateParams,
        eos: set[int],
        pad: int,
        seed: int,
        stream: bool,
    ) -> list[Result]:
        tok, cache = ctx.tokenizer, ctx.kv_cache
        assert cache is not None
        settings = [settings_for(r, params, seed) for r in group]
        prompts = [self._fit(ctx, r, cache.max_tokens) for r in group]
        pickers = [
            picker_for(s, params, len(p), grammar_for(ctx, s, eos)) for s, p in zip(settings, prompts, strict=True)
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
                runner.model,
                cache,
                prompts,
                pickers=pickers,
                max_new_tokens=[s["max_new_tokens"] for s in settings],
                eos_ids=eos,
                pad_id=pad,
                stop_fn=stop_fn if any(c is not None for c in stops) else None,
                on_token=on_token if stream else None,
                prefill_chunk=params.prefill_chunk,
                runner=runner,
            )
        if decoders:
            shown.push(decoders[0].flush())
            shown.end()
            ctx.stream("\n")
        out = []
        batch_prompt = sum(len(p) for p in prompts)
        for request, gen, s, picker in zip(group, gens, settings, pickers, strict=True):
            result = _result(request, gen, s, len(group), batch_prompt, params.logprobs)
            _record_format(result, picker)
            result.streamed = stream
            if gen.finish_reason == "error":
                ctx.log.warning("generation_error", request=request.id, error=gen.error)
            out.append(result)
        return out

    def _fit(self, ctx: InferenceContext, request: Request, capacity: int) -> list[int]:
        """Leave room for at least one generated token; with policy stop, the rest ends as cache_full. A served
        request is never cut here: the server sizes its tokenize limit to the context, so a prompt that still
        does not fit is refused with both numbers."""
        limit = capacity - 1
        if ctx.engine_loop is not None and len(request.prompt_ids) > limit:
            raise InputRefused(f"prompt has {len(request.prompt_ids)} tokens; the limit is {limit} (the context)")
        ids, dropped = truncate(request.prompt_ids, limit, "keep_end", 1 if request.prompt_ids[:1] else 0)
        if dropped:
            ctx.log.warning("prompt_truncated", request=request.id, dropped=dropped, kept=len(ids), limit=limit)
            request.truncated += dropped
        return ids

    # --- beam search --------------------------------------------------------------------------------

    def _all_beams(
        self,
        ctx: InferenceContext,
        runner: ModelRunner,
        requests: list[Request],
        params: GenerateParams,
        eos: set[int],
        seed: int,
    ) -> list[Result]:
        cache = ctx.kv_cache
        assert cache is not None
        if ctx.engine_loop is not None:
            raise StageFailure("beam search cannot run beside a served engine loop (it uses the whole cache)")
        if cache.max_batch < params.num_beams:
            raise StageFailure(
                f"num_beams {params.num_beams} needs {params.num_beams} KV-cache rows; "
                f"the cache has {cache.max_batch} (set max_batch on the load.to_device stage)"
            )
        # every format compiled (or refused) before the first beam runs
        grammars = [grammar_for(ctx, settings_for(r, params, seed), eos) for r in requests]
        return [
            self._beams(ctx, runner, request, params, eos, seed, grammar)
            for request, grammar in zip(requests, grammars, strict=True)
        ]

    def _beams(
        self,
        ctx: InferenceContext,
        runner: ModelRunner,
        request: Request,
        params: GenerateParams,
        eos: set[int],
        seed: int,
        grammar: CompiledFormat | None,
    ) -> Result:
        settings = settings_for(request, params, seed)
        max_new = settings["max_new_tokens"]
        cache = ctx.kv_cache
        assert cache is not None
        prompt = self._fit(ctx, request, cache.max_tokens - max_new + 1)
        cache.reset(params.num_beams)
        start = time.perf_counter()
        allowed: list[int] = []
        try:
            with torch.inference_mode():
                candidates = beam_search(
                    runner.model,
                    cache,
                    prompt,
                    num_beams=params.num_beams,
                    max_new_tokens=max_new,
                    eos_ids=eos,
                    length_penalty=params.length_penalty,
                    num_return_sequences=params.num_return_sequences,
                    early_stopping=params.early_stopping,
                    runner=runner,
                    grammar=grammar,
                    allowed=allowed,
                )
        except (torch.OutOfMemoryError, RuntimeError) as bad:
            ctx.log.warning("generation_error", request=request.id, error=str(bad))
            return Result.failed(request.id, len(prompt), plain_error(bad))
        wall = time.perf_counter() - start
        best = candidates[0]
        # A beam search is timed as a whole (one wall clock): its rows share every pass.
        gen = Generation(len(prompt), list(best.tokens), finish_reason=best.finish_reason, decode_s=wall)
        result = Result(
            request.id,
            gen,
            candidates=list(candidates),
            params=settings | {"num_beams": params.num_beams, "length_penalty": params.length_penalty},
            timed_as="search",
        )
        if grammar is not None:
            result.format_record = {**grammar.format.record(), "complete": complete(grammar, gen.tokens)}
            result.mask_allowed = allowed
        return result


class _Countdown:
    """Set `all` once `one` has been called n times (each request's on_finish, on the stepping thread)."""

    def __init__(self, n: int) -> None:
        self.left, self.all = n, threading.Event()
        if n == 0:
            self.all.set()

    def one(self, _seq: Any) -> None:
        self.left -= 1
        if self.left == 0:
            self.all.set()


def _drafts(settings: dict[str, Any]) -> bool:
    spec = Speculation.of(settings["speculative"])
    return spec is not None and spec.method == "draft"


def new_loop(
    runner: ModelRunner, cache: Any, params: GenerateParams, running: int, draft: DraftModel | None = None
) -> EngineLoop:
    try:
        return EngineLoop(
            runner,
            SlotCache.over(cache),
            max_step_tokens=params.max_step_tokens,
            prefill_chunk=params.prefill_chunk,
            max_running=running,
            prefix_reuse=params.prefix_reuse,
            draft=draft,
        )
    except ValueError as bad:
        raise StageFailure(f"compute.generate: {bad}") from None


def serving_loop(ctx: InferenceContext, params: GenerateParams) -> EngineLoop:
    """The engine loop a resident plan serves with, over the whole cache: its owner steps it and hands it to
    the requests' runs through the context (`ctx.engine_loop`)."""
    cache = ctx.kv_cache
    assert ctx.model is not None and cache is not None
    if params.num_beams > 1:
        raise StageFailure("beam search runs as a static batch over the whole cache: it cannot be served")
    if cache.policy == "slide":
        raise StageFailure('the "slide" KV-cache policy evicts over a shared write pointer: it cannot be served')
    runner = ctx.model_runner or ModelRunner(ctx.model, cache)
    return new_loop(runner, cache, params, cache.max_batch, ctx.draft_model)


def _record_format(result: Result, picker: TokenPicker) -> None:
    """The constraint that ran, whether the answer is whole under it, and how many tokens each step allowed."""
    mask = getattr(picker, "mask", None)
    if mask is None:
        return
    result.format_record = {**mask.compiled.format.record(), "complete": complete(mask.compiled, result.tokens)}
    result.mask_allowed = list(mask.allowed)


def _result(
    request: Request,
    gen: Generation,
    settings: dict[str, Any],
    batch: int,
    batch_prompt: int,
    logprobs: int,
) -> Result:
    """batch_prompt: the prompt tokens the prefill time covers (a static batch's prefill is one pass for all its
    rows; a scheduled request's is its own, less any reused prefix)."""
    return Result(
        request.id, gen, top_n=logprobs, params=settings, timed_as="phases", batch=batch, batch_prompt=batch_prompt
    )
