"""The grammar mask: the first sampler of the chain (llm/sampling/chain.py ORDER), one llguidance matcher per row.

Every path that picks a token goes through the row's picker (greedy and sampled rows of the engine loop and
of static batches, each of `n` choices, speculative verification), so the mask is applied wherever a token
is chosen. Beams carry one matcher each, copied when a beam takes another's place (`BeamMasks`, used by
llm/generation/beam_search.py).

The matcher advances on every token the row accepted: at each call it first consumes the tokens `seen`
gained since the last call (the previous pick, or a speculative guess accepted), so a rejected guess never
reaches it. Once the grammar is complete the mask allows only the end-of-sequence tokens, and the row ends
with finish reason "eos"; a row cut by max_new_tokens ends with "length" (its text may not parse).

Cost: llguidance fills its bitmask into a buffer allocated once per row (`unsafe_compute_mask_ptr`), and the
native kernel `apply_token_bitmask` (llm/kernels/cpu_kernels.c) sets the forbidden logits to -inf in one pass with no
allocation; without the native kernels a numpy unpack does it. `allowed` keeps, per step, how many tokens the
mask left (the report's per-step figure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from .format_compiler import CompiledFormat, ControlTokens, no_token_left

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from .picks import StepContext


class MaskError(RuntimeError):
    """The matcher refused a token it was given, or left no token allowed: a bug, never the model's doing."""


@dataclass
class FormatMask:
    """One row's constraint. `apply(logits, ctx)` masks logits [V] in place (a `Sampler`, never a warper)."""

    compiled: CompiledFormat
    warps: ClassVar[bool] = False
    allowed: list[int] = field(default_factory=list)  # tokens allowed, per step
    matcher: LLMatcher = field(init=False, repr=False)
    _bits: Tensor = field(init=False, repr=False)
    _fed: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.matcher = self.compiled.matcher()
        self._bits = torch.zeros((self.compiled.vocab + 31) // 32, dtype=torch.int32)
        self._controls = ControlTokens.of(self.compiled)

    @classmethod
    def of(cls, params: Any) -> FormatMask | None:
        grammar = getattr(params, "grammar", None)
        if grammar is None:
            if getattr(params, "format", None) is not None:
                raise ValueError("format: compile it against the tokenizer first (llm.output_format.compile_format)")
            return None
        return cls(grammar)

    def reset(self) -> None:
        self.matcher.reset()
        self._fed = 0
        self.allowed.clear()

    def advance(self, generated: list[int]) -> None:
        """Consume the row's generated tokens not consumed yet (every token it accepted since last time)."""
        for token in generated[self._fed :]:
            if not self.matcher.consume_token(token):
                raise MaskError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self._fed = len(generated)

    def apply(self, logits: Tensor, ctx: StepContext) -> Tensor:
        self.advance(ctx.seen[ctx.prompt_len :])
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        if self.matcher.is_error():
            raise MaskError(f"the grammar failed: {self.matcher.get_error()}")
        refused = self._controls.clear_refused(self.matcher, self._bits)
        count = self.reapply(logits)
        self.allowed.append(count)
        if count == 0:
            raise MaskError(no_token_left(refused, eos_ids=self.compiled.eos_ids))
        return logits

    def reapply(self, logits: Tensor) -> int:
        """This step's mask applied to logits [V] (again, e.g. to the raw row when later samplers banned all)."""
        return apply_bitmask(logits, self._bits)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end of the sequence may follow."""
        return bool(self.matcher.is_stopped())


class BeamMasks:
    """The grammar of a beam search: one matcher per running beam. `apply` masks the beams' logits [beams, V]
    (a CPU fp32 copy); `follow` moves the matchers with the beams after a step: new beam i is a copy of its
    source beam's matcher advanced by its token (a beam may take another's place, or two may share a source).
    A beam the search keeps alive at -inf (fewer allowed continuations than beams) keeps an unadvanced copy:
    its score is -inf, so it never finishes or continues anything."""

    def __init__(self, compiled: CompiledFormat, beams: int) -> None:
        self.matchers = [compiled.matcher() for _ in range(beams)]
        self._bits = torch.zeros((beams, (compiled.vocab + 31) // 32), dtype=torch.int32)
        self._controls = ControlTokens.of(compiled)
        self.allowed: list[int] = []  # tokens allowed to the best running beam, per step

    def apply(self, logits: Tensor) -> Tensor:
        rows = logits.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
        for i, matcher in enumerate(self.matchers):
            bits = self._bits[i]
            matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
            if matcher.is_error():
                raise MaskError(f"the grammar failed: {matcher.get_error()}")
            self._controls.clear_refused(matcher, bits)
            count = apply_bitmask(rows[i], bits)
            if i == 0:
                self.allowed.append(count)
        return rows.to(logits.device)

    def follow(self, sources: list[int], tokens: list[int], alive: list[bool]) -> None:
        moved = []
        for source, token, live in zip(sources, tokens, alive, strict=True):
            matcher = self.matchers[source].deep_copy()
            if live and not matcher.consume_token(token):
                raise MaskError(f"the grammar refused token {token}: {matcher.get_error()}")
            moved.append(matcher)
        self.matchers = moved


def apply_bitmask(logits: Tensor, bits: Tensor) -> int:
    """logits [V] (fp32, CPU, contiguous) set to -inf where `bits` is clear; the count left allowed."""
    from ..kernels.native import kernels

    native = kernels()
    if native is not None:
        return native.apply_token_bitmask(logits, bits)
    vocab = logits.numel()
    allowed = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
    logits.numpy()[~allowed] = -math.inf
    return int(allowed.sum())
