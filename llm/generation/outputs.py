"""What every generation loop produces and shares: a picked token, a row's output, the checks on a pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..sampling.picks import Pick
from .ending import FinishReason


@dataclass
class Generation:
    """One row's output. `tokens` are the generated ids only, ending with the EOS id when reason is "eos"."""

    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    prefill_s: float = 0.0  # the whole batch's prefill (engine loop: this request's own, admission to logits)
    ttft_s: float | None = None  # generate() start (engine loop: submission) -> this row's first token picked
    queued_s: float = 0.0  # engine loop: submission -> admission into a slot
    decode_s: float = 0.0  # first token -> this row's last token
    decode_steps: int = 0  # decode forward passes this row took part in
    token_times: list[float] = field(default_factory=list)  # engine loop: perf_counter when each token was picked
    guessed: int = 0  # speculative decoding: guesses verified (llm/generation/speculative.py)
    accepted: int = 0  # of those, accepted
    speculation: list[tuple[int, int, int]] = field(default_factory=list)  # (generated before, guessed, accepted)

    def add(self, pick: Pick) -> None:
        self.tokens.append(pick.token)
        self.logprobs.append(pick.logprob)
        self.top_logprobs.append(pick.top)


def finite_rows(logits: Tensor) -> Tensor:
    """Per row of [..., V] logits: all finite. NaN propagates through max and min, +inf shows in the max and
    -inf in the min, so this is exact; it is 13x faster than isfinite().all() at [16, 49152] (0.08 vs 1 ms a
    decode step), which torch runs without vectorizing."""
    return torch.isfinite(logits.amax(-1)) & torch.isfinite(logits.amin(-1))


def is_oom(err: BaseException) -> bool:
    # torch.OutOfMemoryError (CUDA, and other backends) subclasses RuntimeError; some backends raise a
    # plain RuntimeError whose message says so.
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err)


def release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
