"""What a precision does to a model's answers: perplexity over a text, and divergence from a reference model.

The text is cut into chunks of `context` consecutive tokens; each chunk is one causal forward pass with no
KV cache, and only its second half is scored, so every scored token sees at least context/2 tokens before it
(llama.cpp's `llama-perplexity` scores the same half for the same reason: the first tokens of a chunk, with
almost no context, would dominate the figure). Scored positions are identical for every model compared, so
the figures of two plans are comparable token for token.

Against a reference (usually the same model in fp32), at the same positions:
  * KL(P_ref || P) of the next-token distributions (mean and p99 — the mean hides rare broken outputs,
    the tail shows them; llama.cpp's KL-divergence mode reports the same pair),
  * top-1 agreement: how often both models' most likely next token is the same,
  * per layer, how far the hidden state drifted: ||h - h_ref|| / ||h_ref|| at the layer's output.
Everything is computed in fp32 whatever the models' activation dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..kv.cache import KVCache
    from ..model.transformer import Transformer


def chunks(ids: Sequence[int], context: int, limit: int | None = None) -> list[list[int]]:
    """Consecutive, non-overlapping chunks of exactly `context` tokens (a shorter tail is dropped)."""
    if context < 4:
        raise ValueError(f"context must be at least 4 tokens (got {context})")
    whole = len(ids) // context
    count = whole if limit is None else min(whole, limit)
    return [list(ids[i * context : (i + 1) * context]) for i in range(count)]


def first_scored(context: int) -> int:
    """Index of the first scored position of a chunk: the logits there predict token first_scored + 1."""
    return context // 2 - 1


@dataclass
class Pass:
    """One model's fp32 log-probabilities at a chunk's scored positions, and its layers' outputs there."""

    logprobs: Tensor  # [S, V]
    hidden: list[Tensor]  # one [S, D] per layer


@contextmanager
def _layer_outputs(model: Transformer) -> Iterator[list[Tensor]]:
    """The output of every block of the next forward pass, in order (forward hooks, removed afterwards)."""
    seen: list[Tensor] = []
    # Copied at once: a block's output may live in a work buffer that the next block reuses.
    handles = [layer.register_forward_hook(lambda _m, _i, out: seen.append(out.clone())) for layer in model.layers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def score_chunk(model: Transformer, chunk: Sequence[int], cache: KVCache | None = None) -> Pass:
    """One causal forward pass over `chunk` on the model's torch modules. With `cache` (emptied first), the
    keys and values are stored in it and attention reads them back from it, so the figures include what
    the cache's dtype does to them, as they would be in generation."""
    device = model.device
    tokens = torch.tensor([list(chunk)], device=device)
    positions = torch.arange(len(chunk), device=device)[None]
    start = first_scored(len(chunk))
    if cache is not None:
        cache.reset(1)
        if not cache.make_room(len(chunk)):
            raise ValueError(f"a chunk of {len(chunk)} tokens does not fit a cache of {cache.max_tokens}")
    with _layer_outputs(model) as seen:
        logits = model(tokens, positions, cache)
    logprobs = torch.log_softmax(logits[0, start:-1].float(), dim=-1).cpu()
    hidden = [h[0, start:-1].float().cpu() for h in seen]
    return Pass(logprobs, hidden)


@dataclass
class Divergence:
    """Accumulates, chunk by chunk, how one model's passes differ from the reference's."""

    kl: list[Tensor] = field(default_factory=list)  # per scored position
    top1_same: int = 0
    positions: int = 0
    drift_sq: list[float] = field(default_factory=list)  # per layer: sum of ||h - h_ref||^2
    ref_sq: list[float] = field(default_factory=list)  # per layer: sum of ||h_ref||^2

    def add(self, ours: Pass, ref: Pass) -> None:
        p_ref = ref.logprobs.exp()
        # Clamped at 0: a sum of fp32 terms can come out -1e-9 where the distributions are equal.
        self.kl.append((p_ref * (ref.logprobs - ours.logprobs)).sum(-1).clamp_min(0.0))
        self.top1_same += int((ours.logprobs.argmax(-1) == ref.logprobs.argmax(-1)).sum())
        self.positions += ref.logprobs.shape[0]
        if not self.drift_sq:
            self.drift_sq, self.ref_sq = [0.0] * len(ref.hidden), [0.0] * len(ref.hidden)
        for i, (h, h_ref) in enumerate(zip(ours.hidden, ref.hidden, strict=True)):
            self.drift_sq[i] += float((h - h_ref).pow(2).sum())
            self.ref_sq[i] += float(h_ref.pow(2).sum())

    def summary(self) -> dict[str, object]:
        kl = torch.cat(self.kl) if self.kl else torch.zeros(0)
        return {
            "kl_mean": float(kl.double().mean()) if kl.numel() else math.nan,
            "kl_p99": float(torch.quantile(kl.double(), 0.99)) if kl.numel() else math.nan,
            "kl_max": float(kl.max()) if kl.numel() else math.nan,
            "top1_agreement": self.top1_same / self.positions if self.positions else math.nan,
            "layer_drift": [
                math.sqrt(d / r) if r > 0 else math.nan for d, r in zip(self.drift_sq, self.ref_sq, strict=True)
            ],
        }


@dataclass
class Perplexity:
    """Accumulates the negative log-likelihood of the tokens that follow the scored positions."""

    nll_sum: float = 0.0
    tokens: int = 0

    def add(self, ours: Pass, chunk: Sequence[int]) -> None:
        start = first_scored(len(chunk))
        targets = torch.tensor(list(chunk[start + 1 :]))
        self.nll_sum -= float(ours.logprobs.gather(1, targets[:, None]).double().sum())
        self.tokens += len(targets)

    def summary(self) -> dict[str, object]:
        nll = self.nll_sum / self.tokens if self.tokens else math.nan
        return {"tokens_scored": self.tokens, "nll": nll, "perplexity": math.exp(nll) if self.tokens else math.nan}


def same_token_rate(ours: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> float:
    """Over free-running greedy continuations of the same prompts: the share of positions where both
    models chose the same token (after a first difference the texts part, and so usually do the tokens)."""
    same = total = 0
    for a, b in zip(ours, ref, strict=True):
        total += len(b)
        same += sum(1 for x, y in zip(a, b, strict=False) if x == y)
    return same / total if total else math.nan
