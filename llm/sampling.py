"""Token sampling: validated `SamplingParams` and a per-request picker built as a chain of small steps.

The chain (llama.cpp-style; each step is a small function `(logits [V], ctx) -> logits [V]` that edits
scores or masks tokens to -inf), applied in this order:

    1. repetition_penalty   over all seen tokens (prompt + generated), HF RepetitionPenaltyLogitsProcessor:
                            a seen token's logit l becomes l / p if l > 0 else l * p
    2. frequency/presence   over generated tokens only (OpenAI): l -= frequency * count + presence * (count > 0)
    3. no_repeat_ngram      over all seen tokens, HF NoRepeatNGramLogitsProcessor: a token that would
                            complete an n-gram already present gets -inf
    -- temperature == 0: greedy, argmax of the logits after steps 1-3 (no sort, no softmax) --
    4. temperature          l / T                                  (HF TemperatureLogitsWarper)
    5. top_k                keep the k largest                     (HF TopKLogitsWarper, ties at the kth kept)
    6. top_p                keep the smallest top set with mass >= p, boundary token included: sorting
                            ascending, drop tokens whose cumulative prob <= 1 - p (HF TopPLogitsWarper)
    7. min_p                keep tokens with p >= min_p * p_max, probs after temperature (HF MinPLogitsWarper)
    8. sample               one draw from softmax(logits) with the picker's own torch.Generator

If the chain masks every token (e.g. n-gram bans on a tiny vocabulary), the raw logits are used instead.
Steps whose parameter is neutral (penalty 1, 0, k 0, p 1, min_p 0, T 1) are not put in the chain at all.

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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .generate import Pick, TokenPicker

__all__ = ["Pick", "SamplingParams", "Step", "StepContext", "TokenPicker", "build_picker"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # (0, 1]; 1 = off
    min_p: float = 0.0  # [0, 1]; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram_size: int = 0  # 0 = off
    seed: int | None = None
    logprobs_top_n: int = 0

    def __post_init__(self) -> None:
        for name in ("top_k", "no_repeat_ngram_size", "logprobs_top_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: must be an integer (got {value!r})")
            if value < 0:
                raise ValueError(f"{name}: must be >= 0 (got {value})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed: must be an integer or None (got {self.seed!r})")
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
        for name in floats:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name}: must be a finite number (got {value!r})")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, 0 meaning greedy (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1] (got {self.min_p})")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty: must be > 0 (got {self.repetition_penalty})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class StepContext:
    """What a step may look at besides the logits: the seen ids and where the prompt ends."""

    seen: list[int]
    prompt_len: int


Step = Callable[[Tensor, StepContext], Tensor]
"""One link of the chain: takes logits [V] (it may edit them in place) and returns them."""


# ---------------------------------------------------------------------------------------------------------
# the steps; each takes its parameter first so tests can call it alone


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


def build_chain(params: SamplingParams) -> tuple[list[Step], list[Step]]:
    """(penalties+bans, warpers) for these params; neutral steps are left out."""
    pre: list[Step] = []
    if params.repetition_penalty != 1.0:
        pre.append(lambda x, c: repetition_penalty(x, c, params.repetition_penalty))
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        pre.append(lambda x, c: frequency_presence_penalty(x, c, params.frequency_penalty, params.presence_penalty))
    if params.no_repeat_ngram_size > 0:
        pre.append(lambda x, c: no_repeat_ngram(x, c, params.no_repeat_ngram_size))
    warp: list[Step] = []
    if params.greedy:
        return pre, warp
    if params.temperature != 1.0:
        warp.append(lambda x, c: temperature(x, c, params.temperature))
    if params.top_k > 0:
        warp.append(lambda x, c: top_k(x, c, params.top_k))
    if params.top_p < 1.0:
        warp.append(lambda x, c: top_p(x, c, params.top_p))
    if params.min_p > 0.0:
        warp.append(lambda x, c: min_p(x, c, params.min_p))
    return pre, warp


@dataclass
class Picker:
    """A `TokenPicker` for one request: `picker(logits_row, seen) -> Pick`. Not thread-safe; one per row."""

    params: SamplingParams
    prompt_len: int | None = None
    _pre: list[Step] = field(init=False, repr=False)
    _warp: list[Step] = field(init=False, repr=False)
    _generator: torch.Generator = field(init=False, repr=False)
    _given_prompt_len: int | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prompt_len is not None and self.prompt_len < 0:
            raise ValueError(f"prompt_len: must be >= 0 (got {self.prompt_len})")
        self._pre, self._warp = build_chain(self.params)
        self._given_prompt_len = self.prompt_len
        self._generator = torch.Generator(device="cpu")
        self.reset()

    def reset(self, prompt_len: int | None = None) -> None:
        """Start a new request: re-seed the generator; prompt_len as in `build_picker`."""
        self.prompt_len = prompt_len if prompt_len is not None else self._given_prompt_len
        if self.params.seed is not None:
            self._generator.manual_seed(self.params.seed)
        else:
            self._generator.seed()

    def __call__(self, logits_row: Tensor, seen: list[int]) -> Pick:
        if logits_row.dim() != 1:
            raise ValueError(f"logits_row: expected a 1-D [V] tensor, got shape {tuple(logits_row.shape)}")
        if self.prompt_len is None:
            self.prompt_len = len(seen)
        raw = logits_row.detach().to(device="cpu", dtype=torch.float32)
        logits = raw
        if self._pre or self._warp:
            ctx = StepContext(seen=seen, prompt_len=self.prompt_len)
            logits = raw.clone()  # the steps edit in place; the raw row is kept for the logprobs
            for step in self._pre:
                logits = step(logits, ctx)
            if not self.params.greedy:
                for step in self._warp:
                    logits = step(logits, ctx)
        if logits is not raw and not torch.isfinite(logits).any():
            logits = raw  # every token was banned/masked: ignore the chain rather than fail
        best = None
        if self.params.logprobs_top_n > 0:
            best = torch.topk(raw, min(self.params.logprobs_top_n, raw.numel()))
        if self.params.greedy:
            values = best.values if best is not None else None
            if logits is raw and values is not None and len(values) > 1 and bool(values[0] > values[1]):
                token = int(best.indices[0])  # a unique maximum the top list already found: no second pass
            else:
                token = int(torch.argmax(logits))  # on a tie the lowest index, as always
        else:
            # Draw among the tokens the chain left (a nucleus is a few dozen of 49152): multinomial over the
            # whole vocabulary draws one exponential per entry, which cost more than the model's decode step.
            live = torch.isfinite(logits).nonzero().squeeze(1)
            if live.numel() < logits.numel():
                chosen = torch.multinomial(logits[live].softmax(dim=-1), 1, generator=self._generator)
                token = int(live[chosen])
            else:
                token = int(torch.multinomial(logits.softmax(dim=-1), 1, generator=self._generator))
        lse = torch.logsumexp(raw, dim=-1)
        top = None
        if best is not None:
            top = [(int(i), float(v)) for i, v in zip(best.indices.tolist(), (best.values - lse).tolist(), strict=True)]
        return Pick(token=token, logprob=float(raw[token] - lse), top=top)


def build_picker(params: SamplingParams, prompt_len: int | None = None) -> Picker:
    """A fresh picker for one request. prompt_len None: taken as len(seen) at the first call."""
    return Picker(params, prompt_len)
