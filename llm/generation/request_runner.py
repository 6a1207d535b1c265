"""The library's one front door for generation: requests in, `Generation`s out, the loop that fits chosen here.

A caller (a plan's generate stage, a server, a benchmark) hands over prompts with their `SamplingParams`, the
cache and the model runner; `run_requests` compiles each request's `format` (every refusal before the first
token), builds its picker and stop check, and runs them through the loop that fits:

* beam search (`LoopOptions.num_beams > 1`): one request at a time over the whole cache (llm/generation/beam_search.py);
* the "slide" cache policy (one shared write pointer), or when asked (a benchmark's comparison): static batches
  (llm/generation/static_batch.py);
* everything else: the engine loop (llm/generation/engine_loop.py), the caller's resident one when it serves
  (`served`, stepped by its owner's thread: this waits for the requests to end), else one made and run here.

A single request's text can be streamed as it is generated (`on_text`), its stop strings never shown.
What a caller records (a plan's results, a server's answer) it builds from the `Outcome`s; what is refused
is raised as `Refused` (the request's own input) or `CannotRun` (the cache or loop the caller set up).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..kv.cache import KVCache
from ..kv.slot_cache import SlotCache
from ..sampling.chain import build_picker
from ..sampling.constrained_format import UnsupportedFormat
from ..sampling.format_compiler import CompiledFormat, compile_format
from ..sampling.params import HOW_GREEDY, SamplingParams
from ..sampling.picks import TokenPicker
from ..text.stop_strings import StopStringStream, stop_checker
from ..text.tokenizer import StreamDecoder
from .beam_search import Candidate, beam_search
from .draft_model import DraftModel
from .engine_loop import EngineLoop
from .model_runner import ModelRunner
from .outputs import Generation
from .scheduler import GenerationRequest, Sequence
from .static_batch import generate


class Refused(ValueError):
    """A request's own input cannot be run (a format that cannot be enforced, a draft with no draft model)."""


class CannotRun(RuntimeError):
    """These requests cannot run on the cache and loop the caller set up (beams beside a served loop...)."""


class BadLoopSettings(CannotRun):
    """The loop's settings do not fit its cache or model (the caller says whose settings they are)."""


@dataclass(frozen=True)
class LoopOptions:
    """How the requests are run (not what each asks for): beams, batching, the engine loop's step budget."""

    num_beams: int = 1
    length_penalty: float = 1.0
    num_return_sequences: int = 1
    early_stopping: bool | Literal["never"] = False
    batch_size: int | None = None  # requests running at once; default: the cache's rows
    prefill_chunk: int | None = None
    max_step_tokens: int = 512
    prefix_reuse: bool = True
    keep_timeline: bool = False  # a loop made here records every step's passes (a run's trace and report)
    static_batches: bool = False  # static batches even where the engine loop could run (a benchmark's other side)

    def refusal(self, defaults: SamplingParams) -> str | None:
        """Why these options cannot run requests with these settings (checked when a plan is read), or None."""
        if self.num_return_sequences > self.num_beams:
            return f"num_return_sequences ({self.num_return_sequences}) exceeds num_beams ({self.num_beams})"
        if stop_beside_format(defaults) is not None:
            return stop_beside_format(defaults)
        if self.num_beams > 1 and not defaults.greedy:
            return f"beam search is deterministic here: use {HOW_GREEDY} with num_beams > 1"
        if self.num_beams > 1 and defaults.speculative is not None:
            return "speculative decoding runs in the engine loop, beam search apart: not both"
        return None


@dataclass
class PromptRequest:
    """One request: its prompt ids (the caller's `fit` may cut them to the room there is) and its settings."""

    prompt: list[int]
    sampling: SamplingParams
    tag: Any = None  # the caller's own handle (a request id)


