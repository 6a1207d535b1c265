"""Rotary position embeddings (RoPE): the frequencies a config asks for and the rotation of q and k.

Shared by the model (llm/model/transformer.py) and the KV caches, which re-rotate keys when a window slides.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None, *, local: bool = False) -> Tensor:
    """Inverse frequencies [head_dim/2] in fp32, llama3 or linear frequency scaling applied when configured;
    `local`: those of the sliding layers that have their own base (Gemma 3), never scaled.

    Same fp32 arithmetic as transformers, so positions rotate identically.
    """
    dim = cfg.head_dim
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta is not None else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    s = None if local else cfg.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return inv_freq / s.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x[..., head_dim] by angles whose cos/sin are [..., head_dim/2] (HF's rotate-half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Full-width (cos, sign-folded sin) [..., head_dim] for `apply_rope_full`, built once per forward."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope_full(x: Tensor, cos2: Tensor, sin2: Tensor) -> Tensor:
    """`apply_rope` in 4 ops instead of 7, bit-identical: x*cos + rotate_half(x)*(±sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos2 + torch.cat((x2, x1), dim=-1) * sin2
