"""`compute.generate`: a plan's requests through the library's generation door, and what a run records of them.

The door (llm/generation/request_runner.py) chooses the loop (the engine loop with continuous batching, beam
search, or static batches under the "slide" cache policy), compiles formats, builds pickers and stop checks and
streams text. This stage gives it each request's effective settings (the stage's, then the request's own), cuts
prompts to the room there is, and turns what the door refuses into the engine's findings (InputRefused,
StageFailure). What comes back it records: `generations` (Results with their format record), the run's metrics,
the scheduler's steps for the trace and report (stages/observe.py).

Whoever owns the loop steps it: a resident plan's host puts the loop it steps into the context
(`engine_loop`), and the door submits to it and waits for the requests to end (a cancel ends them at the
loop's next step); otherwise (`llmplan run`) the door makes a loop of its own and steps it to the end.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from llmplan.engine.findings import InputRefused, StageFailure
from llmplan.engine.stage import DeepCheck, Phase, Stage
from llmplan.llm.generation import (
    BadLoopSettings,
    CannotRun,
    GenerationRun,
    LoopOptions,
    ModelRunner,
    Outcome,
    PromptRequest,
    Refused,
    Vocabulary,
    run_requests,
)
from llmplan.llm.sampling import SamplingParams, complete
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

    @field_validator("ignore_eos")
    @classmethod
    def _format_ends_at_eos(cls, value: bool, info: ValidationInfo) -> bool:
        # `run` refuses the pair at its first request (the door's _grammar): `validate` names this line instead
        if value and info.data.get("format") is not None:
            raise ValueError("true with a format: a constrained answer ends with its end-of-sequence token; drop one")
        return value

    @model_validator(mode="after")
    def _beams(self) -> GenerateParams:
        own = plain_settings({name: getattr(self, name) for name in RequestSettings.model_fields})
        refusal = loop_options(self).refusal(sampling_params(own, logprobs_top_n=0))
        if refusal is not None:
            raise ValueError(refusal)
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


def loop_options(params: GenerateParams) -> LoopOptions:
    """How the stage's parameters ask the door to run its requests (beams, batching, the loop's budget)."""
    return LoopOptions(
        num_beams=params.num_beams,
        length_penalty=params.length_penalty,
        num_return_sequences=params.num_return_sequences,
        early_stopping=params.early_stopping,
        batch_size=params.batch_size,
        prefill_chunk=params.prefill_chunk,
        max_step_tokens=params.max_step_tokens,
        prefix_reuse=params.prefix_reuse,
        keep_timeline=True,  # every step's passes, for the trace and the report
    )


def stage_failure(bad: CannotRun) -> StageFailure:
    """What the door cannot run, as the engine's finding (the loop's own settings named as this stage's)."""
    return StageFailure(f"compute.generate: {bad}" if isinstance(bad, BadLoopSettings) else str(bad))


