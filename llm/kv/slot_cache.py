"""A KV cache of slots: one row per running request, each row with its own length (continuous batching).

Layout: the same preallocated per-layer K/V as `KVCache` (llm/kv/layers.py: every slot of a full layer, a
ring of window + chunk rows of a sliding one) and `valid` [slots, max_tokens] — usually the very same
memory (`SlotCache.over(kv_cache)`), so a plan allocates its cache once whichever discipline runs on it.
Where `KVCache` keeps one write pointer for a left-padded batch, here each slot keeps its own: a request
joins at slot 0 of a free row and leaves when it ends, whatever the other rows are doing. Each slot holds
up to `max_tokens` (per-slot regions, as llama.cpp's server slots, not a shared paged pool): a row is one
contiguous stream, so the native decode step reads it as it reads a static batch, and there is no page
table to keep. The cost is memory reserved for the longest request in every slot, which a CPU's RAM
affords at this model size.

Positions are slot indices (no padding inside a slot), so a slot's K/V for tokens [0, n) depend only on
those tokens: `held` records them, and a request whose prompt starts with the same tokens copies that
prefix (`copy_prefix`) instead of recomputing it. A ring keeps only the last window + chunk slots: a prefix
can be resumed there only while the window before its end is still in the ring (`can_resume`), counted
from the furthest slot ever written (`reach`): a slot cut back (speculative guesses rejected, llm/
speculative.py) keeps in its rings what the cut slots overwrote.

`rows(...)` gives the torch modules a cache view for one forward over some slots (see `RowsView`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..model.masks import attention_mask
from .layers import LayerKV, ring_mask, ring_slots

if TYPE_CHECKING:
    from ..model.transformer import Transformer
    from .cache import KVCache


class SlotCache:
    def __init__(self, store: LayerKV, valid: Tensor) -> None:
        k = store.groups[0][0]
        if valid.dim() != 2 or tuple(valid.shape) != (k.shape[1], store.max_tokens):
            raise ValueError(f"K/V of {k.shape[1]} rows x {store.max_tokens} slots and valid {tuple(valid.shape)}")
        self.store, self.valid = store, valid
        self.k, self.v = store.groups[0]  # layer 0's group (every layer's K/V without rings)
        self.max_batch, self.max_tokens = k.shape[1], store.max_tokens  # the names the native step binds to
        self.max_write = store.max_write  # tokens one claim may add to a slot
        self.lengths = [0] * self.max_batch  # tokens cached per slot
        self.reach = [0] * self.max_batch  # the end of the furthest slot written since the slot was emptied
        self.held: list[list[int]] = [[] for _ in range(self.max_batch)]  # the ids whose K/V each slot holds
        valid.zero_()

    @classmethod
    def over(cls, cache: KVCache) -> SlotCache:
        """Slots on the memory of a static `KVCache` (the cache is reset when it is next used as one)."""
        return cls(cache.store, cache.valid)

    @classmethod
    def for_model(
        cls,
        model: Transformer,
        slots: int,
        max_tokens: int,
        *,
        dtype: torch.dtype | None = None,
        chunk: int | None = None,
    ) -> SlotCache:
        """chunk: the most tokens one claim adds to a slot, which sizes the sliding layers' rings."""
        cfg = model.cfg
        if max_tokens > model.max_seq_len:
            raise ValueError(f"max_tokens ({max_tokens}) exceeds the model's max_seq_len ({model.max_seq_len})")
        store = LayerKV(
            cfg.n_layers, slots, cfg.n_kv_heads, max_tokens, cfg.head_dim, windows=cfg.layer_windows, chunk=chunk,
            dtype=dtype or model.dtype, device=model.device,
        )  # fmt: skip
        return cls(store, torch.zeros(slots, max_tokens, dtype=torch.bool, device=model.device))

    @property
    def slots(self) -> int:
        return self.max_batch

    @property
    def nbytes(self) -> int:
        return self.store.nbytes + self.valid.nbytes

    @property
    def device(self) -> torch.device:
        return self.valid.device

    def truncate(self, slot: int, keep: int) -> None:
        """Keep the first `keep` tokens of a slot (0 empties it)."""
        if keep < self.lengths[slot]:
            self.valid[slot, keep : self.lengths[slot]] = False
        self.lengths[slot] = min(keep, self.lengths[slot])
        del self.held[slot][keep:]
        if keep == 0:
            self.reach[slot] = 0  # whatever the rings still hold lies outside every later query's window

    def common_prefix(self, slot: int, tokens: list[int]) -> int:
        """How many leading `tokens` the slot already holds K/V for."""
        held, n = self.held[slot], 0
        for a, b in zip(held, tokens, strict=False):
            if a != b:
                break
            n += 1
        return n

    def can_resume(self, slot: int, n: int) -> bool:
        """Whether the slot's K/V let a request go on from its first `n` tokens: always for full layers; for a
        ring, while the window before slot n has not been overwritten by the slot's later tokens."""
        if n > self.lengths[slot]:
            return False
        reach = self.reach[slot]
        for rows, window, ring in zip(self.store.rows, self.store.windows, self.store.rings, strict=True):
            # The slots n - window + 1 .. n - 1 are still there when none was overwritten (reach <= rows)
            # or the oldest of them is within `rows` of the newest slot written.
            if ring and n and reach > rows and max(0, n - window + 1) < reach - rows:
                return False
        return True

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot `dst` becomes the first `n` tokens of slot `src` (K/V copied: one strided copy per tensor;
        a ring layer's rows all, since its slots are not in order)."""
        if n > self.lengths[src]:
            raise ValueError(f"slot {src} holds {self.lengths[src]} tokens, not {n}")
        if not self.can_resume(src, n):
            raise ValueError(f"slot {src}'s sliding layers no longer hold the window before token {n}")
        self.truncate(dst, 0)
        for k, v in self.store.groups:
            rows = n if k.shape[3] == self.max_tokens else k.shape[3]
            k[:, dst, :, :rows] = k[:, src, :, :rows]
            v[:, dst, :, :rows] = v[:, src, :, :rows]
        self.valid[dst, :n] = True
        self.lengths[dst] = n
        self.reach[dst] = max(n, self.reach[src]) if any(self.store.rings) else n  # the rings came whole
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
            if len(ids) > self.max_write:
                raise ValueError(
                    f"slot {slot}: {len(ids)} tokens in one claim, the sliding layers' rings take {self.max_write}"
                )
            self.valid[slot, start:end] = True
            self.lengths[slot] = end
            self.reach[slot] = max(self.reach[slot], end)
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
        store = self.cache.store
        kc, vc, rows = store.k[layer], store.v[layer], store.rows[layer]
        if len(self.slots) == 1:
            slot = self.slots[0]
            if store.rings[layer]:
                store.store(layer, slice(slot, slot + 1), start, k, v)
            else:
                kc[slot, :, start : start + k.shape[2]] = k[0]
                vc[slot, :, start : start + k.shape[2]] = v[0]
        else:
            at = self._start_index % rows if store.rings[layer] else self._start_index
            kc[self._index, :, at] = k[:, :, 0]
            vc[self._index, :, at] = v[:, :, 0]
        end = min(self._end, rows)  # a wrapped ring: all its rows, in ring order (see `ring_mask`)
        return self._select(kc, end), self._select(vc, end)

    def ring_mask(self, layer: int, start: int, seqlen: int) -> Tensor | None:
        """As `KVCache.ring_mask`, each row at its own slot: None until some row's ring has wrapped."""
        store = self.cache.store
        if not store.wrapped(layer, self._end):
            return None
        device = self._start_index.device
        if len(self.slots) == 1:
            queries = torch.arange(start, start + seqlen, device=device)[None]
        else:
            queries = self._start_index[:, None]
        held = ring_slots(store.rows[layer], queries[:, -1] + 1)
        valid = self.cache.valid.index_select(0, self._index)
        return ring_mask(valid, held, queries, store.windows[layer])

    def attention_mask(self, start: int, seqlen: int) -> Tensor:
        valid = self.cache.valid.index_select(0, self._index)
        if seqlen == 1:
            return valid[:, None, None, : self._end]
        return attention_mask(valid, start, seqlen)
