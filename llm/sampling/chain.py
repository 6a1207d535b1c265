"""Token sampling: a per-request picker over a chain of small samplers, in a declared order.

The settings are `SamplingParams` (llm/sampling/params.py, where they and their limits are stated once).
The chain (llama.cpp-style): each sampler is a small object with `apply(logits [V], ctx) -> logits [V]` that
edits scores or masks tokens to -inf; the chain is itself one, and its order is data (`ORDER`):

    0. FormatMask         the grammar of `format` (llm/sampling/token_mask.py): tokens it forbids get -inf, before
                          anything else, greedy or not; stateful (one llguidance matcher per row)
    0b. LogitBias         OpenAI's logit_bias
    1. RepetitionPenalty  over all seen tokens (prompt + generated), HF RepetitionPenaltyLogitsProcessor:
                          a seen token's logit l becomes l / p if l > 0 else l * p
    2. FrequencyPresence  over generated tokens only (OpenAI): l -= frequency * count + presence * (count > 0)
    3. NoRepeatNGram      over all seen tokens, HF NoRepeatNGramLogitsProcessor: a token that would
                          complete an n-gram already present gets -inf
    -- temperature == 0: greedy, argmax of the logits after steps 1-3 (no sort, no softmax); the samplers
       below only reshape the distribution (`warps`), which leaves the argmax where it is --
    4. Temperature        l / T                                  (HF TemperatureLogitsWarper)
    5. TopK               keep the k largest                     (HF TopKLogitsWarper, ties at the kth kept)
    6. TopP               keep the smallest top set with mass >= p, boundary token included: sorting
                          ascending, drop tokens whose cumulative prob <= 1 - p (HF TopPLogitsWarper)
    7. MinP               keep tokens with p >= min_p * p_max, probs after temperature (HF MinPLogitsWarper)
    8. the draw           one draw from softmax(logits) with the picker's own torch.Generator (`Picker`)

If the chain masks every token (e.g. n-gram bans on a tiny vocabulary), the raw logits are used instead:
with a format, the raw logits under the format's mask (a constraint is never dropped).
A sampler whose parameter is neutral (penalty 1, 0, k 0, p 1, min_p 0, T 1) is not put in the chain at all.

Prompt length: frequency/presence penalties count generated tokens only, so the picker must know where the
prompt ends. `build_picker(params, prompt_len=None)`: when None, the prompt length is taken as len(seen) at
the first call - that call picks the first generated token, when seen is exactly the prompt. `reset()`
re-arms the picker for a new request (and re-seeds its generator).

Pick.logprob is the log-softmax of the RAW model logits at the chosen token (vLLM's convention: what the
model believed, before penalties and warpers); Pick.top holds the `logprobs_top_n` best tokens by raw
log-prob, or None when logprobs_top_n == 0.

Determinism: each picker owns a CPU torch.Generator seeded with `seed` (a fresh random seed when None), and
all work runs on a CPU fp32 copy of the row (one [V] transfer when logits live on an accelerator), so the
same seed and inputs give the same tokens on any device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np
import torch
from torch import Tensor

from ..kernels import native
from .params import SamplingParams
from .picks import Pick, StepContext, TokenPicker
from .token_mask import FormatMask

__all__ = ["ORDER", "Chain", "Pick", "Sampler", "SamplingParams", "StepContext", "TokenPicker", "build_picker"]


# ---------------------------------------------------------------------------------------------------------
# the steps as functions; each takes its parameter last so tests can call it alone


def repetition_penalty(logits: Tensor, ctx: StepContext, penalty: float) -> Tensor:
    if not ctx.seen:
        return logits
    ids = torch.tensor(sorted(set(ctx.seen)), dtype=torch.long)
    scores = logits[ids]
    logits[ids] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits


def frequency_presence_penalty(logits: Tensor, ctx: StepContext, frequency: float, presence: float) -> Tensor:
    generated = ctx.seen[ctx.prompt_len :]
    if not generated:
        return logits
    ids, counts = torch.unique(torch.tensor(generated, dtype=torch.long), return_counts=True)
    logits[ids] -= frequency * counts.to(logits.dtype) + presence
    return logits


def no_repeat_ngram(logits: Tensor, ctx: StepContext, n: int) -> Tensor:
    seen = ctx.seen
    length = len(seen)
    if length + 1 < n:
        return logits
    tail = seen[length - n + 1 :] if n > 1 else []
    banned = {seen[i + n - 1] for i in range(length - n + 1) if seen[i : i + n - 1] == tail}
    if banned:
        logits[torch.tensor(sorted(banned), dtype=torch.long)] = -math.inf
    return logits


def temperature(logits: Tensor, ctx: StepContext, t: float) -> Tensor:
    return logits.div_(t)


def top_k(logits: Tensor, ctx: StepContext, k: int) -> Tensor:
    if k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill_(logits < kth, -math.inf)


_NUCLEUS_CANDIDATES = 1024


def _nucleus_in_top(logits: Tensor, p: float) -> Tensor | None:
    """The ids top-p keeps, found among the `_NUCLEUS_CANDIDATES` largest logits; None if it may reach past.

    Sorting a whole vocabulary (an argsort of SmolLM2's 49152 logits: ~7 ms) costs more than a decode step,
    while a nucleus is usually a few dozen tokens. When the candidates hold mass >= p, every token outside
    them has ascending cumulative mass <= 1 - p and is dropped by the rule below anyway, so the candidates
    decide it alone: the same rule, applied to one topk instead of a full sort.
    """
    values, ids = torch.topk(logits, _NUCLEUS_CANDIDATES)  # descending
    if not torch.isfinite(values[-1]):
        return None  # fewer live tokens than candidates: the plain path sorts no more than these
    probs = (values - torch.logsumexp(logits, dim=-1)).exp()
    inside = probs.sum()
    if inside < p:
        return None
    ascending = (1 - inside).clamp(min=0) + probs.flip(0).cumsum(dim=0)
    drop = ascending <= 1 - p
    drop[-1] = False  # always keep the most likely token
    return ids[~drop.flip(0)]


def top_p(logits: Tensor, ctx: StepContext, p: float) -> Tensor:
    if logits.numel() > _NUCLEUS_CANDIDATES:
        kept = _nucleus_in_top(logits, p)
        if kept is not None:
            values = logits[kept]
            logits.fill_(-math.inf)
            logits[kept] = values
            return logits
    # sort only the live candidates (after top-k that is k tokens, not the whole vocabulary)
    live = torch.isfinite(logits).nonzero().squeeze(1)
    values = logits[live]
    order = torch.argsort(values)  # ascending, as HF does
    cumulative = values[order].softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - p
    drop[-1] = False  # always keep the most likely token
    logits[live[order[drop]]] = -math.inf
    return logits


def min_p(logits: Tensor, ctx: StepContext, m: float) -> Tensor:
    probs = logits.softmax(dim=-1)
    return logits.masked_fill_(probs < m * probs.max(), -math.inf)


# ---------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------
# the samplers: each a small object made from the params (None when its parameter is neutral)


class Sampler(Protocol):
    warps: ClassVar[bool]  # True: reshapes the distribution only (the argmax stays), so greedy skips it

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        """Takes logits [V] (it may edit them in place) and returns them."""
        ...


@dataclass(frozen=True)
class LogitBias:
    """OpenAI's `logit_bias`: a number added to chosen tokens' logits before anything else (-100 bans a
    token, +100 all but forces it); ids past the vocabulary are the caller's to refuse, skipped here."""

    bias: tuple[tuple[int, float], ...]
    warps: ClassVar[bool] = False  # it moves the argmax: greedy applies it too

    @classmethod
    def of(cls, params: SamplingParams) -> LogitBias | None:
        return cls(params.logit_bias) if params.logit_bias else None

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        for token, value in self.bias:
            if 0 <= token < logits.numel():
                logits[token] += value
        return logits


@dataclass(frozen=True)
class RepetitionPenalty:
    penalty: float
    warps: ClassVar[bool] = False

    @classmethod
    def of(cls, params: SamplingParams) -> RepetitionPenalty | None:
        return cls(params.repetition_penalty) if params.repetition_penalty != 1.0 else None

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        return repetition_penalty(logits, ctx, self.penalty)


@dataclass(frozen=True)
class FrequencyPresence:
    frequency: float
    presence: float
    warps: ClassVar[bool] = False

    @classmethod
    def of(cls, params: SamplingParams) -> FrequencyPresence | None:
        if params.frequency_penalty == 0.0 and params.presence_penalty == 0.0:
            return None
        return cls(params.frequency_penalty, params.presence_penalty)

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        return frequency_presence_penalty(logits, ctx, self.frequency, self.presence)


@dataclass(frozen=True)
class NoRepeatNGram:
    n: int
    warps: ClassVar[bool] = False

    @classmethod
    def of(cls, params: SamplingParams) -> NoRepeatNGram | None:
        return cls(params.no_repeat_ngram_size) if params.no_repeat_ngram_size > 0 else None

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        return no_repeat_ngram(logits, ctx, self.n)


@dataclass(frozen=True)
class Temperature:
    t: float
    warps: ClassVar[bool] = True

    @classmethod
    def of(cls, params: SamplingParams) -> Temperature | None:
        return cls(params.temperature) if params.temperature != 1.0 else None

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        return temperature(logits, ctx, self.t)


@dataclass(frozen=True)
class TopK:
    k: int
    warps: ClassVar[bool] = True

    @classmethod
    def of(cls, params: SamplingParams) -> TopK | None:
        return cls(params.top_k) if params.top_k > 0 else None

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        return top_k(logits, ctx, self.k)


@dataclass(frozen=True)
class TopP:
    p: float
    warps: ClassVar[bool] = True

    @classmethod
    def of(cls, params: SamplingParams) -> TopP | None:
        return cls(params.top_p) if params.top_p < 1.0 else None

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        return top_p(logits, ctx, self.p)


@dataclass(frozen=True)
class MinP:
    m: float
    warps: ClassVar[bool] = True

    @classmethod
    def of(cls, params: SamplingParams) -> MinP | None:
        return cls(params.min_p) if params.min_p > 0.0 else None

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        return min_p(logits, ctx, self.m)


ORDER: tuple[type, ...] = (  # each with `of(params) -> sampler | None`
    FormatMask,
    LogitBias,
    RepetitionPenalty,
    FrequencyPresence,
    NoRepeatNGram,
    Temperature,
    TopK,
    TopP,
    MinP,
)
"""The chain's order: penalties and bans over the raw scores first, then the warpers (as HF and llama.cpp)."""


@dataclass(frozen=True)
class Chain:
    """Samplers applied one after another; itself a sampler."""

    samplers: tuple[Sampler, ...]
    warps: ClassVar[bool] = False

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        for sampler in self.samplers:
            logits = sampler.apply(logits, ctx)
        return logits


def build_chain(params: SamplingParams, order: tuple[type, ...] = ORDER) -> Chain:
    """The chain for these params: `order`, less neutral samplers and, when greedy, less the warpers."""
    made = (kind.of(params) for kind in order)
    return Chain(tuple(s for s in made if s is not None and not (params.greedy and s.warps)))


@dataclass
class Picker:
    """A `TokenPicker` for one request: `picker(logits_row, seen) -> Pick`. Not thread-safe; one per row."""

    params: SamplingParams
    prompt_len: int | None = None
    _chain: Chain = field(init=False, repr=False)
    mask: FormatMask | None = field(init=False, default=None)
    _generator: torch.Generator = field(init=False, repr=False)
    _given_prompt_len: int | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prompt_len is not None and self.prompt_len < 0:
            raise ValueError(f"prompt_len: must be >= 0 (got {self.prompt_len})")
        self._chain = build_chain(self.params)
        first = self._chain.samplers[:1]
        self.mask = first[0] if first and isinstance(first[0], FormatMask) else None
        self._given_prompt_len = self.prompt_len
        self._generator = torch.Generator(device="cpu")
        self.reset()

    def reset(self, prompt_len: int | None = None) -> None:
        """Start a new request: re-seed the generator; prompt_len as in `build_picker`."""
        self.prompt_len = prompt_len if prompt_len is not None else self._given_prompt_len
        if self.mask is not None:
            self.mask.reset()
        if self.params.seed is not None:
            self._generator.manual_seed(self.params.seed)
        else:
            self._generator.seed()

    def __call__(self, logits_row: Tensor, seen: list[int]) -> Pick:
        if logits_row.dim() != 1:
            raise ValueError(f"logits_row: expected a 1-D [V] tensor, got shape {tuple(logits_row.shape)}")
        if self.prompt_len is None:
            self.prompt_len = len(seen)
        # The row's whole-vocabulary work (copy, finite check, argmax, log-sum-exp) is done in numpy, on this
        # thread: torch splits a 49152-entry op over its intra-op threads, and on a busy machine each such
        # split waits a time slice at its barrier (measured: 23 ms a logsumexp at load 10, against 0.1 ms).
        raw = logits_row.detach().to(device="cpu", dtype=torch.float32).contiguous()
        raw_np = raw.numpy()
        logits = raw
        if self._chain.samplers:
            # the samplers edit in place; the raw row is kept for the logprobs
            logits = self._chain.apply(
                torch.from_numpy(raw_np.copy()), StepContext(seen=seen, prompt_len=self.prompt_len)
            )
        if logits is not raw and not np.isfinite(logits.numpy()).any():
            # every token was banned/masked: ignore the chain rather than fail, but never the format's mask
            logits = raw
            if self.mask is not None:
                logits = torch.from_numpy(raw_np.copy())
                self.mask.reapply(logits)
        if self.params.greedy and logits is raw and self.params.logprobs_top_n == 0:
            picked = native_greedy(raw)
            if picked is not None:
                return picked
        best = None
        if self.params.logprobs_top_n > 0:
            best = torch.topk(raw, min(self.params.logprobs_top_n, raw.numel()))
        if self.params.greedy:
            values = best.values if best is not None else None
            if logits is raw and values is not None and len(values) > 1 and bool(values[0] > values[1]):
                token = int(best.indices[0])  # a unique maximum the top list already found: no second pass
            else:
                token = int(np.argmax(logits.numpy()))  # on a tie the lowest index, as always
        else:
            # Draw among the tokens the chain left (a nucleus is a few dozen of 49152): multinomial over the
            # whole vocabulary draws one exponential per entry, which cost more than the model's decode step.
            live = torch.isfinite(logits).nonzero().squeeze(1)
            if live.numel() < logits.numel():
                chosen = torch.multinomial(logits[live].softmax(dim=-1), 1, generator=self._generator)
                token = int(live[chosen])
            else:
                token = int(torch.multinomial(logits.softmax(dim=-1), 1, generator=self._generator))
        lse = log_sum_exp(raw_np)
        top = None
        if best is not None:
            top = [(int(i), float(v) - lse) for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)]
        return Pick(token=token, logprob=float(raw_np[token]) - lse, top=top)


def native_greedy(logits_row: Tensor) -> Pick | None:
    """The first maximum of a row and its logprob in one native pass (llm/kernels/native.py `greedy_pick`); None where
    the kernels are not loaded, the row is not contiguous fp32 on the CPU, or it holds a NaN or an infinity:
    the caller's own path decides then."""
    fast = native.kernels()
    if (fast is None or logits_row.device.type != "cpu" or logits_row.dtype != torch.float32
            or not logits_row.is_contiguous()):  # fmt: skip
        return None
    picked = fast.greedy_pick(logits_row)
    return None if picked is None else Pick(token=picked[0], logprob=picked[1])


def log_sum_exp(row: np.ndarray) -> float:
    """log(sum(exp(row))) of a float32 row, shifted by its maximum (no overflow), summed in float64."""
    top = float(row.max())
    if not math.isfinite(top):
        return top  # all -inf (-inf), or a +inf / nan entry (itself)
    return top + math.log(float(np.exp(row - top).sum(dtype=np.float64)))


def build_picker(params: SamplingParams, prompt_len: int | None = None) -> Picker:
    """A fresh picker for one request. prompt_len None: taken as len(seen) at the first call."""
    return Picker(params, prompt_len)
