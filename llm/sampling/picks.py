"""What a sampler hands back and sees: a picked token, the picker's contract, and a step's context.

Below both the sampler chain (chain.py) and the generation loops (llm/generation/), which only pass these
along, so neither has to import the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass
class Pick:
    """One chosen token. `logprob` is log-softmax of the raw model logits at that token."""

    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None


class TokenPicker(Protocol):
    """Chooses the next token of one row from its fp32 logits [V] and the ids seen so far."""

    def __call__(self, logits_row: Tensor, seen: list[int]) -> Pick: ...


@dataclass
class StepContext:
    """What a sampler may look at besides the logits: the seen ids and where the prompt ends."""

    seen: list[int]
    prompt_len: int
