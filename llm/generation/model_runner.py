"""Runs the model on one batch, on the backend chosen once when the runner is built.

Two backends compute the same thing: the native pass (llm/generation/fused_decode.py: the whole model in one C call,
where the model and cache fit it) and the torch modules of `Transformer` (the reference, and the path for
GPUs, bf16 activations, reference kernels). Which one runs is decided here, at build: the runner holds the
native pass or none. Observers that hook the torch modules (attention maps) ask for the reference backend
explicitly (`use_reference`); per-layer timings (`clock`) work on both.

A flat batch (llm/generation/flat_batch.py) goes through `forward`: the native pass takes it as it is; the reference
runs its one-token parts (decode rows at any lengths) as one module forward over a view of their slots and
each longer part (a prompt chunk) as its own. A static, left-padded batch (`generate`, beam search, the
"slide" policy) goes through `static_prefill` / `static_decode`: there all rows share one write pointer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from .fused_decode import FusedDecoder, native_static_prefill
from .speculative import PassCosts

if TYPE_CHECKING:
    from ..kv.cache import KVCache
    from ..kv.slot_cache import SlotCache
    from ..model.layer_clock import LayerClock
    from ..model.transformer import Transformer
    from .flat_batch import FlatBatch

Backend = Literal["native", "torch"]


class ModelRunner:
    def __init__(self, model: Transformer, cache: KVCache | SlotCache, *, native: bool = True) -> None:
        """`cache`: the K/V memory the native pass binds to (a `KVCache` and `SlotCache.over` it share it)."""
        self.model = model
        self.native = FusedDecoder.build(model, cache) if native else None
        self.clock: LayerClock | None = None  # per-layer timings of every pass, while an observer asks
        self._reference = self.native is None
        self.spans: list[tuple[float, float]] = []  # (start, end) of each part of the last `forward`
        self.pass_costs = PassCosts()  # decode steps' seconds by inputs, for speculation (speculative.py)

    @property
    def backend(self) -> Backend:
        return "torch" if self._reference else "native"

    def use_reference(self) -> None:
        """Run the torch modules from now on: an observer hooks them (the native pass runs none)."""
        self._reference = True
        self.pass_costs = PassCosts()  # another backend, other costs

    def _fused(self) -> FusedDecoder | None:
        fused = None if self._reference else self.native
        if fused is not None:
            fused.clock = self.clock
        return fused

    # --- a flat batch over a slot cache ------------------------------------------------------------

    def forward(self, batch: FlatBatch, cache: SlotCache) -> Tensor:
        """fp32 logits [len(batch.wanted), V] of the wanted inputs, in order; every input's K/V stored.
        The slots were claimed (`SlotCache.claim`) by the caller."""
        fused = self._fused()
        if fused is None:
            return self._reference_forward(batch, cache)
        began = time.perf_counter()
        if len(batch.wanted) == len(batch.parts) and all(len(p.tokens) == 1 for p in batch.parts):
            # Decode rows alone: logits of every input, no gather of the head's rows.
            logits = fused.step_rows(batch.tokens, batch.positions, batch.rows, batch.slots)
        else:
            logits = fused.run(batch.tokens, batch.positions, batch.rows, batch.slots, batch.outs)
        self.spans = [(began, time.perf_counter())] * len(batch.parts)
        return logits

    def _reference_forward(self, batch: FlatBatch, cache: SlotCache) -> Tensor:
        model, device, parts = self.model, self.model.device, batch.parts
        spans = [(0.0, 0.0)] * len(parts)
        pieces: list[tuple[list[int], Tensor]] = []  # (parts, their logits rows)
        singles = [i for i, p in enumerate(parts) if len(p.tokens) == 1]
        if singles:
            began = time.perf_counter()
            rows, starts = [parts[i].row for i in singles], [parts[i].start for i in singles]
            tokens = torch.tensor([parts[i].tokens[0] for i in singles], device=device)[:, None]
            positions = torch.tensor(starts, device=device)[:, None]
            view = cache.rows(rows, starts)
            logits = model(tokens, positions, view, last_only=True, clock=self.clock)[:, -1].float()
            pieces.append((singles, logits))
            spans[singles[0]] = (began, time.perf_counter())
            for i in singles:
                spans[i] = spans[singles[0]]
        for i, part in enumerate(parts):
            if len(part.tokens) == 1:
                continue
            began = time.perf_counter()
            n, last = len(part.tokens), int(part.logits) <= 1  # a verify part wants all its inputs' logits
            tokens = torch.tensor([part.tokens], device=device)
            positions = torch.arange(part.start, part.start + n, device=device)[None]
            out = model(tokens, positions, cache.rows([part.row], [part.start]), last_only=last, clock=self.clock)
            pieces.append(([i], out[0, -max(1, int(part.logits)) :].float()))
            spans[i] = (began, time.perf_counter())
        self.spans = spans
        wanted = batch.wanted
        if len(pieces) == 1 and pieces[0][0] == wanted:
            return pieces[0][1]  # the usual step: decode rows only
        if not wanted:
            return torch.empty(0, model.cfg.vocab_size)
        # Each wanted part's rows, in part order: a one-token part's row of the batched piece, else its own.
        rows_of: dict[int, Tensor] = {}
        for idx, logits in pieces:
            if len(idx) > 1 or len(parts[idx[0]].tokens) == 1:
                rows_of.update({part: logits[j : j + 1] for j, part in enumerate(idx)})
            else:
                rows_of[idx[0]] = logits[logits.shape[0] - int(parts[idx[0]].logits) :]
        return torch.cat([rows_of[i] for i in dict.fromkeys(wanted)])

    # --- a static batch (left padding, one write pointer) ------------------------------------------

    def static_decode(self, tokens: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        """Logits [B, 1, V] of one token per row of a static batch; its K/V appended to `cache`."""
        fused = self._fused()
        if fused is not None:
            return fused.step(tokens, positions, cache)
        return self.model(tokens, positions, cache, last_only=True, clock=self.clock)

    def static_prefill(
        self, tokens: Tensor, positions: Tensor, cache: KVCache, valid: Tensor | None, *, logits: bool
    ) -> Tensor | None:
        """A prompt chunk [B, T] of a static batch (left padding False in `valid`), its K/V appended; with
        `logits`, those of its last column [B, 1, V], else None."""
        fused = self._fused()
        if fused is not None:
            return native_static_prefill(fused, tokens, positions, cache, valid, logits=logits)
        out = self.model(tokens, positions, cache, valid=valid, last_only=True, clock=self.clock)
        return out if logits else None

    def torch_forward(self, tokens: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        """The torch modules alone (beam search's prompt, as transformers computes it), timed when observed;
        the last position's logits [B, 1, V]. In pieces of the cache's `max_write` where its sliding layers
        are rings (in one piece otherwise)."""
        step = cache.max_write
        for lo in range(0, tokens.shape[1], step):
            out = self.model(
                tokens[:, lo : lo + step], positions[:, lo : lo + step], cache, last_only=True, clock=self.clock
            )
        return out
