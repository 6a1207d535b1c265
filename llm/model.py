"""A Llama decoder in plain PyTorch: embeddings, RoPE, GQA attention, SwiGLU MLP, RMSNorm.

Every linear layer is built by a *linear factory* from whatever object the weights dict holds for it, so
quantized layers drop in without this module knowing about them. The protocol is just `nn.Module` mapping
x[..., in_features] -> [..., out_features]; `dense_linear` handles plain tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .layer_clock import LayerClock, now_ns
from .layer_names import LINEAR_NAMES
from .weights import WeightError, internal_shapes

if TYPE_CHECKING:
    from .kv_cache import KVCache

LinearFactory = Callable[[Any], nn.Module]
"""Builds a module computing x[..., in] -> [..., out] from one weight object (a tensor, a quantized blob)."""


def dense_linear(weight: Any) -> nn.Module:
    """The default factory: an `nn.Linear` (no bias) that uses `weight` itself as its parameter, no copy."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"dense_linear needs a Tensor, got {type(weight).__name__}; pass a linear_factory")
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


# --- RoPE ------------------------------------------------------------------------------------------------


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> Tensor:
    """Inverse frequencies [head_dim/2] in fp32, llama3 frequency scaling applied when configured.

    Same fp32 arithmetic as transformers, so positions rotate identically.
    """
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
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