@dataclass(frozen=True)
class Vocabulary:
    """What the door needs of the tokenizer side: decoding (stop strings, streaming), the ids that end a
    request (empty: none does, as `ignore_eos`), the static batches' padding, the logits' width (formats)."""

    tokenizer: Any
    eos_ids: frozenset[int]
    pad_id: int
    vocab_size: int


# (request index, most prompt tokens that fit) -> the prompt to run; the caller cuts, logs or refuses
PromptFit = Callable[[int, int], list[int]]


@dataclass
class Outcome:
    """One request's result, in the order given. `batch`/`batch_prompt`: the rows that ran beside it and the
    prompt tokens its prefill time covers (a static batch's one pass; the loop's own, less a reused prefix)."""

    generation: Generation
    batch: int = 1
    batch_prompt: int = 0
    grammar: CompiledFormat | None = None  # the format that ran, compiled
    allowed: list[int] = field(default_factory=list)  # with a format: tokens the mask allowed, per step
    candidates: list[Candidate] = field(default_factory=list)  # beam search, best first
    error: BaseException | None = None  # a beam search that failed (out of memory): nothing generated
    streamed: bool = False
    batch_start_s: float = 0.0  # static batches: its batch's start, after the run's (its ttft_s counts from there)


@dataclass
class GenerationRun:
    """The outcomes, and the engine loop that ran them (its stats and timeline), None for beams or slide."""

    outcomes: list[Outcome]
    loop: EngineLoop | None = None


def run_requests(
    runner: ModelRunner,
    cache: KVCache,
    requests: list[PromptRequest],
    options: LoopOptions,
    vocab: Vocabulary,
    *,
    fit: PromptFit | None = None,
    on_text: Callable[[str], None] | None = None,
    served: EngineLoop | None = None,
    draft: DraftModel | None = None,
    cancel: threading.Event | None = None,
    on_queued: Callable[[], None] | None = None,
) -> GenerationRun:
    """Run every request through the loop that fits (module docstring); outcomes in the order given.

    fit: cuts (or refuses) a prompt to the room there is; default: a prompt that does not fit is refused.
    on_text: a single request's text, streamed as generated (ignored for several requests and for beams).
    served: the resident engine loop to submit to (its owner steps it); cancel: ends them there at its next step;
    on_queued: called once every prompt is queued on it. draft: the draft model of a loop made here.
    """
    fit = fit or _as_given(requests)
    if options.num_beams > 1:
        if served is not None:
            raise CannotRun("beam search cannot run beside a served engine loop (it uses the whole cache)")
        return GenerationRun(_all_beams(runner, cache, requests, options, vocab, fit))
    stream = on_text if len(requests) == 1 else None
    if cache.policy == "slide" or options.static_batches:
        if any(r.sampling.speculative is not None for r in requests):
            where = 'under the "slide" policy' if cache.policy == "slide" else "in static batches"
            raise CannotRun(f"speculative decoding runs in the engine loop: not {where}")
        return GenerationRun(_static_batches(runner, cache, requests, options, vocab, fit, stream))
    loop = served or new_loop(runner, cache, options, _running(options, cache), draft)
    if served is None and options.keep_timeline:
        loop.timeline = []
    return _scheduled(loop, cache, requests, vocab, fit, stream, served is not None, cancel, on_queued)


def new_loop(
    runner: ModelRunner, cache: Any, options: LoopOptions, running: int, draft: DraftModel | None = None
) -> EngineLoop:
    """An engine loop over the cache's rows (`running` at once); BadLoopSettings when its settings do not fit."""
    try:
        return EngineLoop(
            runner,
            SlotCache.over(cache),
            max_step_tokens=options.max_step_tokens,
            prefill_chunk=options.prefill_chunk,
            max_running=running,
            prefix_reuse=options.prefix_reuse,
            draft=draft,
        )
    except ValueError as bad:
        raise BadLoopSettings(str(bad)) from None


