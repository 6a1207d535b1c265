"""A KV cache of slots: one row per running request, each row with its own length (continuous batching).

Layout: the same preallocated tensors as `KVCache` — k, v [layers, slots, kv_heads, max_tokens, head_dim] and
`valid` [slots, max_tokens] — usually the very same memory (`SlotCache.over(kv_cache)`), so a plan allocates
its cache once whichever discipline runs on it. Where `KVCache` keeps one write pointer for a left-padded
batch, here each slot keeps its own: a request joins at slot 0 of a free row and leaves when it ends,
whatever the other rows are doing. Each slot holds up to `max_tokens` (per-slot regions, as llama.cpp's
server slots, not a shared paged pool): a row is one contiguous stream, so the native decode step reads
it as it reads a static batch, and there is no page table to keep. The cost is memory reserved for the
longest request in every slot, which a CPU's RAM affords at this model size.

Positions are slot indices (no padding inside a slot), so a slot's K/V for tokens [0, n) depend only on
those tokens: `held` records them, and a request whose prompt starts with the same tokens copies that
prefix (`copy_prefix`) instead of recomputing it.

`rows(...)` gives the torch modules a cache view for one forward over some slots (see `RowsView`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .model import attention_mask

if TYPE_CHECKING:
    from .kv_cache import KVCache
    from .model import Transformer


class SlotCache:
    def __init__(self, k: Tensor, v: Tensor, valid: Tensor) -> None:
        if k.shape != v.shape or k.dim() != 5 or tuple(valid.shape) != (k.shape[1], k.shape[3]):
            raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} and valid {tuple(valid.shape)} do not agree")
        self.k, self.v, self.valid = k, v, valid
        self.max_batch, self.max_tokens = k.shape[1], k.shape[3]  # the names the native step binds to
        self.lengths = [0] * self.max_batch  # tokens cached per slot
        self.held: list[list[int]] = [[] for _ in range(self.max_batch)]  # the ids whose K/V each slot holds
        valid.zero_()

    @classmethod
    def over(cls, cache: KVCache) -> SlotCache:
        """Slots on the memory of a static `KVCache` (the cache is reset when it is next used as one)."""
        return cls(cache.k, cache.v, cache.valid)

    @classmethod
    def for_model(
        cls, model: Transformer, slots: int, max_tokens: int, *, dtype: torch.dtype | None = None
    ) -> SlotCache:
        cfg = model.cfg
        if max_tokens > model.max_seq_len:
            raise ValueError(f"max_tokens ({max_tokens}) exceeds the model's max_seq_len ({model.max_seq_len})")
        shape = (cfg.n_layers, slots, cfg.n_kv_heads, max_tokens, cfg.head_dim)
        k = torch.zeros(shape, dtype=dtype or model.dtype, device=model.device)
        return cls(k, torch.zeros_like(k), torch.zeros(slots, max_tokens, dtype=torch.bool, device=model.device))

    @property
    def slots(self) -> int:
        return self.max_batch

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.valid.nbytes

    @property
    def device(self) -> torch.device:
        return self.k.device

    def truncate(self, slot: int, keep: int) -> None:
        """Keep the first `keep` tokens of a slot (0 empties it)."""
        if keep < self.lengths[slot]:
            self.valid[slot, keep : self.lengths[slot]] = False
        self.lengths[slot] = min(keep, self.lengths[slot])
        del self.held[slot][keep:]

    def common_prefix(self, slot: int, tokens: list[int]) -> int:
        """How many leading `tokens` the slot already holds K/V for."""
        held, n = self.held[slot], 0
        for a, b in zip(held, tokens, strict=False):
            if a != b:
                break
            n += 1
        return n

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot `dst` becomes the first `n` tokens of slot `src` (K/V copied: one strided copy per tensor)."""
        if n > self.lengths[src]:
            raise ValueError(f"slot {src} holds {self.lengths[src]} tokens, not {n}")
        self.truncate(dst, 0)
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.valid[dst, :n] = True
        self.lengths[dst] = n
        self.held[dst] = self.held[src][:n]

    def claim(self, slots: list[int], tokens: list[list[int]]) -> list[int]:
        """Reserve room for `tokens[i]` at the end of `slots[i]`, mark it valid; returns each first slot index.

        K/V are written by the forward pass that follows (the torch modules through `rows`, or the native step).
        """
        starts = []
        for slot, ids in zip(slots, tokens, strict=True):
            start, end = self.lengths[slot], self.lengths[slot] + len(ids)
            if end > self.max_tokens:
                raise ValueError(f"slot {slot}: {len(ids)} tokens do not fit ({start}/{self.max_tokens} used)")
            self.valid[slot, start:end] = True
            self.lengths[slot] = end
            self.held[slot].extend(ids)
            starts.append(start)
        return starts

    def unclaim(self, slots: list[int], starts: list[int]) -> None:
        """Undo `claim` (a forward pass that failed wrote nothing that counts)."""
        for slot, start in zip(slots, starts, strict=True):
            self.truncate(slot, start)

    def rows(self, slots: list[int], starts: list[int]) -> RowsView:
        return RowsView(self, slots, starts)


class RowsView:
    """The cache as `Transformer.forward` sees it for one pass over some slots, each at its own length.

    Either one slot with any number of tokens (a prefill chunk), or several slots with one token each (a
    decode step whose rows sit at different lengths). `claim` has already reserved the slots.
    """

    def __init__(self, cache: SlotCache, slots: list[int], starts: list[int]) -> None:
        self.cache, self.slots, self.starts = cache, slots, starts
        self.max_tokens = cache.max_tokens
        device = cache.device
        lo = slots[0]
        self._range = slice(lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else None
        self._index = torch.tensor(slots, device=device)
        self._start_index = torch.tensor(starts, device=device)
        single = len(slots) == 1
        # The model asks for a mask when this says so: rows ending at different slots, or a chunk after slot 0
        # (one slot from slot 0 is plain causal attention).
        self.padded = not single or starts[0] > 0
        self._end = max(starts) + 1

    def append(self, positions: Tensor, valid: Tensor | None = None) -> int:
        if valid is not None:
            raise ValueError("slots hold no padding")
        rows, n = positions.shape
        if rows != len(self.slots) or (rows > 1 and n != 1):
            raise ValueError(f"a view of {len(self.slots)} slots takes one row per slot, one token each if several")
        self._end = max(self.starts) + n
        return self.starts[0]

    def _select(self, t: Tensor, end: int) -> Tensor:
        if self._range is not None:
            return t[self._range, :, :end]
        return t.index_select(0, self._index)[:, :, :end]

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if len(self.slots) == 1:
            slot, end = self.slots[0], start + k.shape[2]
            kc[slot, :, start:end] = k[0]
            vc[slot, :, start:end] = v[0]
        else:
            kc[self._index, :, self._start_index] = k[:, :, 0]
            vc[self._index, :, self._start_index] = v[:, :, 0]
        return self._select(kc, self._end), self._select(vc, self._end)

    def attention_mask(self, start: int, seqlen: int) -> Tensor:
        valid = self.cache.valid.index_select(0, self._index)
        if seqlen == 1:
            return valid[:, None, None, : self._end]
        return attention_mask(valid, start, seqlen)
