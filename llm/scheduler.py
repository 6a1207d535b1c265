"""Continuous batching: requests join and leave the running batch at every step (llama.cpp's server slots,
vLLM's and TGI's schedulers).

A `Scheduler` owns a `SlotCache` and runs one **step** at a time:

1. Take what was submitted or cancelled since the last step (thread-safe: a server submits from its own
   threads while `serve` steps in another). A cancelled request ends at once with reason "cancelled".
2. Admit waiting requests into free slots, first come first served. A prompt whose first tokens some slot
   already holds (the chat template's system prompt, a conversation's earlier turns) starts from a copy of
   that prefix: with per-slot regions a copy is one strided memcpy of a few hundred KiB, where recomputing it
   is a prefill pass; sharing blocks would need a paged cache and a page table in the native step, for no
   gain at these sizes. The free slot that already holds the longest prefix is taken first (no copy at all).
3. Spend the step's token budget (`max_step_tokens`): one decode token for every running row first, then
   prompt chunks of the admitted requests in arrival order. A long prompt thus holds the decoding rows
   back by one chunk per step, never by its whole prefill.
4. Run the step. Where the native fused pass applies, the decode rows and the prompt chunks are one call:
   every input is a (slot, position) pair, a chunk's inputs see each other causally, and the weights are read
   once for all of them (a decode row riding along a prefill costs one more GEMM row, not another pass over
   the weights: vLLM's chunked prefill). Otherwise the torch modules run the decode rows in one pass over a
   cache view and each prompt chunk in its own.
5. Pick a token for every row whose logits came out (decode rows, and prompts whose last chunk ran), deliver
   it (`on_token`), and end a row the moment it finishes: EOS, its length limit, a stop condition, its slot
   full ("cache_full"), non-finite logits ("error", that row only). An out-of-memory pass is retried in
   halves, so it ends only the rows that fail alone. A finished row frees its slot for the next request, and
   its K/V stay there as a prefix for whoever comes next.

The result of a request is a `Generation`, the same record the static `generate()` returns.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .fused_decode import FusedDecoder
from .generate import FinishReason, Generation, TokenPicker, finite_rows, is_oom, release_memory
from .model import Transformer
from .slot_cache import SlotCache


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

    @property
    def decoding(self) -> bool:
        return self.slot is not None and self.prefilled == len(self.request.prompt)


@dataclass
class StepRecord:
    """What one step ran and when (perf_counter seconds): kept only when `Scheduler.timeline` is a list."""

    start: float
    end: float = 0.0
    decode: tuple[float, float, int] | None = None  # (start, end, rows) of the decode pass
    prefill: list[tuple[float, float, Any, int]] = field(default_factory=list)  # (start, end, tag, tokens) per chunk


@dataclass
class SchedulerStats:
    steps: int = 0
    decode_tokens: int = 0  # rows decoded, summed over steps
    prefill_tokens: int = 0  # prompt tokens computed
    reused_tokens: int = 0  # prompt tokens copied from a cached prefix instead
    finished: int = 0
    cancelled: int = 0
    busy_max: int = 0


class Scheduler:
    def __init__(
        self,
        model: Transformer,
        cache: SlotCache,
        *,
        max_step_tokens: int = 512,
        prefill_chunk: int | None = None,
        max_running: int | None = None,
        prefix_reuse: bool = True,
        min_prefix: int = 4,
    ) -> None:
        self.model, self.cache = model, cache
        self.max_running = min(max_running or cache.slots, cache.slots)
        if max_step_tokens <= self.max_running:
            # Every step must have room for a prompt chunk beside one token per running row.
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must exceed the running rows ({self.max_running})")
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk = prefill_chunk or max_step_tokens
        self.prefix_reuse, self.min_prefix = prefix_reuse, max(1, min_prefix)
        self.stats = SchedulerStats()
        # A list to record every step's passes into (a run's trace and report); None: nothing kept (serving).
        self.timeline: list[StepRecord] | None = None
        self._lock = threading.Condition()
        self._incoming: list[Sequence] = []
        self._cancel: list[Sequence] = []
        self._cancel_everything = False
        # Called (from the submitting thread) whenever work arrives: lets whoever steps this scheduler sleep
        # on a wake-up of its own instead of polling.
        self.on_work: Callable[[], None] | None = None
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # in admission order
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

    def run(self) -> None:
        """Step until every submitted request has ended (offline use: a prompt file, a benchmark)."""
        while self.step():
            pass

    def serve(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """Step while there is work; sleep until a submit or cancel when there is none; return once `stop` is
        set (requests still running are left as they are: cancel them first to end them)."""
        while not stop.is_set():
            if not self.step():
                with self._lock:
                    if not (self._incoming or self._cancel or self._cancel_everything):
                        self._lock.wait(idle_wait_s)

    # --- one step ---------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one step; False when there was nothing to do."""
        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
            cancelled, self._cancel = self._cancel, []
            if self._cancel_everything:
                cancelled += [*self._waiting, *self._running]
                self._cancel_everything = False
        for seq in cancelled:
            self._end_cancelled(seq)
        self._admit()
        if not self._running:
            return bool(cancelled)
        self.stats.steps += 1
        self.stats.busy_max = max(self.stats.busy_max, len(self._running))
        with torch.inference_mode():
            decode = [s for s in self._running if s.decoding]
            budget = self.max_step_tokens - len(decode)
            chunks: list[tuple[Sequence, int]] = []
            for seq in self._running:
                if seq.decoding:
                    continue
                n = min(len(seq.request.prompt) - seq.prefilled, self.prefill_chunk, budget)
                if n <= 0:
                    break
                chunks.append((seq, n))
                budget -= n
            record = StepRecord(time.perf_counter()) if self.timeline is not None else None
            picks: list[tuple[Sequence, Tensor, bool]] = []
            # One native pass for the step's prompt chunks and its decode rows; a step of decode rows alone
            # is `_decode` (which also retries an out-of-memory pass in halves on the torch path).
            fused = FusedDecoder.bound(self.model, self.cache) if chunks else None
            if fused is not None:
                picks += self._mixed_pass(fused, decode, chunks, record)
            else:
                if decode:
                    picks += self._decode(decode)
                    if record is not None:
                        record.decode = (record.start, time.perf_counter(), len(decode))
                for seq, n in chunks:
                    began = time.perf_counter()
                    logits = self._prefill(seq, n)
                    if record is not None:
                        record.prefill.append((began, time.perf_counter(), seq.request.tag, n))
                    if logits is not None:
                        picks.append((seq, logits, bool(finite_rows(logits))))
            for seq, logits, finite in picks:
                self._pick(seq, logits, finite)
            if record is not None and self.timeline is not None:
                record.end = time.perf_counter()
                self.timeline.append(record)
        return True

    def _admit(self) -> None:
        while self._waiting and self._free and len(self._running) < self.max_running:
            seq = self._waiting.popleft()
            prompt = seq.request.prompt
            slot = self._free[0]
            reuse = 0
            if self.prefix_reuse:
                # The longest prefix any slot holds, at least one prompt token left to compute (for its logits).
                best_free = max(self._free, key=lambda s: self.cache.common_prefix(s, prompt))
                slot, reuse = best_free, self.cache.common_prefix(best_free, prompt)
                source = slot
                for other in self._running:
                    held = self.cache.common_prefix(other.slot, prompt)  # type: ignore[arg-type]
                    if held > reuse:
                        source, reuse = other.slot, held
                reuse = min(reuse, len(prompt) - 1)
                if reuse < self.min_prefix:
                    reuse = 0
                if source != slot and reuse:
                    self.cache.copy_prefix(source, slot, reuse)  # type: ignore[arg-type]
            self._free.remove(slot)
            self.cache.truncate(slot, reuse)
            seq.slot, seq.prefilled, seq.reused = slot, reuse, reuse
            seq.admitted_at = time.perf_counter()
            seq.generation.queued_s = seq.admitted_at - seq.submitted_at
            self.stats.reused_tokens += reuse
            self._running.append(seq)
            if seq.request.max_new_tokens <= 0:
                self._finish(seq, "length")

    def _prefill(self, seq: Sequence, n: int) -> Tensor | None:
        """Compute the next `n` prompt tokens of `seq`; the last position's logits when the prompt is done."""
        slot = seq.slot
        assert slot is not None
        ids = seq.request.prompt[seq.prefilled : seq.prefilled + n]
        [start] = self.cache.claim([slot], [ids])
        device = self.model.device
        tokens = torch.tensor([ids], device=device)
        positions = torch.arange(start, start + n, device=device)[None]
        try:
            logits = self.model(tokens, positions, self.cache.rows([slot], [start]), last_only=True)
        except RuntimeError as err:
            if not is_oom(err):
                raise
            self.cache.unclaim([slot], [start])
            release_memory(device)
            self._finish(seq, "error", f"out of memory during prefill: {err}")
            return None
        seq.prefilled += n
        self.stats.prefill_tokens += n
        if seq.prefilled < len(seq.request.prompt):
            return None
        seq.generation.prefill_s = time.perf_counter() - seq.admitted_at
        return logits[0, -1].float()

    def _with_room(self, rows: list[Sequence]) -> list[Sequence]:
        """The decode rows whose slot has room for one more token; the others end with "cache_full"."""
        ready = []
        for seq in rows:
            if self.cache.lengths[seq.slot] >= self.cache.max_tokens:  # type: ignore[index]
                self._finish(seq, "cache_full")
            else:
                ready.append(seq)
        return ready

    def _mixed_pass(
        self, fused: FusedDecoder, decode: list[Sequence], chunks: list[tuple[Sequence, int]], record: StepRecord | None
    ) -> list[tuple[Sequence, Tensor, bool]]:
        """The step's prompt chunks and its decode rows (if any) in one native pass; logits for every decode
        row and for the last token of each prompt this step completes."""
        ready = self._with_room(decode)
        seqs = ready + [seq for seq, _ in chunks]
        parts = [[s.generation.tokens[-1]] for s in ready]
        parts += [seq.request.prompt[seq.prefilled : seq.prefilled + n] for seq, n in chunks]
        slots: list[int] = [s.slot for s in seqs]  # type: ignore[misc]
        starts = self.cache.claim(slots, parts)
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        ends: list[int] = []  # each part's last input
        for slot, start, part in zip(slots, starts, parts, strict=True):
            tokens += part
            positions += range(start, start + len(part))
            rows += [slot] * len(part)
            ends.append(len(tokens) - 1)
        done = [seq.prefilled + n == len(seq.request.prompt) for seq, n in chunks]
        outs = ends[: len(ready)] + [end for end, last in zip(ends[len(ready) :], done, strict=True) if last]
        began = time.perf_counter()
        try:
            at = torch.tensor(positions)
            logits = fused.run(torch.tensor(tokens), at, torch.tensor(rows), at, torch.tensor(outs, dtype=torch.long))
        except BaseException:
            self.cache.unclaim(slots, starts)
            raise
        ended = time.perf_counter()
        finite = finite_rows(logits).tolist()
        picks = []
        for i, seq in enumerate(ready):
            seq.generation.decode_steps += 1
            picks.append((seq, logits[i], finite[i]))
        self.stats.decode_tokens += len(ready)
        at_out = len(ready)
        for (seq, n), last in zip(chunks, done, strict=True):
            seq.prefilled += n
            self.stats.prefill_tokens += n
            if last:
                seq.generation.prefill_s = ended - seq.admitted_at
                picks.append((seq, logits[at_out], finite[at_out]))
                at_out += 1
        if record is not None:  # one pass: the decode rows and the chunks share its span
            if ready:
                record.decode = (began, ended, len(ready))
            record.prefill += [(began, ended, seq.request.tag, n) for seq, n in chunks]
        return picks

    def _decode(self, rows: list[Sequence]) -> list[tuple[Sequence, Tensor, bool]]:
        """One token for each row; a row whose slot is full ends with "cache_full"."""
        ready = self._with_room(rows)
        if not ready:
            return []
        try:
            logits = self._forward_rows(ready)
        except RuntimeError as err:
            if not is_oom(err):
                raise
            release_memory(self.model.device)
            if len(ready) == 1:
                self._finish(ready[0], "error", f"out of memory during decode: {err}")
                return []
            half = len(ready) // 2  # smaller passes need less memory: end only the rows that fail alone
            return self._decode(ready[:half]) + self._decode(ready[half:])
        for seq in ready:
            seq.generation.decode_steps += 1
        self.stats.decode_tokens += len(ready)
        finite = finite_rows(logits).tolist()  # one check for the whole pass
        return [(seq, logits[i], finite[i]) for i, seq in enumerate(ready)]

    def _forward_rows(self, rows: list[Sequence]) -> Tensor:
        """fp32 logits [M, V] of each row's last picked token, its K/V appended to its slot."""
        slots = [s.slot for s in rows]
        last = [s.generation.tokens[-1] for s in rows]
        starts = self.cache.claim(slots, [[t] for t in last])  # type: ignore[list-item]
        try:
            fused = FusedDecoder.bound(self.model, self.cache)
            if fused is not None:
                pos = torch.tensor(starts)
                return fused.step_rows(torch.tensor(last), pos, torch.tensor(slots), pos)
            device = self.model.device
            tokens = torch.tensor(last, device=device)[:, None]
            positions = torch.tensor(starts, device=device)[:, None]
            view = self.cache.rows(slots, starts)  # type: ignore[arg-type]
            return self.model(tokens, positions, view, last_only=True)[:, -1].float()
        except BaseException:
            self.cache.unclaim(slots, starts)  # type: ignore[arg-type]
            raise

    def _pick(self, seq: Sequence, logits: Tensor, finite: bool) -> None:
        gen, request = seq.generation, seq.request
        if not finite:
            self._finish(seq, "error", f"non-finite logits (NaN/inf) at generated token {len(gen.tokens)}")
            return
        pick = request.picker(logits, seq.seen)
        gen.tokens.append(pick.token)
        gen.token_times.append(time.perf_counter())
        gen.logprobs.append(pick.logprob)
        gen.top_logprobs.append(pick.top)
        seq.seen.append(pick.token)
        if gen.ttft_s is None:
            seq.first_token_at = time.perf_counter()
            gen.ttft_s = seq.first_token_at - seq.submitted_at
        if request.on_token is not None:
            request.on_token(pick.token)
        if pick.token in request.eos_ids:
            self._finish(seq, "eos")
        elif request.stop is not None and request.stop(gen.tokens):
            self._finish(seq, "stop_string")
        elif len(gen.tokens) >= request.max_new_tokens:
            self._finish(seq, "length")

    def _end_cancelled(self, seq: Sequence) -> None:
        if seq.done.is_set():
            return
        if seq in self._waiting:
            self._waiting.remove(seq)
            self._ended(seq, "cancelled", None)
        elif seq in self._running:
            self._finish(seq, "cancelled")

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
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
