"""A static, preallocated KV cache with per-row validity (left padding) and a policy for when it is full.

Layout: per layer, K/V [batch, kv_heads, rows, head_dim] (llm/kv/layers.py): rows = max_tokens for a
full-attention layer, window + chunk for a sliding-window one, which keeps slot s at row s % rows (a ring),
so one write adds at most `max_write` tokens to a row. All rows share one write pointer
(`length`): a batch is left-padded, so slot order is time order for every row, and one slice write per layer
stores a step. Each row has its own `valid` mask (padding is never attended) and its own RoPE positions
(`pos`), which skip padding.

Policies when a step does not fit:
- "stop": `make_room` returns False; generation ends those rows with finish reason "cache_full".
- "slide" (StreamingLLM, Xiao et al. 2023): drop the oldest entries, but never a row's first `sink_tokens`
  valid tokens (the attention sinks). Padding slots go first, then the oldest non-sink tokens, `evict_chunk`
  slots at a time (each eviction costs one pass over the cache, so it is amortized over many steps).
  Positions: as in StreamingLLM, a token's RoPE position is its rank among the row's cached tokens, not its
  index in the text, so positions stay < max_tokens however long generation runs. On eviction the kept keys
  (stored already rotated) are rotated back by the number of tokens dropped before them, and the next
  token's position becomes the row's cached-token count. Eviction moves slots, which a ring cannot
  follow: under "slide" every layer keeps all max_tokens rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from ..model.masks import attention_mask
from ..model.rope import apply_rope
from .layers import DEFAULT_CHUNK, LayerKV, layer_rows, ring_mask, ring_slots

if TYPE_CHECKING:
    from ..model.config import ModelConfig
    from ..model.transformer import Transformer

CachePolicy = Literal["stop", "slide"]


def planned_bytes(
    cfg: ModelConfig,
    max_batch: int,
    max_tokens: int,
    dtype: torch.dtype,
    *,
    policy: CachePolicy = "stop",
    chunk: int | None = None,
) -> int:
    """The bytes `KVCache.for_model` allocates with these settings, without allocating them: each layer's K/V
    by its kind (every slot of a full layer, window + chunk of a sliding one, see llm/kv/layers.py), with the
    architecture's own kv heads and head_dim, plus the per-slot validity and positions."""
    ring = policy == "stop"  # "slide" keeps every layer full
    rows = layer_rows(cfg.layer_windows, cfg.n_layers, max_tokens, DEFAULT_CHUNK if chunk is None else chunk, ring=ring)
    element = torch.empty(0, dtype=dtype).element_size()
    kv = 2 * max_batch * cfg.n_kv_heads * cfg.head_dim * element * sum(rows)
    bool_size, long_size = 1, 8
    return kv + max_batch * max_tokens * (bool_size + long_size) + max_batch * long_size


class CacheFullError(RuntimeError):
    """An append that does not fit (call `make_room` first), or a chunk too large to ever fit."""


