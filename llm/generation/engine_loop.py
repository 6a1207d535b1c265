"""The engine loop: schedule → run → post-step, one step at a time (nano-vllm's `LLMEngine.step`; vLLM v1:
no prefill phase and no decode phase, every step is tokens for rows).

* the `Scheduler` (llm/generation/scheduler.py) decides which rows get which tokens;
* the `ModelRunner` (llm/generation/model_runner.py) runs them as one flat batch on the backend chosen at its build;
* the post-step here picks a token for every row whose logits came out (decode rows, and prompts whose last
  chunk ran), delivers it (`on_token`) and ends the row the moment it finishes (llm/generation/ending.py). A row that
  speculates ran its last token and its guesses in the pass: its picks go on while they equal the guesses
  (llm/generation/speculative.py), and its slot is cut back to the tokens delivered (the K/V of rejected guesses are
  dropped; a ring layer's rows they overwrote were out of every later query's window).

A pass that runs out of memory is retried in halves, so it ends only the rows that fail alone; a row with
non-finite logits ends alone with "error". Whoever owns the loop steps it: `run` until every request has
ended (a prompt file, a benchmark), `serve` until told to stop, or `step` from a loop of one's own (a
server's model thread). The result of a request is a `Generation`, the record static `generate()` returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..sampling.picks import Pick
from ..sampling.token_mask import MaskError
from .ending import FinishReason, end_after_token, non_finite, out_of_memory
from .flat_batch import FlatBatch, Part
from .outputs import finite_rows, is_oom, release_memory
from .scheduler import GenerationRequest, Scheduler, SchedulerStats, Sequence
from .speculative import DraftGuesser, accept

if TYPE_CHECKING:
    from ..kv.slot_cache import SlotCache
    from ..model.transformer import Transformer
    from .model_runner import ModelRunner


@dataclass
class StepRecord:
    """What one step ran and when (perf_counter seconds): kept only when `EngineLoop.timeline` is a list."""

    start: float
    end: float = 0.0
    decode: tuple[float, float, int] | None = None  # (start, end, rows) of the decode rows' pass
    prefill: list[tuple[float, float, Any, int]] = field(default_factory=list)  # (start, end, tag, tokens) per chunk


Item = tuple[Sequence, int]  # a row and its tokens this step: n == 0 marks a decode row (1 + its draft), else a chunk


class EngineLoop:
    def __init__(self, runner: ModelRunner, cache: SlotCache, **scheduling: Any) -> None:
        """scheduling: the `Scheduler`'s settings (max_step_tokens, prefill_chunk, max_running, prefix_reuse…)."""
        self.runner, self.cache = runner, cache
        self.scheduler = Scheduler(cache, **scheduling)
        costs = getattr(runner, "pass_costs", None)  # the runner's, measured over every loop it ran (a test's
        if costs is not None:  # stand-in runner has none: the scheduler's own then)
            self.scheduler.pass_costs = costs
        # A list to record every step's passes into (a run's trace and report); None: nothing kept (serving).
        self.timeline: list[StepRecord] | None = None

    @classmethod
    def for_model(cls, model: Transformer, cache: SlotCache, **scheduling: Any) -> EngineLoop:
        """A loop with a runner of its own (a benchmark, a test); a plan's runner is built at load."""
        from .model_runner import ModelRunner

        return cls(ModelRunner(model, cache), cache, **scheduling)

    # the scheduler's thread-safe surface, for whoever holds the loop
    def submit(self, request: GenerationRequest) -> Sequence:
        return self.scheduler.submit(request)

    def cancel(self, seq: Sequence) -> None:
        self.scheduler.cancel(seq)

    def cancel_all(self) -> None:
        self.scheduler.cancel_all()

    @property
    def pending(self) -> int:
        return self.scheduler.pending

    @property
    def on_work(self) -> Callable[[], None] | None:
        """Called whenever work arrives (from the submitting thread): the owner's wake-up."""
        return self.scheduler.on_work

    @on_work.setter
    def on_work(self, wake: Callable[[], None] | None) -> None:
        self.scheduler.on_work = wake

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def run(self) -> None:
        """Step until every submitted request has ended."""
        while self.step():
            pass

    def serve(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """Step while there is work; sleep until a submit or cancel when there is none; return once `stop` is
        set (requests still running are left as they are: cancel them first to end them)."""
        while not stop.is_set():
            if not self.step():
                self.scheduler.wait_for_work(idle_wait_s)

    # --- one step ---------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one step; False when there was nothing to do."""
        plan = self.scheduler.schedule()
        if plan is None:
            return False
        if not plan:
            return True
        began = time.perf_counter()
        record = StepRecord(began) if self.timeline is not None else None
        # A decode-only step's inputs: its pass and picks, timed, tell speculation what guesses cost.
        width = 0 if plan.chunks else sum(1 + len(seq.draft) for seq in plan.decode)
        with torch.inference_mode():
            items: list[Item] = [(seq, 0) for seq in plan.decode] + plan.chunks
            for seq, logits, finite in self._forward(items, record):
                self._pick(seq, logits, finite)
            self._draft_follows(plan.chunks)
        if width:
            self.scheduler.pass_costs.add(width, time.perf_counter() - began)
        if record is not None and self.timeline is not None:
            record.end = time.perf_counter()
            self.timeline.append(record)
        return True

    def _draft_follows(self, chunks: list[Item]) -> None:
        """The draft model runs the prompt chunks of the rows it guesses for, in the same step as the target:
        its prompt is in its cache by the row's first guess (prefill time, not the answer's)."""
        draft = self.scheduler.draft
        rows = [(seq.slot, seq.request.prompt[: seq.prefilled]) for seq, _ in chunks]
        rows = [row for row, (seq, _) in zip(rows, chunks, strict=True) if isinstance(seq.speculator, DraftGuesser)]
        if draft is not None and rows:
            draft.follow(rows)  # type: ignore[arg-type]

    def _forward(self, items: list[Item], record: StepRecord | None) -> list[tuple[Sequence, Tensor, bool]]:
        """One flat pass over the step's rows; logits for every decode row and for the last token of each
        prompt this step completes. Out of memory: the two halves apart, down to the rows that fail alone."""
        slots: list[int] = [seq.slot for seq, _ in items]  # type: ignore[misc]
        ids = [self._inputs(seq, n) for seq, n in items]
        starts = self.cache.claim(slots, ids)
        parts = [
            Part(slot, start, part, len(part) if not n else seq.prefilled + n == len(seq.request.prompt))
            for slot, start, part, (seq, n) in zip(slots, starts, ids, items, strict=True)
        ]
        try:
            logits = self.runner.forward(FlatBatch(parts), self.cache)
        except BaseException as err:
            self.cache.unclaim(slots, starts)
            if not (isinstance(err, RuntimeError) and is_oom(err)):
                raise
            release_memory(self.runner.model.device)
            if len(items) == 1:
                seq, n = items[0]
                self.scheduler.finish(seq, "error", out_of_memory("prefill" if n else "decode", err))
                return []
            half = len(items) // 2  # smaller passes need less memory: end only the rows that fail alone
            return self._forward(items[:half], record) + self._forward(items[half:], record)
        return self._after_pass(items, logits, record)

    @staticmethod
    def _inputs(seq: Sequence, n: int) -> list[int]:
        """A decode row's last picked token and its guesses, or the prompt chunk's next `n` tokens."""
        return seq.request.prompt[seq.prefilled : seq.prefilled + n] if n else [seq.generation.tokens[-1], *seq.draft]

    def _after_pass(
        self, items: list[Item], logits: Tensor, record: StepRecord | None
    ) -> list[tuple[Sequence, Tensor, bool]]:
        """Count what the pass computed; the rows to pick for, with their logits and whether they are finite."""
        finite = finite_rows(logits).tolist()  # one check for the whole pass
        spans, stats = self.runner.spans, self.scheduler.stats
        picks, at, decoded = [], 0, 0
        for (seq, n), (began, ended) in zip(items, spans, strict=True):
            if not n:
                seq.generation.decode_steps += 1
                decoded += 1
                if seq.draft:  # the last token's logits and each guess's, one row each
                    width = 1 + len(seq.draft)
                    picks.append((seq, logits[at : at + width], all(finite[at : at + width])))
                    at += width
                    continue
            else:
                seq.prefilled += n
                stats.prefill_tokens += n
                if record is not None:
                    record.prefill.append((began, ended, seq.request.tag, n))
                if seq.prefilled < len(seq.request.prompt):
                    continue
                seq.generation.prefill_s = ended - seq.admitted_at
            picks.append((seq, logits[at], finite[at]))
            at += 1
        stats.decode_tokens += decoded
        if record is not None and decoded:
            began, ended = spans[0][0], spans[decoded - 1][1]
            rows = decoded if record.decode is None else record.decode[2] + decoded
            record.decode = (began if record.decode is None else record.decode[0], ended, rows)
        return picks

    def _pick(self, seq: Sequence, logits: Tensor, finite: bool) -> None:
        """The row's next token; a decode row with guesses (`logits` [1 + guesses, V]): its tokens up to the
        first pick that is not its guess. A format's matcher failing (llguidance refusing a token its own
        mask allowed) ends that row alone with "error": one request must not stop the loop."""
        if not finite:
            self.scheduler.finish(seq, "error", non_finite(len(seq.generation.tokens)))
            return
        try:
            self._picked(seq, logits)
        except MaskError as bad:
            self.scheduler.finish(seq, "error", f"format: {bad}".splitlines()[0])

    def _picked(self, seq: Sequence, logits: Tensor) -> None:
        gen, request = seq.generation, seq.request
        if not seq.draft:
            pick = request.picker(logits, seq.seen)
            if seq.speculator is not None:  # the guess it did not make, checked for free
                seq.speculator.observe(pick.token)
            reason = self._deliver(seq, pick)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            return
        draft, seq.draft, generated = seq.draft, [], len(gen.tokens)
        start = self.cache.lengths[seq.slot] - len(draft) - 1  # type: ignore[index]
        ended: list[FinishReason] = []

        def deliver(pick: Pick) -> bool:
            reason = self._deliver(seq, pick)
            ended.extend([reason] if reason is not None else [])
            return reason is None

        delivered = accept(request.picker, logits, draft, seq.seen, deliver)
        # All picks but the last were accepted guesses; the last one too where it equals its guess.
        last = delivered - 1
        accepted = last + (last < len(draft) and gen.tokens[-1] == draft[last])
        # Keep the K/V of the inputs now part of the text (the last token, the guesses delivered before the
        # last pick): the slot ends where a row without speculation would.
        self.cache.truncate(seq.slot, start + delivered)  # type: ignore[arg-type]
        assert seq.speculator is not None
        seq.speculator.record(generated, len(draft), accepted)
        gen.guessed, gen.accepted = seq.speculator.guessed, seq.speculator.accepted
        stats = self.scheduler.stats
        stats.guessed_tokens += len(draft)
        stats.accepted_tokens += accepted
        if ended:
            self.scheduler.finish(seq, ended[0])

    def _deliver(self, seq: Sequence, pick: Pick) -> FinishReason | None:
        """Add a picked token to the row and hand it on; why the row ends after it (the caller ends it), or None."""
        gen, request = seq.generation, seq.request
        gen.add(pick)
        gen.token_times.append(time.perf_counter())
        seq.seen.append(pick.token)
        if gen.ttft_s is None:
            seq.first_token_at = time.perf_counter()
            gen.ttft_s = seq.first_token_at - seq.submitted_at
        if request.on_token is not None:
            request.on_token(pick.token)
        return end_after_token(pick.token, gen.tokens, request.eos_ids, request.stop, request.max_new_tokens)
