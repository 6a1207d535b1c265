"""Attention masks: which key slots each query sees (causal, padding, sliding windows)."""

from __future__ import annotations

import torch
from torch import Tensor


def attention_mask(valid: Tensor, start: int, seqlen: int) -> Tensor:
    """Bool mask [B, 1, T, S] for T queries at slots start..start+T-1 over keys in slots 0..S-1 (S = start+T).

    A query sees earlier-or-same slots whose key is valid, and always its own slot: padding queries then
    attend to something (no all-masked row, whose softmax would be NaN and leak into the cache as NaN keys).
    """
    total = start + seqlen
    slots = torch.arange(total, device=valid.device)
    query_slots = slots[start:].unsqueeze(1)
    causal = slots.unsqueeze(0) <= query_slots
    own = slots.unsqueeze(0) == query_slots
    return (causal & (valid[:, None, :total] | own)).unsqueeze(1)


def window_mask(mask: Tensor | None, start: int, seqlen: int, keys: int, window: int, device: torch.device) -> Tensor:
    """`mask` ([B, 1, T, S] bool, or None: causal, the queries at slots start..) narrowed to a sliding window,
    as transformers' sliding-window mask: the query at slot q sees only slots above q - window (itself and the
    window - 1 before it). Valid slots of a row are consecutive, so slot distance is position distance.

    One query per row may sit at a different slot per row (a scheduler's decode rows): its slot is then its
    row's last visible one."""
    slots = torch.arange(keys, device=device)
    if mask is not None and seqlen == 1:
        last = keys - 1 - mask[..., 0, :].flip(-1).int().argmax(-1)  # [B, 1]
        return mask & (slots > last[..., None, None] - window).view(mask.shape[0], 1, 1, keys)
    query_slots = torch.arange(start, start + seqlen, device=device).unsqueeze(1)
    band = (slots.unsqueeze(0) > query_slots - window) & (slots.unsqueeze(0) <= query_slots)
    return band[None, None] if mask is None else mask & band