# --- layers ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        # Normalize in fp32 (bf16 squares lose too much), scale in the model's dtype, as HF does. In fp32 the
        # fused kernel computes the same thing in one op instead of six (it matters at prefill: ~20x).
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv: nn.Module = nn.Linear(cfg.dim, self.q_size + 2 * self.kv_size, bias=False)
        self.wo: nn.Module = nn.Linear(self.q_size, cfg.dim, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: KVCache | None,
        layer: int,
        start: int,
    ) -> Tensor:
        bsz, seqlen, _ = x.shape
        n_heads, n_kv, head_dim = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(bsz, seqlen, n_heads + 2 * n_kv, head_dim)
        # One rotation for q and k together (cos/sin are [B, T, 1, head_dim], full width, see rope_tables).
        qk = apply_rope_full(qkv[:, :, : n_heads + n_kv], cos, sin)
        k = qk[:, :, n_heads:].transpose(1, 2)
        v = qkv[:, :, n_heads + n_kv :].transpose(1, 2)
        if cache is not None:
            k, v = cache.write(layer, start, k, v)
            k, v = k.to(x.dtype), v.to(x.dtype)
        if seqlen == 1:
            # Decode: group the query heads by the KV head they share, [B, kv_heads, n_rep, d], so one plain
            # attention covers them with no GQA expansion; the CPU SDPA with enable_gqa (and a mask) costs
            # ~10x more per call. q heads h = g * n_rep + r map to kv head g: the grouping is a reshape.
            qg = qk[:, 0, :n_heads].reshape(bsz, n_kv, n_heads // n_kv, head_dim)
            y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)  # mask [B, 1, 1, S] broadcasts
            return self.wo(y.reshape(bsz, 1, self.q_size))
        q = qk[:, :, :n_heads].transpose(1, 2)
        # mask None: causal from slot 0 (the caller only passes None when that is what attention means).
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=n_heads != n_kv)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, self.q_size))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w13: nn.Module = nn.Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)
        self.w2: nn.Module = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: KVCache | None,
        layer: int,
        start: int,
        marks: list[int] | None = None,
    ) -> Tensor:
        """marks: when a LayerClock observes, the time after the attention and after the MLP are appended."""
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, cache, layer, start)
        if marks is not None:
            marks.append(now_ns(h.device))
        out = h + self.feed_forward(self.ffn_norm(h))
        if marks is not None:
            marks.append(now_ns(out.device))
        return out


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


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, max_seq_len: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        # Weights always come from a checkpoint: skip the random init (on the meta device, Embedding's
        # normal_ goes through torch's Python decompositions and imports torch._dynamo: 2.3 s per load).
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Module = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.rope_inv_freq: Tensor
        if self.tok_embeddings.weight.device.type != "meta":  # from_weights builds them on the real device
            self.setup_rope(self.tok_embeddings.weight.device)

    def setup_rope(self, device: torch.device | str) -> None:
        """(Re)build the fp32 cos/sin tables [max_seq_len, head_dim/2] on `device`."""
        inv_freq = rope_inv_freq(self.cfg, device)
        positions = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: KVCache | None = None,
        *,
        valid: Tensor | None = None,
        last_only: bool = False,
        clock: LayerClock | None = None,
    ) -> Tensor:
        """Logits [B, T, V] (or [B, 1, V] with `last_only`) in the model's dtype.

        tokens, positions: [B, T] (positions are RoPE positions: they skip left padding).
        valid: [B, T] bool, False for padding; padded slots are never attended. None means all valid.
        cache: when given, K/V of these tokens are appended to it (room must have been made) and attention
            covers everything cached; without it attention is causal over `tokens` alone.
        last_only: apply the head to the last position only; prefill needs no more (the [B,T,V] head
            is the costliest matmul of a prefill over a large vocabulary).
        clock: per-layer timings of this pass are recorded into it (llm/layer_clock.py).
        """
        seqlen = tokens.shape[1]
        marks = [now_ns(tokens.device)] if clock is not None else None
        h = self.tok_embeddings(tokens)
        # Gather cos/sin before `cache.append`: `positions` may be a view of the cache's next positions.
        # Once per forward, shared by every layer: [B, T, 1, head_dim] (heads broadcast).
        cos, sin = rope_tables(self.rope_cos[positions].unsqueeze(2), self.rope_sin[positions].unsqueeze(2))
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        if cache is None:
            if seqlen > self.max_seq_len:
                raise ValueError(f"{seqlen} tokens exceed max_seq_len {self.max_seq_len}")
            start = 0
            mask = None if valid is None else attention_mask(valid, 0, seqlen)
        else:
            if cache.max_tokens > self.max_seq_len:
                raise ValueError(f"cache of {cache.max_tokens} tokens exceeds max_seq_len {self.max_seq_len}")
            start = cache.append(positions, valid)
            # A mask only where it says more than "causal": padding in the cache, or a chunk that starts
            # after slot 0 (is_causal aligns the top-left corner). A single query sees every slot anyway.
            needs_mask = cache.padded or (seqlen > 1 and start > 0)
            mask = cache.attention_mask(start, seqlen) if needs_mask else None
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, cache, i, start, marks)
        if last_only:
            h = h[:, -1:]
        logits = self.output(self.norm(h))
        if clock is not None and marks is not None:
            marks.append(now_ns(logits.device))
            clock.record("torch", tokens.shape[0], seqlen, marks)
        return logits

    @classmethod
    def from_weights(
        cls,
        cfg: ModelConfig,
        weights: Mapping[str, Any],
        *,
        linear_factory: LinearFactory | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_seq_len: int | None = None,
        keep_linear_dtype: bool = False,
    ) -> Transformer:
        """Build a model around `weights` (internal names, see `llm.weights`) without any init copy.

        The skeleton is built on the meta device, then each parameter is *assigned*: tensors already on
        `device` in `dtype` are used as they are (no copy; tied embeddings stay one tensor). Non-tensor
        linear weights (quantized) go to `linear_factory` as they are; its module is then moved to `device`.
        device/dtype default to those of `tok_embeddings.weight`. keep_linear_dtype: dense linear weights keep
        their own dtype (a bf16 weight under fp32 activations, as load.convert produces) instead of `dtype`.
        """
        factory = linear_factory or dense_linear
        shapes = internal_shapes(cfg)
        missing = sorted(set(shapes) - set(weights))
        unexpected = sorted(set(weights) - set(shapes))
        if missing or unexpected:
            raise WeightError(f"weights do not match the config: missing {missing[:5]}, extra {unexpected[:5]}")
        embed = weights["tok_embeddings.weight"]
        device = torch.device(device) if device is not None else embed.device
        dtype = dtype or embed.dtype
        converted: dict[tuple[int, Any], Tensor] = {}  # by id: a tensor shared by two names stays shared

        def tensor(name: str, keep_dtype: bool = False) -> Tensor:
            t = weights[name]
            if tuple(t.shape) != shapes[name]:
                raise WeightError(f"{name}: expected shape {shapes[name]}, got {tuple(t.shape)}")
            key = (id(t), t.dtype if keep_dtype else dtype)
            if key not in converted:
                converted[key] = t.to(device=device, dtype=key[1])
            return converted[key]

        def linear(name: str) -> nn.Module:
            key = name + ".weight"
            obj = weights[key]
            shape = getattr(obj, "shape", None)
            if shape is not None and tuple(shape) != shapes[key]:
                raise WeightError(f"{key}: expected shape {shapes[key]}, got {tuple(shape)}")
            dense = isinstance(obj, Tensor)
            return factory(tensor(key, keep_linear_dtype) if dense else obj).to(device=device)

        def param(name: str) -> nn.Parameter:
            return nn.Parameter(tensor(name), requires_grad=False)

        with torch.device("meta"):
            model = cls(cfg, max_seq_len=max_seq_len)
        model.tok_embeddings.weight = param("tok_embeddings.weight")
        model.norm.weight = param("norm.weight")
        model.output = linear("output")
        for i, block in enumerate(model.layers):
            for rel in LINEAR_NAMES:
                parent, attr = rel.split(".")
                setattr(block.get_submodule(parent), attr, linear(f"layers.{i}.{rel}"))
            block.attention_norm.weight = param(f"layers.{i}.attention_norm.weight")
            block.ffn_norm.weight = param(f"layers.{i}.ffn_norm.weight")
        model.setup_rope(device)
        return model.eval()
