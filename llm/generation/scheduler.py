"""Continuous batching, the deciding half: which rows get which tokens at each step (llama.cpp's server
slots, vLLM's and TGI's schedulers). It never calls the model: the engine loop (llm/generation/engine_loop.py) runs what
it decides and hands back the outcome.

A `Scheduler` owns the bookkeeping of a `SlotCache` (which slot holds which tokens) and, at every step:

1. Takes what was submitted or cancelled since the last step (thread-safe: a server submits from its own
   threads while another steps the loop). A cancelled request, or one whose `cancel` event is set, ends at
   once with reason "cancelled".
2. Admits waiting requests into free slots, first come first served. A prompt whose first tokens some slot
   already holds (the chat template's system prompt, a conversation's earlier turns) starts from a copy of
   that prefix: with per-slot regions a copy is one strided memcpy of a few hundred KiB, where recomputing it
   is a prefill pass; sharing blocks would need a paged cache and a page table in the native step, for no
   gain at these sizes. The free slot that already holds the longest prefix is taken first (no copy at all).
3. Spends the step's token budget (`max_step_tokens`): one decode token for every running row first, then
   the guesses of the rows that speculate (llm/generation/speculative.py: verified in the same pass, as many as
   their slot, their token limit and the budget leave room for and as pay; a draft model's guesses,
   llm/generation/draft_model.py, made for all its rows together once each row's share is known), then prompt chunks
   of the admitted requests in arrival order. A long prompt thus holds the decoding rows back by one chunk per step,
   never by its whole prefill. A decode row whose slot is full ends with "cache_full".

The `StepPlan` it returns is tokens for rows; the loop runs them as one flat batch (decode rows and prompt
chunks in one native pass: vLLM's chunked prefill), picks, and ends rows through `finish`, which frees the
slot for the next request; its K/V stay there as a prefix for whoever comes next.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..sampling.picks import TokenPicker
from .ending import FinishReason
from .outputs import Generation
from .speculative import DRAFT_COST_PRIOR, DraftGuesser, PassCosts, Speculator

if TYPE_CHECKING:
    from ..kv.slot_cache import SlotCache
    from ..sampling.params import Speculation
    from .draft_model import DraftModel


@dataclass
class GenerationRequest:
    """One request: its prompt ids and how to pick, deliver and stop its tokens."""

    prompt: list[int]
    picker: TokenPicker
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    stop: Callable[[list[int]], bool] | None = None  # generated ids -> True ends with "stop_string"
    on_token: Callable[[int], None] | None = None  # each picked token, EOS included, on the stepping thread
    on_finish: Callable[[Sequence], None] | None = None  # once, when it ends (any reason), on the stepping thread
    tag: Any = None  # the caller's own handle (a request id)
    cancel: threading.Event | None = None  # once set, the request ends at the next step with "cancelled"
    speculation: Speculation | None = None  # guess tokens and verify them with each decode pass


@dataclass(eq=False)
class Sequence:
    """A request inside the scheduler: where it is, what it produced. `done` is set when it has ended."""

    request: GenerationRequest
    generation: Generation
    submitted_at: float
    slot: int | None = None
    prefilled: int = 0  # prompt tokens whose K/V are in the slot
    reused: int = 0  # of those, copied from a cached prefix
    seen: list[int] = field(default_factory=list)  # prompt + generated, for the picker
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    speculator: Speculator | DraftGuesser | None = None  # the request's guesser, when it speculates
    draft: list[int] = field(default_factory=list)  # this step's guesses, verified after the last token
    asked: int = 0  # guesses this step asks of the draft model (its `draft` once made)

    @property
    def decoding(self) -> bool:
        return self.slot is not None and self.prefilled == len(self.request.prompt)


@dataclass
class SchedulerStats:
    steps: int = 0
    decode_tokens: int = 0  # rows decoded, summed over steps
    prefill_tokens: int = 0  # prompt tokens computed
    reused_tokens: int = 0  # prompt tokens copied from a cached prefix instead
    guessed_tokens: int = 0  # speculative guesses verified
    accepted_tokens: int = 0  # of those, accepted
    finished: int = 0
    cancelled: int = 0
    busy_max: int = 0


@dataclass
class StepPlan:
    """What one step computes: one token for each decode row, then prompt chunks (sequence, tokens)."""

    decode: list[Sequence]
    chunks: list[tuple[Sequence, int]]

    def __bool__(self) -> bool:
        return bool(self.decode or self.chunks)


class Scheduler:
    def __init__(
        self,
        cache: SlotCache,
        *,
        max_step_tokens: int = 512,
        prefill_chunk: int | None = None,
        max_running: int | None = None,
        prefix_reuse: bool = True,
        min_prefix: int = 4,
        draft: DraftModel | None = None,
    ) -> None:
        """draft: the model that guesses for requests with `speculative: {method: draft}` (its slots mirror
        the cache's)."""
        self.cache = cache
        if draft is not None and draft.slots < cache.slots:
            raise ValueError(f"the draft model's cache has {draft.slots} slots, the target's {cache.slots}")
        self.draft = draft
        self.max_running = min(max_running or cache.slots, cache.slots)
        if max_step_tokens <= self.max_running:
            # Every step must have room for a prompt chunk beside one token per running row.
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must exceed the running rows ({self.max_running})")
        self.max_step_tokens = max_step_tokens
        # A chunk never exceeds what one write may add to a slot (the sliding layers' rings, llm/kv/layers.py).
        self.prefill_chunk = min(prefill_chunk or max_step_tokens, cache.max_write)
        self.prefix_reuse, self.min_prefix = prefix_reuse, max(1, min_prefix)
        self.stats = SchedulerStats()
        # What a decode pass costs by its inputs: how many guesses pay (the loop measures it, or shares its
        # runner's, which outlives a loop).
        self.pass_costs = PassCosts()
        self._lock = threading.Condition()
        self._incoming: list[Sequence] = []
        self._cancel: list[Sequence] = []
        self._cancel_everything = False
        # Called (from the submitting thread) whenever work arrives: lets whoever steps the loop sleep on a
        # wake-up of its own instead of polling.
        self.on_work: Callable[[], None] | None = None
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # in admission order
        self._watched: list[Sequence] = []  # those with a cancel event of their own
        self._free = list(range(cache.slots))

    # --- the thread-safe surface --------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Sequence:
        """Queue a request; it is admitted at a coming step. Raises ValueError when it can never run."""
        if not request.prompt:
            raise ValueError("a prompt needs at least one token")
        if len(request.prompt) > self.cache.max_tokens:
            raise ValueError(f"a prompt of {len(request.prompt)} tokens does not fit a slot of {self.cache.max_tokens}")
        seq = Sequence(request, Generation(prompt_tokens=len(request.prompt)), time.perf_counter())
        seq.seen = list(request.prompt)
        spec = request.speculation
        if spec is not None and spec.method == "draft":
            if self.draft is None:
                raise ValueError("speculative.method: draft needs a draft model (a load.draft stage in the plan)")
            seq.speculator = DraftGuesser(spec.tokens)
        elif spec is not None:
            seq.speculator = Speculator(spec.tokens, spec.ngram)
        if seq.speculator is not None:
            seq.generation.speculation = seq.speculator.steps
        with self._lock:
            self._incoming.append(seq)
            self._lock.notify_all()
        self._notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """End a request at the next step with reason "cancelled" (no-op once it has ended)."""
        with self._lock:
            self._cancel.append(seq)
            self._lock.notify_all()
        self._notify()

    def cancel_all(self) -> None:
        """Cancel every request submitted and not yet ended (shutting down, unloading)."""
        with self._lock:
            self._cancel_everything = True  # read by the stepping thread: it alone touches waiting/running
            self._lock.notify_all()
        self._notify()

    def _notify(self) -> None:
        if self.on_work is not None:
            self.on_work()

    def wait_for_work(self, timeout_s: float) -> None:
        """Sleep until a submit or cancel arrives (or `timeout_s` passes) unless one already has."""
        with self._lock:
            if not (self._incoming or self._cancel or self._cancel_everything):
                self._lock.wait(timeout_s)

    @property
    def pending(self) -> int:
        """Requests submitted and not yet ended."""
        with self._lock:
            return len(self._incoming) + len(self._waiting) + len(self._running)

    @property
    def busy_slots(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._incoming) + len(self._waiting)

    @property
    def kv_usage(self) -> float:
        """Tokens cached by running requests / the cache's capacity."""
        used = sum(self.cache.lengths[s.slot] for s in list(self._running) if s.slot is not None)
        return used / (self.cache.slots * self.cache.max_tokens)

    # --- one step -----------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The rows and tokens of the next step; None when there was nothing to do at all (an empty plan
        when requests only ended: cancelled, out of room)."""
        cancelled = self._take_cancelled()
        for seq in cancelled:
            self._end_cancelled(seq)
        self._admit()
        if not self._running:
            return StepPlan([], []) if cancelled else None
        self.stats.steps += 1
        self.stats.busy_max = max(self.stats.busy_max, len(self._running))
        decode = self._with_room([s for s in self._running if s.decoding])
        budget = self.max_step_tokens - len(decode)
        width = len(decode)  # the pass's inputs so far: what a row's guesses are priced against
        for seq in decode:
            drafted = self._draft(seq, budget, width)
            budget, width = budget - drafted, width + drafted
        asked = [seq for seq in decode if seq.asked]
        if asked:
            assert self.draft is not None
            made = self.draft.propose([(seq.slot, seq.seen, seq.asked) for seq in asked])  # type: ignore[misc]
            for seq, guesses in zip(asked, made, strict=True):
                seq.draft, seq.asked = guesses, 0
        chunks: list[tuple[Sequence, int]] = []
        for seq in self._running:
            if seq.decoding:
                continue
            n = min(len(seq.request.prompt) - seq.prefilled, self.prefill_chunk, budget)
            if n <= 0:
                break
            chunks.append((seq, n))
            budget -= n
        return StepPlan(decode, chunks)

    def _take_cancelled(self) -> list[Sequence]:
        with self._lock:
            self._waiting.extend(self._incoming)
            self._watched += [s for s in self._incoming if s.request.cancel is not None]
            self._incoming.clear()
            cancelled, self._cancel = self._cancel, []
            if self._cancel_everything:
                cancelled += [*self._waiting, *self._running]
                self._cancel_everything = False
        if self._watched:
            self._watched = [s for s in self._watched if not s.done.is_set()]
            cancelled += [s for s in self._watched if s.request.cancel.is_set()]  # type: ignore[union-attr]
        return cancelled

    def _admit(self) -> None:
        while self._waiting and self._free and len(self._running) < self.max_running:
            seq = self._waiting.popleft()
            slot, reuse = self._slot_for(seq.request.prompt)
            self._free.remove(slot)
            self.cache.truncate(slot, reuse)
            seq.slot, seq.prefilled, seq.reused = slot, reuse, reuse
            seq.admitted_at = time.perf_counter()
            seq.generation.queued_s = seq.admitted_at - seq.submitted_at
            self.stats.reused_tokens += reuse
            self._running.append(seq)
            if seq.request.max_new_tokens <= 0:
                self.finish(seq, "length")

    def _slot_for(self, prompt: list[int]) -> tuple[int, int]:
        """A free slot for `prompt` and how many of its first tokens that slot holds (copied there if need be)."""
        if not self.prefix_reuse:
            return self._free[0], 0
        # The longest prefix any slot holds, at least one prompt token left to compute (for its logits).
        slot = max(self._free, key=lambda s: self.cache.common_prefix(s, prompt))
        reuse = self.cache.common_prefix(slot, prompt)
        source = slot
        for other in self._running:
            held = self.cache.common_prefix(other.slot, prompt)  # type: ignore[arg-type]
            if held > reuse:
                source, reuse = other.slot, held
        reuse = min(reuse, len(prompt) - 1)
        if reuse < self.min_prefix or not self.cache.can_resume(source, reuse):  # a ring moved on: recompute
            reuse = 0
        if source != slot and reuse:
            self.cache.copy_prefix(source, slot, reuse)  # type: ignore[arg-type]
        return slot, reuse

    def _draft(self, seq: Sequence, budget: int, width: int) -> int:
        """The row's guesses for this step (none without speculation); how many. Each guess takes a slot and
        a token of the budget, and no more are made than the request's token limit can still use, nor than
        pay on a pass of `width` inputs."""
        seq.draft, seq.asked = [], 0
        if seq.speculator is None:
            return 0
        length = self.cache.lengths[seq.slot]  # type: ignore[index]
        room = min(
            self.cache.max_tokens - length - 1,
            self.cache.max_write - 1,  # the last token and its guesses are one write (the rings)
            seq.request.max_new_tokens - len(seq.generation.tokens) - 1,
            budget - 1,  # a step keeps room for a prompt chunk beside the decode rows
        )
        cost = lambda k: self.pass_costs.relative(width, k)  # noqa: E731
        if isinstance(seq.speculator, DraftGuesser):
            seq.asked = seq.speculator.plan(room, cost, self._draft_step_cost(width))
            return seq.asked
        seq.draft = seq.speculator.propose(seq.seen, room, cost)
        return len(seq.draft)

    def _draft_step_cost(self, width: int) -> float:
        """A draft step as a share of this step's target pass of `width` inputs (measured, or the prior)."""
        one, step = self.pass_costs.one, self.draft.step_s if self.draft is not None else None
        share = step / one if one and step else DRAFT_COST_PRIOR
        return share / self.pass_costs.cost(width)

    def _with_room(self, rows: list[Sequence]) -> list[Sequence]:
        """The decode rows whose slot has room for one more token; the others end with "cache_full"."""
        ready = []
        for seq in rows:
            if self.cache.lengths[seq.slot] >= self.cache.max_tokens:  # type: ignore[index]
                self.finish(seq, "cache_full")
            else:
                ready.append(seq)
        return ready

    # --- ending -------------------------------------------------------------------------------------

    def _end_cancelled(self, seq: Sequence) -> None:
        if seq.done.is_set():
            return
        if seq in self._waiting:
            self._waiting.remove(seq)
            self._ended(seq, "cancelled", None)
        elif seq in self._running:
            self.finish(seq, "cancelled")

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End a running request and free its slot (its K/V stay there as a reusable prefix)."""
        if seq.slot is not None and seq in self._running:
            self._running.remove(seq)
            self._free.append(seq.slot)
        self._ended(seq, reason, error)

    def _ended(self, seq: Sequence, reason: FinishReason, error: str | None) -> None:
        gen = seq.generation
        gen.finish_reason, gen.error = reason, error
        self.stats.cancelled += reason == "cancelled"
        if gen.ttft_s is not None:
            gen.decode_s = time.perf_counter() - seq.first_token_at
        self.stats.finished += 1
        if seq.request.on_finish is not None:
            seq.request.on_finish(seq)
        seq.done.set()
