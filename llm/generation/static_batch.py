"""Batched autoregressive generation: one prefill pass (or chunks), then one token per live row per step.

The batch is left-padded, so every row's last prompt token sits in the same column and one decode step
feeds one token per row. A finished row stays in the batch (fed `pad_id`, output ignored) until all rows are
done: removing it would mean compacting the cache, which costs more than the wasted row.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..kv.cache import KVCache
from ..model.transformer import Transformer
from ..sampling.picks import Pick, TokenPicker
from .ending import FinishReason, end_after_token, non_finite, out_of_memory
from .model_runner import ModelRunner
from .outputs import Generation, finite_rows, is_oom, release_memory

__all__ = ["FinishReason", "Generation", "Pick", "TokenPicker", "finite_rows", "generate", "is_oom", "release_memory"]


def generate(
    model: Transformer,
    cache: KVCache,
    prompts: list[list[int]],
    *,
    pickers: Sequence[TokenPicker],
    max_new_tokens: list[int] | int,
    eos_ids: set[int],
    pad_id: int,
    stop_fn: Callable[[int, list[int]], bool] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    prefill_chunk: int | None = None,
    runner: ModelRunner | None = None,
) -> list[Generation]:
    """Generate for every prompt at once; one `Generation` per prompt, in order.

    pickers: one per row, called with that row's fp32 logits and prompt + generated ids.
    stop_fn(row, generated_ids) -> True ends the row with "stop_string" (checked after EOS, before length).
    on_token(row, token_id) is called for every generated token, EOS included, as soon as it is picked.
    prefill_chunk: prefill at most this many columns per forward pass (bounds activation memory).
    runner: the model runner bound to `cache`'s memory (a plan's, chosen at load); default: one built here.
    A row whose logits are not finite ends with "error"; an out-of-memory error in a forward pass ends
    every row still running with "error" rather than raising.
    """
    batch = len(prompts)
    limits = [max_new_tokens] * batch if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if batch == 0:
        return []
    if len(pickers) != batch or len(limits) != batch:
        raise ValueError(f"{batch} prompts need as many pickers ({len(pickers)}) and limits ({len(limits)})")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    run = _StaticBatch(prompts, pickers, limits, eos_ids, pad_id, stop_fn, on_token)
    runner = runner or ModelRunner(model, cache)
    with torch.inference_mode():
        cache.reset(batch)
        last = run.prefill(runner, cache, prefill_chunk)
        if last is not None and any(run.live):
            run.pick_all(last)
        run.decode(runner, cache)
    return run.gens


class _StaticBatch:
    """The rows of one `generate` call: left-padded prefill together, then one decode step for all per token.

    compute.generate runs a plan's requests through the engine loop (llm/generation/engine_loop.py) except under the
    "slide" KV-cache policy, and only this runs that: the loop's slot cache has no eviction (it stops a row
    at cache_full), and slide evicts over the batch's one write pointer here (StreamingLLM: kept keys
    re-rotated). Cost is no reason to keep it: evicting 64 of 512 slots row by row measured no dearer than
    all 8 rows at once (SmolLM2-135M fp32 cache, 2 shared CPU threads, median of 7, two runs: 125 and
    582 ms for 8 single rows, 157 and 3792 ms for the batch), so once the slot cache evicts per slot, slide
    becomes a request setting of the loop and this class can go. `generate()` also serves benchmarks and
    tests as the reference static batch. The ending rules are the loop's (llm/generation/ending.py); beam search is
    apart for its own measured reason (llm/generation/beam_search.py)."""

    def __init__(
        self,
        prompts: list[list[int]],
        pickers: Sequence[TokenPicker],
        limits: list[int],
        eos_ids: set[int],
        pad_id: int,
        stop_fn: Callable[[int, list[int]], bool] | None,
        on_token: Callable[[int, int], None] | None,
    ) -> None:
        self.prompts, self.pickers, self.limits = prompts, pickers, limits
        self.eos_ids, self.pad_id, self.stop_fn, self.on_token = eos_ids, pad_id, stop_fn, on_token
        self.batch = len(prompts)
        self.start = time.perf_counter()
        self.gens = [Generation(prompt_tokens=len(p)) for p in prompts]
        self.seen = [list(p) for p in prompts]
        self.live = [limit > 0 for limit in limits]
        self.first_token_at = [0.0] * self.batch
        self.next_ids = [pad_id] * self.batch
        for row in range(self.batch):
            if not self.live[row]:
                self.gens[row].finish_reason = "length"

    def finish(self, row: int, reason: FinishReason, error: str | None = None) -> None:
        gen = self.gens[row]
        gen.finish_reason, gen.error = reason, error
        self.live[row] = False
        self.next_ids[row] = self.pad_id
        if gen.ttft_s is not None:
            gen.decode_s = time.perf_counter() - self.first_token_at[row]

    def finish_live(self, reason: FinishReason, error: str | None = None) -> None:
        for row in range(self.batch):
            if self.live[row]:
                self.finish(row, reason, error)

    def pick_all(self, logits: Tensor) -> None:
        """Pick one token for each live row from fp32 logits [batch, V]."""
        finite = finite_rows(logits).tolist()  # also waits for the forward pass
        for row in range(self.batch):
            if not self.live[row]:
                continue
            gen = self.gens[row]
            if not finite[row]:
                self.finish(row, "error", non_finite(len(gen.tokens)))
                continue
            pick = self.pickers[row](logits[row], self.seen[row])
            gen.add(pick)
            self.seen[row].append(pick.token)
            if gen.ttft_s is None:
                self.first_token_at[row] = time.perf_counter()
                gen.ttft_s = self.first_token_at[row] - self.start
            self.next_ids[row] = pick.token
            if self.on_token is not None:
                self.on_token(row, pick.token)
            stop = None if self.stop_fn is None else functools.partial(self.stop_fn, row)
            reason = end_after_token(pick.token, gen.tokens, self.eos_ids, stop, self.limits[row])
            if reason is not None:
                self.finish(row, reason)

    def prefill(self, runner: ModelRunner, cache: KVCache, prefill_chunk: int | None) -> Tensor | None:
        """Every prompt through the model, left-padded so each row's last token is in the last column; the
        fp32 logits of those last tokens, or None when the prefill could not finish."""
        device, pad_id, prompts = runner.model.device, self.pad_id, self.prompts
        width = max(len(p) for p in prompts)
        tokens = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts], device=device)
        positions = (valid.cumsum(1) - 1).clamp(min=0)  # padding does not advance positions
        chunk = min(prefill_chunk or width, cache.max_write)  # a sliding layer's ring takes max_write a write
        if cache.policy == "slide":
            chunk = min(chunk, cache.max_tokens - cache.sink_tokens)
        logits: Tensor | None = None
        try:
            for lo in range(0, width, chunk):
                hi = min(lo + chunk, width)
                if not cache.make_room(hi - lo):
                    self.finish_live("cache_full")
                    logits = None
                    break
                logits = runner.static_prefill(
                    tokens[:, lo:hi], positions[:, lo:hi], cache, valid[:, lo:hi], logits=hi == width
                )
        except RuntimeError as err:
            if not is_oom(err):
                raise
            logits = None
            release_memory(device)
            self.finish_live("error", out_of_memory("prefill", err))
        last = None
        if logits is not None:
            last = logits[:, -1].float()
            torch.isfinite(last[:1, :1]).item()  # wait for the device, so prefill_s is the real time
        prefill_s = time.perf_counter() - self.start
        for gen in self.gens:
            gen.prefill_s = prefill_s
        return last

    def decode(self, runner: ModelRunner, cache: KVCache) -> None:
        """One token per live row per step until every row has ended."""
        device = runner.model.device
        step_tokens = torch.full((self.batch, 1), self.pad_id, dtype=torch.long, device=device)
        while any(self.live):
            if not cache.make_room(1):
                self.finish_live("cache_full")
                break
            step_tokens.copy_(torch.tensor(self.next_ids).view(self.batch, 1))
            try:
                logits = runner.static_decode(step_tokens, cache.next_positions(), cache)
            except RuntimeError as err:
                if not is_oom(err):
                    raise
                release_memory(device)
                self.finish_live("error", out_of_memory("decode", err))
                break
            for row in range(self.batch):
                self.gens[row].decode_steps += self.live[row]
            self.pick_all(logits[:, -1].float())
