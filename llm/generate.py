"""Batched autoregressive generation: one prefill pass (or chunks), then one token per live row per step.

The batch is left-padded, so every row's last prompt token sits in the same column and one decode step
feeds one token per row. A finished row stays in the batch (fed `pad_id`, output ignored) until all rows are
done: removing it would mean compacting the cache, which costs more than the wasted row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import Tensor

from .fused_decode import decode_step
from .kv_cache import KVCache
from .model import Transformer


@dataclass
class Pick:
    """One chosen token. `logprob` is log-softmax of the raw model logits at that token."""

    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None


class TokenPicker(Protocol):
    """Chooses the next token of one row from its fp32 logits [V] and the ids seen so far."""

    def __call__(self, logits_row: Tensor, seen: list[int]) -> Pick: ...


FinishReason = Literal["eos", "length", "stop_string", "cache_full", "error", "cancelled"]


@dataclass
class Generation:
    """One row's output. `tokens` are the generated ids only, ending with the EOS id when reason is "eos"."""

    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    prefill_s: float = 0.0  # the whole batch's prefill (scheduler: this request's own, admission to logits)
    ttft_s: float | None = None  # generate() start (scheduler: submission) -> this row's first token picked
    queued_s: float = 0.0  # scheduler: submission -> admission into a slot
    decode_s: float = 0.0  # first token -> this row's last token
    decode_steps: int = 0  # decode forward passes this row took part in
    token_times: list[float] = field(default_factory=list)  # scheduler: perf_counter when each token was picked


def is_oom(err: BaseException) -> bool:
    # torch.OutOfMemoryError (CUDA, and other backends) subclasses RuntimeError; some backends raise a
    # plain RuntimeError whose message says so.
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err)


def release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
) -> list[Generation]:
    """Generate for every prompt at once; one `Generation` per prompt, in order.

    pickers: one per row, called with that row's fp32 logits and prompt + generated ids.
    stop_fn(row, generated_ids) -> True ends the row with "stop_string" (checked after EOS, before length).
    on_token(row, token_id) is called for every generated token, EOS included, as soon as it is picked.
    prefill_chunk: prefill at most this many columns per forward pass (bounds activation memory).
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
    device = model.device
    start = time.perf_counter()
    gens = [Generation(prompt_tokens=len(p)) for p in prompts]
    seen = [list(p) for p in prompts]
    live = [limit > 0 for limit in limits]
    first_token_at = [0.0] * batch
    next_ids = [pad_id] * batch

    def finish(row: int, reason: FinishReason, error: str | None = None) -> None:
        gens[row].finish_reason, gens[row].error = reason, error
        live[row] = False
        next_ids[row] = pad_id
        if gens[row].ttft_s is not None:
            gens[row].decode_s = time.perf_counter() - first_token_at[row]

    def finish_live(reason: FinishReason, error: str | None = None) -> None:
        for row in range(batch):
            if live[row]:
                finish(row, reason, error)

    def pick_all(logits: Tensor) -> None:
        """Pick one token for each live row from fp32 logits [batch, V]."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()  # also waits for the forward pass
        for row in range(batch):
            if not live[row]:
                continue
            gen = gens[row]
            if not finite[row]:
                finish(row, "error", f"non-finite logits (NaN/inf) at generated token {len(gen.tokens)}")
                continue
            pick = pickers[row](logits[row], seen[row])
            gen.tokens.append(pick.token)
            gen.logprobs.append(pick.logprob)
            gen.top_logprobs.append(pick.top)
            seen[row].append(pick.token)
            if gen.ttft_s is None:
                first_token_at[row] = time.perf_counter()
                gen.ttft_s = first_token_at[row] - start
            next_ids[row] = pick.token
            if on_token is not None:
                on_token(row, pick.token)
            if pick.token in eos_ids:
                finish(row, "eos")
            elif stop_fn is not None and stop_fn(row, gen.tokens):
                finish(row, "stop_string")
            elif len(gen.tokens) >= limits[row]:
                finish(row, "length")

    for row in range(batch):
        if not live[row]:
            gens[row].finish_reason = "length"

    with torch.inference_mode():
        cache.reset(batch)
        width = max(len(p) for p in prompts)
        # Left padding: every row's last prompt token is in the last column.
        tokens = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
        valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts], device=device)
        positions = (valid.cumsum(1) - 1).clamp(min=0)  # padding does not advance positions
        chunk = prefill_chunk or width
        if cache.policy == "slide":
            chunk = min(chunk, cache.max_tokens - cache.sink_tokens)
        logits: Tensor | None = None
        try:
            for lo in range(0, width, chunk):
                hi = min(lo + chunk, width)
                if not cache.make_room(hi - lo):
                    finish_live("cache_full")
                    logits = None
                    break
                logits = model(tokens[:, lo:hi], positions[:, lo:hi], cache, valid=valid[:, lo:hi], last_only=True)
        except RuntimeError as err:
            if not is_oom(err):
                raise
            logits = None
            release_memory(device)
            finish_live("error", f"out of memory during prefill: {err}")
        if logits is not None:
            last = logits[:, -1].float()
            torch.isfinite(last[:1, :1]).item()  # wait for the device, so prefill_s is the real time
        prefill_s = time.perf_counter() - start
        for gen in gens:
            gen.prefill_s = prefill_s
        if logits is not None and any(live):
            pick_all(last)

        step_tokens = torch.full((batch, 1), pad_id, dtype=torch.long, device=device)
        while any(live):
            if not cache.make_room(1):
                finish_live("cache_full")
                break
            step_tokens.copy_(torch.tensor(next_ids).view(batch, 1))
            try:
                logits = decode_step(model, step_tokens, cache.next_positions(), cache)
            except RuntimeError as err:
                if not is_oom(err):
                    raise
                release_memory(device)
                finish_live("error", f"out of memory during decode: {err}")
                break
            for row in range(batch):
                gens[row].decode_steps += live[row]
            pick_all(logits[:, -1].float())
    return gens