def serving_loop(
    runner: ModelRunner, cache: KVCache, options: LoopOptions, draft: DraftModel | None = None
) -> EngineLoop:
    """The resident engine loop a server steps, over the whole cache: its owner hands it to each request's
    run (`run_requests(served=...)`). Beams and the "slide" policy take the whole cache: never served."""
    if options.num_beams > 1:
        raise CannotRun("beam search runs as a static batch over the whole cache: it cannot be served")
    if cache.policy == "slide":
        raise CannotRun('the "slide" KV-cache policy evicts over a shared write pointer: it cannot be served')
    return new_loop(runner, cache, options, cache.max_batch, draft)


# --- the engine loop -----------------------------------------------------------------------------------


def _scheduled(
    loop: EngineLoop,
    cache: KVCache,
    requests: list[PromptRequest],
    vocab: Vocabulary,
    fit: PromptFit,
    on_text: Callable[[str], None] | None,
    served: bool,
    cancel: threading.Event | None,
    on_queued: Callable[[], None] | None,
) -> GenerationRun:
    grammars = [_grammar(r.sampling, vocab) for r in requests]  # every refusal before the first submit
    if loop.scheduler.draft is None and any(_drafts(r.sampling) for r in requests):
        raise Refused("speculative.method: draft needs the plan's draft model (a load.draft stage)")
    shown = _Streaming.of(on_text, requests, vocab)
    ended = _Countdown(len(requests))
    submitted = []
    for index, (request, grammar) in enumerate(zip(requests, grammars, strict=True)):
        prompt = fit(index, cache.max_tokens - 1)
        submitted.append(
            loop.submit(
                GenerationRequest(
                    prompt=prompt,
                    picker=_picker(request.sampling, grammar, len(prompt)),
                    max_new_tokens=token_room(request.sampling, cache.max_tokens),
                    eos_ids=vocab.eos_ids,
                    stop=stop_checker(vocab.tokenizer, request.sampling.stop),
                    on_token=shown.on_token if shown is not None else None,
                    on_finish=ended.one,
                    tag=request.tag,
                    cancel=cancel if served else None,
                    speculation=request.sampling.speculative,
                )
            )
        )
    if not served:
        loop.run()
    else:  # the owner's thread steps the served loop: wait for the last request to end
        if on_queued is not None:
            on_queued()
        ended.all.wait()
    if shown is not None:
        shown.end(flush=not served)
    return GenerationRun([_loop_outcome(seq, loop, shown is not None) for seq in submitted], loop)


def _loop_outcome(seq: Sequence, loop: EngineLoop, streamed: bool) -> Outcome:
    gen = seq.generation
    mask = getattr(seq.request.picker, "mask", None)
    return Outcome(
        gen,
        batch=loop.stats.busy_max,
        batch_prompt=gen.prompt_tokens - seq.reused,
        grammar=mask.compiled if mask is not None else None,
        allowed=list(mask.allowed) if mask is not None else [],
        streamed=streamed,
    )


def _running(options: LoopOptions, cache: KVCache) -> int:
    return min(options.batch_size or cache.max_batch, cache.max_batch)


# --- static batches (the "slide" cache policy) ----------------------------------------------------------


def _static_batches(
    runner: ModelRunner,
    cache: KVCache,
    requests: list[PromptRequest],
    options: LoopOptions,
    vocab: Vocabulary,
    fit: PromptFit,
    on_text: Callable[[str], None] | None,
) -> list[Outcome]:
    grammars = [_grammar(r.sampling, vocab) for r in requests]  # every refusal before the first batch
    size = _running(options, cache)
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    for first in range(0, len(requests), size):
        batch_start = time.perf_counter() - started
        rows = range(first, min(first + size, len(requests)))
        prompts = [fit(i, cache.max_tokens - 1) for i in rows]
        pickers = [_picker(requests[i].sampling, grammars[i], len(p)) for i, p in zip(rows, prompts, strict=True)]
        gens = _static_batch(runner, cache, [requests[i] for i in rows], prompts, pickers, options, vocab, on_text)
        batch_prompt = sum(len(p) for p in prompts)
        for gen, picker in zip(gens, pickers, strict=True):
            mask = getattr(picker, "mask", None)
            outcomes.append(
                Outcome(
                    gen,
                    batch=len(prompts),
                    batch_prompt=batch_prompt,
                    grammar=mask.compiled if mask is not None else None,
                    allowed=list(mask.allowed) if mask is not None else [],
                    streamed=on_text is not None,
                    batch_start_s=batch_start,
                )
            )
    return outcomes