class Generate(Stage):
    """Prefill and decode with the KV cache; sample (or beam-search); stop; stream text."""

    name = "compute.generate"
    phase = Phase.COMPUTE
    Params = GenerateParams
    reads = ("model", "kv_cache", "requests", "tokenizer", "model_config")
    optional_reads = ("model_runner", "engine_loop", "draft_model")

    @classmethod
    def draws_from_seed(cls, params: Any) -> bool:
        own = plain_settings({name: getattr(params, name) for name in RequestSettings.model_fields})
        sampling = sampling_params(own, logprobs_top_n=0)
        return not sampling.greedy and sampling.seed is None  # greedy rows and a pinned seed draw nothing new

    @classmethod
    def needs(cls, params: Any) -> tuple[str, ...]:
        """A plan whose default speculation drafts needs a draft model (a load.draft stage)."""
        spec = params.speculative
        return ("draft_model",) if spec is not None and spec.method == "draft" else ()

    writes = ("generations",)

    def check(self, params: Any, deep: DeepCheck) -> None:
        """`validate --deep`: the plan's format compiled against the model's tokenizer, as `run` would first do,
        so what only a tokenizer shows (a literal spelling the end token, a matcher limit met in its first
        steps) is a finding at the format's line instead of a refusal when the run starts."""
        model_dir, cfg = deep.facts.get("model_dir"), deep.facts.get("model_config")
        if params.format is None or model_dir is None or cfg is None or params.ignore_eos:
            return
        from llmplan.llm.sampling import UnsupportedFormat, compile_format
        from llmplan.llm.text import Tokenizer

        tok = Tokenizer.from_dir(model_dir)
        eos = set(cfg.eos_token_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
        try:
            compile_format(params.format.value, tok, frozenset(eos), cfg.vocab_size)
        except UnsupportedFormat as bad:
            deep.problem(f"format: {bad}", "format." + ".".join(map(str, bad.field_path)))

    def run(self, ctx: InferenceContext, params: Any) -> None:
        model, cache, requests = ctx.model, ctx.kv_cache, ctx.requests
        assert model is not None and cache is not None and requests is not None
        seed = ctx.plan.plan.seed
        settings = [settings_for(r, params, seed) for r in requests]
        stream = params.stream and len(requests) == 1 and not ctx.json_mode
        served = ctx.engine_loop
        asks = [
            PromptRequest(r.prompt_ids, _sampling(s, params), r.id) for r, s in zip(requests, settings, strict=True)
        ]
        runner = ctx.model_runner or ModelRunner(model, cache)
        started = time.perf_counter()
        try:
            run = run_requests(
                runner,
                cache,
                asks,
                loop_options(params),
                _vocabulary(ctx, params),
                fit=lambda index, limit: self._fit(ctx, requests[index], limit),
                on_text=ctx.stream if stream else None,
                served=served,
                draft=ctx.draft_model,
                cancel=ctx.cancel if served is not None else None,
                on_queued=lambda: ctx.stream(""),  # every prompt fit and is queued: the answer's stream may start
            )
        except Refused as bad:
            raise InputRefused(str(bad)) from None
        except CannotRun as bad:
            raise stage_failure(bad) from None
        if stream and served is None and params.num_beams == 1:
            ctx.stream("\n")  # the terminal's line after the streamed text
        results = self._record(ctx, run, requests, settings, params)
        ctx.generations = results
        # generations.json; timings / attention files when observed
        finish_observing(ctx, results, shared_model=served is not None)
        total = sum(len(r.tokens) for r in results)
        wall = time.perf_counter() - started
        ctx.metrics.set("generated_tokens", total)
        ctx.metrics.set("tokens_per_s", total / wall if wall > 0 else 0.0)
        ctx.metrics.set("backend", runner.backend)  # native (the fused pass) or torch: observing must not change it
        ctx.metrics.set("finish_reasons", [r.finish_detail for r in results])  # the detail: what the report says
        ctx.metrics.set("per_request", [{"id": r.request_id, **r.timings} for r in results])

    @staticmethod
    def _record(
        ctx: InferenceContext,
        run: GenerationRun,
        requests: list[Request],
        settings: list[dict[str, Any]],
        params: GenerateParams,
    ) -> list[Result]:
        """Each outcome as the run's Result, the scheduler's steps and counts when the engine loop ran them."""
        loop = run.loop
        if loop is not None:
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
        for request, outcome, setting in zip(requests, run.outcomes, settings, strict=True):
            result = _result(request, outcome, setting, params)
            if outcome.generation.finish_reason == "error" or outcome.error is not None:
                ctx.log.warning("generation_error", request=request.id, error=outcome.generation.error)
            out.append(result)
        return out

    def _fit(self, ctx: InferenceContext, request: Request, limit: int) -> list[int]:
        """At most `limit` prompt tokens (room for at least one generated token; with policy stop, the rest ends
        as cache_full). A served request is never cut here: the server sizes its tokenize limit to the context,
        so a prompt that still does not fit is refused with both numbers."""
        if ctx.engine_loop is not None and len(request.prompt_ids) > limit:
            raise InputRefused(f"prompt has {len(request.prompt_ids)} tokens; the limit is {limit} (the context)")
        ids, dropped = truncate(request.prompt_ids, limit, "keep_end", 1 if request.prompt_ids[:1] else 0)
        if dropped:
            ctx.log.warning("prompt_truncated", request=request.id, dropped=dropped, kept=len(ids), limit=limit)
            request.truncated += dropped
        return ids


def _sampling(settings: dict[str, Any], params: GenerateParams) -> SamplingParams:
    """A request's effective settings as the library's SamplingParams (alternatives kept for the record)."""
    bias = tuple(sorted(params.logit_bias.items()))
    return sampling_params(settings, logprobs_top_n=max(params.logprobs, ALTERNATIVES), logit_bias=bias)


def _vocabulary(ctx: InferenceContext, params: GenerateParams) -> Vocabulary:
    tok, cfg = ctx.tokenizer, ctx.model_config
    assert tok is not None and cfg is not None
    eos = set() if params.ignore_eos else set(cfg.eos_token_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (tok.pad_id or 0)
    return Vocabulary(tok, frozenset(eos), pad, cfg.vocab_size)


def _result(request: Request, outcome: Outcome, settings: dict[str, Any], params: GenerateParams) -> Result:
    """The run's record of one request. Beams are timed as one search; the loops' rows by phase, with the prompt
    tokens their prefill covered (a static batch's one pass for all its rows; a scheduled request's own)."""
    gen = outcome.generation
    if outcome.error is not None:
        return Result.failed(request.id, gen.prompt_tokens, plain_error(outcome.error))
    if params.num_beams > 1:
        beam_settings = settings | {"num_beams": params.num_beams, "length_penalty": params.length_penalty}
        result = Result(request.id, gen, candidates=outcome.candidates, params=beam_settings, timed_as="search")
    else:
        result = Result(
            request.id,
            gen,
            top_n=params.logprobs,
            params=settings,
            timed_as="phases",
            batch=outcome.batch,
            batch_prompt=outcome.batch_prompt,
        )
        result.streamed = outcome.streamed
    if outcome.grammar is not None:  # the constraint that ran, whether the answer is whole under it, each step's room
        result.format_record = {**outcome.grammar.format.record(), "complete": complete(outcome.grammar, gen.tokens)}
        result.mask_allowed = outcome.allowed
    return result
