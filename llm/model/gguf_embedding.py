"""The token embeddings of a GGUF as stored: only the rows a pass needs are dequantized from the block table.

Why: the table is the largest tensor of a small model (SmolLM2's is a quarter of it) and a pass reads a few
rows of it; dequantizing the whole table to fp32 would cost 4-8x the file's bytes for nothing. Each token's
row is whole blocks (a row of K columns is K / block elements blocks), so gathering the block rows and
dequantizing them gives exactly the rows the fp32 import holds. A tied output head multiplies by the same
blocks (`GGUFLinear` over the same `GGUFWeight`), so the table is held once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .weight_formats import GGUFWeight, dequantize_gguf


class GGUFEmbedding(nn.Module):
    """tokens [...] -> rows [..., dim] in `dtype`, from a GGUF block table [vocab, dim].

    scale: Gemma's sqrt(dim), rounded to `dtype` as `ScaledEmbedding` rounds it (the table stays unscaled,
    since a tied head reads it)."""

    def __init__(self, weight: GGUFWeight, dtype: torch.dtype = torch.float32, scale: float | None = None) -> None:
        super().__init__()
        self.qtype, self.type_name = weight.qtype, weight.type_name
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("blocks", weight.blocks)  # a view on the mapped file, not a copy
        self.dtype = dtype
        self.scale = scale

    def gguf_weight(self) -> GGUFWeight:
        return GGUFWeight(self.blocks, self.qtype, (self.num_embeddings, self.embedding_dim), self.type_name)

    def forward(self, tokens: Tensor) -> Tensor:
        flat = tokens.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for a vocabulary of {self.num_embeddings}")
        # each distinct token's row once: a prefill repeats tokens, a batch of decodes rarely does
        ids, back = torch.unique(flat, return_inverse=True)
        rows = dequantize_gguf(self.gguf_weight().rows(ids.to(self.blocks.device)))
        out = rows.to(device=tokens.device, dtype=self.dtype)[back.to(tokens.device)]
        if self.scale is not None:
            out = out * torch.tensor(self.scale, dtype=self.dtype)
        return out.reshape(*tokens.shape, self.embedding_dim)