class KVCache:
    def __init__(
        self,
        n_layers: int,
        max_batch: int,
        n_kv_heads: int,
        max_tokens: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        policy: CachePolicy = "stop",
        sink_tokens: int = 4,
        evict_chunk: int | None = None,
        inv_freq: Tensor | None = None,
        windows: tuple[int, ...] = (),
        chunk: int | None = None,
    ) -> None:
        """windows: each layer's sliding window (a config's `layer_windows`; 0 or empty: full attention);
        chunk: the most tokens one write adds to a row, which sizes the sliding layers' rings."""
        if policy not in ("stop", "slide"):
            raise ValueError(f"policy must be 'stop' or 'slide', got {policy!r}")
        if policy == "slide":
            if not 0 <= sink_tokens < max_tokens - 1:
                raise ValueError(f"sink_tokens ({sink_tokens}) must leave room in max_tokens ({max_tokens})")
            if inv_freq is None:
                raise ValueError("policy 'slide' re-rotates keys: pass inv_freq (or use KVCache.for_model)")
        self.store = LayerKV(
            n_layers, max_batch, n_kv_heads, max_tokens, head_dim, windows=windows, chunk=chunk,
            ring=policy == "stop", dtype=dtype, device=device,
        )  # fmt: skip
        # Layer 0's group: every layer's K/V when no layer is a ring (Llama), as [layers, batch, kv, T, hd].
        self.k, self.v = self.store.groups[0]
        self.shape = (n_layers, max_batch, n_kv_heads, max_tokens, head_dim)  # as if every layer were full
        self.max_write = self.store.max_write
        self.valid = torch.zeros(max_batch, max_tokens, dtype=torch.bool, device=device)
        self.pos = torch.zeros(max_batch, max_tokens, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.policy: CachePolicy = policy
        self.sink_tokens = sink_tokens
        self.evict_chunk = evict_chunk or max(1, (max_tokens - sink_tokens) // 8)
        self.inv_freq = inv_freq.to(device=self.store.device, dtype=torch.float32) if inv_freq is not None else None
        self.batch = max_batch  # active rows: the first `batch` of the preallocated ones
        self.length = 0  # slots in use, the same for every row
        self.evicted = 0  # slots dropped by "slide" since the last reset
        # Whether any slot in use is padding: without it attention needs no mask (decode sees every slot,
        # prefill from slot 0 is plain causal), and the mask-free SDPA paths are several times faster.
        self.padded = False

    @classmethod
    def for_model(
        cls,
        model: Transformer,
        max_batch: int,
        max_tokens: int,
        *,
        dtype: torch.dtype | None = None,
        policy: CachePolicy = "stop",
        sink_tokens: int = 4,
        evict_chunk: int | None = None,
        chunk: int | None = None,
    ) -> KVCache:
        """A cache shaped for `model` (its sliding layers as rings sized by `chunk`, see llm/kv/layers.py),
        on its device, in its dtype unless `dtype` is given."""
        cfg = model.cfg
        if max_tokens > model.max_seq_len:
            raise ValueError(f"max_tokens ({max_tokens}) exceeds the model's max_seq_len ({model.max_seq_len})")
        return cls(
            cfg.n_layers,
            max_batch,
            cfg.n_kv_heads,
            max_tokens,
            cfg.head_dim,
            dtype=dtype or model.dtype,
            device=model.device,
            policy=policy,
            sink_tokens=sink_tokens,
            evict_chunk=evict_chunk,
            inv_freq=model.rope_inv_freq,
            windows=cfg.layer_windows,
            chunk=chunk,
        )

    @property
    def nbytes(self) -> int:
        return self.store.nbytes + sum(t.nbytes for t in (self.valid, self.pos, self.next_pos))

    @property
    def free(self) -> int:
        return self.max_tokens - self.length

    def reset(self, batch: int | None = None) -> None:
        """Empty the cache and use its first `batch` rows (default all). No reallocation."""
        batch = self.max_batch if batch is None else batch
        if not 0 < batch <= self.max_batch:
            raise ValueError(f"batch {batch} does not fit a cache of {self.max_batch} rows")
        self.batch, self.length, self.evicted = batch, 0, 0
        self.padded = False
        self.valid.zero_()
        self.next_pos.zero_()

    def next_positions(self) -> Tensor:
        """[batch, 1] RoPE positions for one more token per row (a view; `append` updates it)."""
        return self.next_pos[: self.batch, None]

    def make_room(self, n: int) -> bool:
        """Ensure `n` free slots. False when full under "stop"; under "slide" evict and return True."""
        if self.length + n <= self.max_tokens:
            return True
        if self.policy == "stop":
            return False
        if n > self.max_tokens - self.sink_tokens:
            raise CacheFullError(f"{n} new tokens never fit {self.max_tokens} slots with {self.sink_tokens} sinks")
        need = self.length + n - self.max_tokens
        self.evict(min(max(need, self.evict_chunk), self.length - self.sink_tokens))
        return True

    def append(self, positions: Tensor, valid: Tensor | None = None) -> int:
        """Claim slots for [batch, T] new tokens; returns the first slot. K/V follow via `write`."""
        n = positions.shape[1]
        if positions.shape[0] != self.batch:
            raise ValueError(f"{positions.shape[0]} rows given, the cache has {self.batch} active rows")
        if self.length + n > self.max_tokens:
            raise CacheFullError(f"{n} tokens do not fit: {self.length}/{self.max_tokens} slots used")
        if n > self.max_write:
            raise CacheFullError(f"{n} tokens in one write: the sliding layers' rings take {self.max_write} at most")
        start, end, b = self.length, self.length + n, self.batch
        self.pos[:b, start:end] = positions
        last = positions[:, -1] + 1
        if valid is None:
            self.valid[:b, start:end] = True
            self.next_pos[:b] = last
        else:
            self.valid[:b, start:end] = valid
            if not self.padded:
                self.padded = not bool(valid.all())  # one small sync, at prefill only
            self.next_pos[:b] = torch.where(valid[:, -1], last, self.next_pos[:b])
        self.length = end
        return start

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [batch, kv_heads, T, head_dim] at slots start..; return views of all slots so far."""
        end, b, store = start + k.shape[2], self.batch, self.store
        if not store.rings[layer]:
            self.store.k[layer][:b, :, start:end] = k
            self.store.v[layer][:b, :, start:end] = v
        else:
            store.store(layer, slice(0, b), start, k, v)
        end = min(end, store.rows[layer])  # a wrapped ring: all its rows, in ring order (see `ring_mask`)
        return store.k[layer][:b, :, :end], store.v[layer][:b, :, :end]

    def ring_mask(self, layer: int, start: int, seqlen: int) -> Tensor | None:
        """The mask of a sliding layer whose ring has wrapped (its rows out of time order), for queries at
        slots start..start+seqlen-1; None where the layer reads as a full one (the usual masks apply)."""
        end = start + seqlen
        if not self.store.wrapped(layer, end):
            return None
        b, device = self.batch, self.valid.device
        held = ring_slots(self.store.rows[layer], torch.full((b,), end, device=device))
        queries = torch.arange(start, end, device=device).expand(b, seqlen)
        return ring_mask(self.valid[:b], held, queries, self.store.windows[layer])

    def attention_mask(self, start: int, seqlen: int) -> Tensor:
        """Bool mask [batch, 1, T, S] for queries in slots start..start+T-1 (S = start + T)."""
        valid = self.valid[: self.batch]
        if seqlen == 1:
            # Decode: causality is implied and the new token is valid: a view, no allocation.
            return valid[:, None, None, : start + 1]
        return attention_mask(valid, start, seqlen)

    def reorder(self, index: Tensor) -> None:
        """Row i becomes old row index[i] (beam search); len(index) may differ from the active batch."""
        rows, b, s = index.shape[0], self.batch, self.length
        if rows > self.max_batch:
            raise ValueError(f"{rows} rows do not fit a cache of {self.max_batch}")
        for layer, (kl, vl) in enumerate(zip(self.store.k, self.store.v, strict=True)):
            n = min(s, self.store.rows[layer])  # a wrapped ring: all its rows
            kl[:rows, :, :n] = kl[:b, :, :n].index_select(0, index)
            vl[:rows, :, :n] = vl[:b, :, :n].index_select(0, index)
        self.valid[:rows, :s] = self.valid[:b, :s].index_select(0, index)
        self.pos[:rows, :s] = self.pos[:b, :s].index_select(0, index)
        self.next_pos[:rows] = self.next_pos[:b].index_select(0, index)
        self.batch = rows

    def evict(self, drop: int) -> None:
        """Drop `drop` slots per row (padding first, then oldest non-sink tokens) and re-rotate kept keys."""
        assert self.inv_freq is not None
        b, s = self.batch, self.length
        keep_n = s - drop
        slots = torch.arange(s, device=self.valid.device)
        valid = self.valid[:b, :s]
        rank = valid.cumsum(1) - 1
        sink = valid & (rank < self.sink_tokens)
        # Lower priority is dropped first: padding (by age), then tokens (by age); sinks last of all.
        priority = torch.where(valid, slots + s, slots).masked_fill(sink, 3 * s)
        dropped = priority.topk(drop, dim=1, largest=False).indices
        keep = torch.ones_like(valid).scatter_(1, dropped, False)
        keep_idx = slots.expand(b, s)[keep].view(b, keep_n)  # boolean indexing keeps slot order
        new_valid = valid.gather(1, keep_idx)
        new_pos = (new_valid.cumsum(1) - 1).clamp(min=0)
        delta = torch.where(new_valid, new_pos - self.pos[:b, :s].gather(1, keep_idx), 0)
        angles = delta.unsqueeze(-1).float() * self.inv_freq  # [b, keep_n, head_dim/2]
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        n_kv, head_dim = self.shape[2], self.shape[4]
        index = keep_idx[:, None, :, None].expand(b, n_kv, keep_n, head_dim)
        # One layer at a time bounds the temporary to one layer. No ring under "slide": every layer is full.
        for kl, vl in zip(self.store.k, self.store.v, strict=True):
            k = kl[:b, :, :s].gather(2, index)
            kl[:b, :, :keep_n] = apply_rope(k.float(), cos, sin)
            vl[:b, :, :keep_n] = vl[:b, :, :s].gather(2, index)
        self.valid[:b, :keep_n] = new_valid
        self.valid[:b, keep_n:s] = False
        self.padded = not bool(new_valid.all())  # padding is dropped first: usually none is left
        self.pos[:b, :keep_n] = new_pos
        self.next_pos[:b] = new_valid.sum(1)
        self.length = keep_n
        self.evicted += drop