def _static_batch(
    runner: ModelRunner,
    cache: KVCache,
    group: list[PromptRequest],
    prompts: list[list[int]],
    pickers: list[TokenPicker],
    options: LoopOptions,
    vocab: Vocabulary,
    on_text: Callable[[str], None] | None,
) -> list[Generation]:
    stops = [stop_checker(vocab.tokenizer, r.sampling.stop) for r in group]
    shown = _Streaming.of(on_text, group, vocab)

    def stop_fn(row: int, ids: list[int]) -> bool:
        check = stops[row]
        return check is not None and check(ids)

    def on_token(row: int, token: int) -> None:
        if shown is not None:  # streamed only when the batch is one request: its row 0
            shown.on_token(token)

    cache.reset(len(group))
    with torch.inference_mode():
        gens = generate(
            runner.model,
            cache,
            prompts,
            pickers=pickers,
            max_new_tokens=[token_room(r.sampling, cache.max_tokens) for r in group],
            eos_ids=set(vocab.eos_ids),
            pad_id=vocab.pad_id,
            stop_fn=stop_fn if any(c is not None for c in stops) else None,
            on_token=on_token if shown is not None else None,
            prefill_chunk=options.prefill_chunk,
            runner=runner,
        )
    if shown is not None:
        shown.end(flush=True)
    return gens


# --- beam search -----------------------------------------------------------------------------------------


def _all_beams(
    runner: ModelRunner,
    cache: KVCache,
    requests: list[PromptRequest],
    options: LoopOptions,
    vocab: Vocabulary,
    fit: PromptFit,
) -> list[Outcome]:
    if cache.max_batch < options.num_beams:
        raise CannotRun(
            f"num_beams {options.num_beams} needs {options.num_beams} KV-cache rows; "
            f"the cache has {cache.max_batch} (set max_batch on the load.to_device stage)"
        )
    grammars = [_grammar(r.sampling, vocab) for r in requests]  # every refusal before the first beam runs
    outcomes = []
    for index, (request, grammar) in enumerate(zip(requests, grammars, strict=True)):
        # the prompt leaves room for max_new_tokens (none set: one token); each is cut just before its own search
        prompt = fit(index, cache.max_tokens - (request.sampling.max_new_tokens or 1))
        outcomes.append(_beams(runner, cache, request, options, vocab, grammar, prompt))
    return outcomes


def _beams(
    runner: ModelRunner,
    cache: KVCache,
    request: PromptRequest,
    options: LoopOptions,
    vocab: Vocabulary,
    grammar: CompiledFormat | None,
    prompt: list[int],
) -> Outcome:
    cache.reset(options.num_beams)
    start = time.perf_counter()
    allowed: list[int] = []
    try:
        with torch.inference_mode():
            candidates = beam_search(
                runner.model,
                cache,
                prompt,
                num_beams=options.num_beams,
                max_new_tokens=request.sampling.max_new_tokens or cache.max_tokens - len(prompt) + 1,
                eos_ids=set(vocab.eos_ids),
                length_penalty=options.length_penalty,
                num_return_sequences=options.num_return_sequences,
                early_stopping=options.early_stopping,
                runner=runner,
                grammar=grammar,
                allowed=allowed,
            )
    except (torch.OutOfMemoryError, RuntimeError) as bad:
        return Outcome(Generation(len(prompt), finish_reason="error", error=str(bad)), error=bad)
    wall = time.perf_counter() - start
    best = candidates[0]
    # A beam search is timed as a whole (one wall clock): its rows share every pass.
    gen = Generation(len(prompt), list(best.tokens), finish_reason=best.finish_reason, decode_s=wall)
    return Outcome(gen, grammar=grammar, allowed=allowed, candidates=list(candidates))


