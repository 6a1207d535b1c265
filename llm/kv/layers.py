"""The K/V memory of a cache, layer by layer: a full-attention layer holds every slot, a sliding-window
layer a ring of `window + chunk` rows.

Why that many: a query at slot q of a sliding layer reads slots q - window + 1 .. q only, and one pass
writes at most `chunk` new slots per row before any of them attends (a prompt chunk). The oldest key a pass
reads is then fewer than window + chunk slots before the newest one it wrote, so a ring of window + chunk
rows, slot s kept at row s % rows, still holds it (llama.cpp sizes its SWA cache n_swa + n_ubatch for the
same reason). `chunk` is therefore also the most tokens one write may add to a row (`max_write`) where a
layer is a ring; callers cut prompts into chunks of at most that.

Until a ring wraps (no slot past its rows yet), ring row = slot and the layer reads exactly as a full one
does; after that its rows are out of time order and `ring_mask` tells attention which slot each row holds.
A layer whose ring would be no smaller than the cache (short contexts) is allocated as a full layer.

Layers with the same row count share one tensor [layers, batch, kv_heads, rows, head_dim] (Llama: a single
one, exactly the layout every cache had before windows), and `k[layer]` / `v[layer]` are views into it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

DEFAULT_CHUNK = 512
"""Tokens one pass may write per row when the model has sliding layers (the scheduler's default step)."""


def layer_rows(windows: Sequence[int], n_layers: int, max_tokens: int, chunk: int, *, ring: bool = True) -> list[int]:
    """Rows each layer's K/V hold: max_tokens for a full layer (and for every layer when not `ring`),
    window + chunk for a sliding one when that is fewer. `windows` is a config's `layer_windows` (empty: none)."""
    rows = []
    for i in range(n_layers):
        window = windows[i] if i < len(windows) else 0
        rows.append(min(max_tokens, window + chunk) if ring and window else max_tokens)
    return rows


class LayerKV:
    def __init__(
        self,
        n_layers: int,
        max_batch: int,
        n_kv_heads: int,
        max_tokens: int,
        head_dim: int,
        *,
        windows: Sequence[int] = (),
        chunk: int | None = None,
        ring: bool = True,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        """ring: False keeps every layer full (a policy that moves slots around, such as "slide")."""
        chunk = DEFAULT_CHUNK if chunk is None else chunk
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        self.rows = tuple(layer_rows(windows, n_layers, max_tokens, chunk, ring=ring))
        self.windows = tuple(windows[i] if i < len(windows) else 0 for i in range(n_layers))
        self.max_tokens = max_tokens
        self.rings = tuple(r < max_tokens for r in self.rows)
        # The most tokens one write may add to a row: unbounded (the cache's size) without rings.
        self.max_write = chunk if any(self.rings) else max_tokens
        self.groups: list[tuple[Tensor, Tensor]] = []
        self.k: list[Tensor] = [torch.empty(0)] * n_layers
        self.v: list[Tensor] = [torch.empty(0)] * n_layers
        for rows in dict.fromkeys(self.rows):  # in layer order: the first group is layer 0's
            members = [i for i, r in enumerate(self.rows) if r == rows]
            shape = (len(members), max_batch, n_kv_heads, rows, head_dim)
            k = torch.zeros(shape, dtype=dtype, device=device)
            v = torch.zeros(shape, dtype=dtype, device=device)
            self.groups.append((k, v))
            for at, layer in enumerate(members):
                self.k[layer], self.v[layer] = k[at], v[at]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.groups)

    @property
    def dtype(self) -> torch.dtype:
        return self.groups[0][0].dtype

    @property
    def device(self) -> torch.device:
        return self.groups[0][0].device

    def wrapped(self, layer: int, end: int) -> bool:
        """Whether a ring layer's rows are out of time order once slots up to `end` (exclusive) are written."""
        return self.rings[layer] and end > self.rows[layer]

    def store(self, layer: int, rows: slice | Tensor, start: int, k: Tensor, v: Tensor) -> None:
        """K/V [rows, kv_heads, T, head_dim] of slots start..start+T-1 into layer `layer` (at slot % rows)."""
        kl, vl, n = self.k[layer], self.v[layer], self.rows[layer]
        t = k.shape[2]
        at = start % n
        if at + t <= n:  # no wrap inside this write: one slice
            kl[rows, :, at : at + t] = k
            vl[rows, :, at : at + t] = v
            return
        first = n - at
        kl[rows, :, at:] = k[:, :, :first]
        vl[rows, :, at:] = v[:, :, :first]
        kl[rows, :, : t - first] = k[:, :, first:]
        vl[rows, :, : t - first] = v[:, :, first:]


def ring_slots(rows: int, ends: Tensor) -> Tensor:
    """[B, rows]: the slot each ring row holds once slots below ends[b] are written (the latest slot below
    the end congruent to the row); negative where the row holds nothing yet."""
    j = torch.arange(rows, device=ends.device)
    return j + rows * torch.div(ends[:, None] - 1 - j, rows, rounding_mode="floor")


def ring_mask(valid: Tensor, held: Tensor, queries: Tensor, window: int) -> Tensor:
    """Bool mask [B, 1, T, rows] of a ring layer: the query at slot queries[b, t] sees ring row j when the
    slot held[b, j] it holds is valid (or the query's own), not after the query and within its window.

    valid: [B, max_tokens] per-slot validity; held: `ring_slots` [B, rows]; queries: [B, T] slots."""
    present = held >= 0
    live = valid.gather(1, held.clamp(min=0)) & present  # [B, rows]
    h, q = held[:, None, :], queries[:, :, None]
    see = (live[:, None, :] | (h == q)) & (h <= q) & (h > q - window)
    return see[:, None]
