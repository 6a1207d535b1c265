"""One forward pass as both backends take it: a flat list of inputs, each a token of one cache row.

Input i is token `tokens[i]` of cache row `rows[i]`, its K/V written at slot `slots[i]`, rotated by RoPE
position `positions[i]`; `outs` indexes the inputs whose logits are wanted. A decode row is one input (with
speculation, its last token and the guesses after it, each one's logits wanted); a prompt chunk is one
row's inputs at consecutive slots, which attend causally to each other. The batch is
built from `Part`s (one row's run of inputs each), kept beside the tensors so the torch reference can run a
part as the module forward it is, and the tensors are made only when a backend asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(frozen=True)
class Part:
    """One row's consecutive inputs: `tokens` at slots start.. (the slots are the RoPE positions too)."""

    row: int
    start: int
    tokens: list[int]
    logits: int  # the logits of its last `logits` inputs are wanted (a bool: the last one, or none)


@dataclass(eq=False)
class FlatBatch:
    parts: list[Part]

    @cached_property
    def _columns(self) -> tuple[list[int], list[int], list[int], list[int]]:
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        outs: list[int] = []
        for part in self.parts:
            tokens += part.tokens
            positions += range(part.start, part.start + len(part.tokens))
            rows += [part.row] * len(part.tokens)
            outs += range(len(tokens) - int(part.logits), len(tokens))
        return tokens, positions, rows, outs

    @cached_property
    def tokens(self) -> Tensor:
        return torch.tensor(self._columns[0])

    @cached_property
    def positions(self) -> Tensor:
        return torch.tensor(self._columns[1])

    @property
    def slots(self) -> Tensor:
        return self.positions  # a slot cache holds no padding: a token's slot is its position

    @cached_property
    def rows(self) -> Tensor:
        return torch.tensor(self._columns[2])

    @cached_property
    def outs(self) -> Tensor:
        return torch.tensor(self._columns[3], dtype=torch.long)

    @property
    def wanted(self) -> list[int]:
        """The part of each logits row, in order (a part with several wanted inputs: as many times)."""
        return [i for i, part in enumerate(self.parts) for _ in range(int(part.logits))]