# --- each request's format, picker, stream ---------------------------------------------------------------


def token_room(sampling: SamplingParams, context: int) -> int:
    """A request's token limit for a loop: its own, or with none (null) the context's rows, which the slot fills
    first (the row ends `cache_full`), so an answer runs to EOS or a full context as in Ollama and vLLM."""
    return sampling.max_new_tokens if sampling.max_new_tokens is not None else context


def stop_beside_format(sampling: SamplingParams) -> str | None:
    """Why stop strings cannot run beside a format, or None: a stop string matched inside the shape would end the
    answer where the shape is not whole (`"` inside a JSON string), and finish "stop" would claim it whole."""
    if sampling.format is None or not sampling.stop:
        return None
    return "stop: not with a format (a stop string could end the answer before its shape is whole); give one of them"


def _grammar(sampling: SamplingParams, vocab: Vocabulary) -> CompiledFormat | None:
    """The request's `format` compiled against the tokenizer (cached per tokenizer and format), or None.
    Refused before any token is generated when it cannot be enforced (fail closed)."""
    if sampling.format is None:
        return None
    beside = stop_beside_format(sampling)
    if beside is not None:
        raise Refused(beside)
    if not vocab.eos_ids:
        raise Refused("format: a constrained answer ends with its end-of-sequence token (not with ignore_eos)")
    try:
        return compile_format(sampling.format, vocab.tokenizer, vocab.eos_ids, vocab.vocab_size)
    except UnsupportedFormat as bad:
        raise Refused(f"format: {bad}") from None


def _picker(sampling: SamplingParams, grammar: CompiledFormat | None, prompt_len: int) -> TokenPicker:
    if grammar is not None:  # built as given: the settings were checked when they were made
        values = {f.name: getattr(sampling, f.name) for f in dataclasses.fields(sampling)}
        sampling = SamplingParams.trusted(**(values | {"grammar": grammar}))
    return build_picker(sampling, prompt_len)


def _drafts(sampling: SamplingParams) -> bool:
    return sampling.speculative is not None and sampling.speculative.method == "draft"


def _as_given(requests: list[PromptRequest]) -> PromptFit:
    """The default fit: each prompt as it is, refused when it does not leave room for one generated token."""

    def fit(index: int, limit: int) -> list[int]:
        prompt = requests[index].prompt
        if len(prompt) > limit:
            raise Refused(f"prompt has {len(prompt)} tokens; the limit is {limit} (the cache)")
        return prompt

    return fit


@dataclass
class _Streaming:
    """A single request's text, shown as it is generated (its stop strings never shown, even in part)."""

    shown: StopStringStream
    decoder: StreamDecoder
    eos_ids: frozenset[int]

    @classmethod
    def of(
        cls, on_text: Callable[[str], None] | None, requests: list[PromptRequest], vocab: Vocabulary
    ) -> _Streaming | None:
        if on_text is None:
            return None
        stops = StopStringStream(on_text, requests[0].sampling.stop)
        return cls(stops, StreamDecoder(vocab.tokenizer, skip_special_tokens=True), vocab.eos_ids)

    def on_token(self, token: int) -> None:
        if token not in self.eos_ids:
            piece = self.decoder.push(token)
            if piece:
                self.shown.push(piece)

    def end(self, flush: bool) -> None:
        # A served answer's tail comes from its final text instead: an incomplete character held back here
        # is dropped there, and the client must get exactly the final text.
        if flush:
            self.shown.push(self.decoder.flush())
        self.shown.end()


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
