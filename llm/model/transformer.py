"""A Llama-style decoder in plain PyTorch: embeddings, RoPE, GQA attention, SwiGLU MLP, RMSNorm, and the
departures of the other families (llm/model/architecture.py) chosen once at build time: q/k/v biases, q/k norms,
GeGLU, Gemma's extra norms and embedding scale, sliding windows, soft-caps, another attention scale.

Every linear layer is built by a *linear factory* from whatever object the weights dict holds for it, so
quantized layers drop in without this module knowing about them. The protocol is just `nn.Module` mapping
x[..., in_features] -> [..., out_features]; `dense_linear` handles plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .gguf_embedding import GGUFEmbedding
from .layer_clock import LayerClock, now_ns
from .layer_names import LINEAR_NAMES
from .masks import attention_mask, window_mask
from .rope import apply_rope_full, rope_inv_freq, rope_tables
from .weight_formats import GGUFWeight
from .weights import NORM_SUFFIX, WeightError, internal_shapes


class AttentionCache(Protocol):
    """What the model needs of a KV cache (llm/kv/ implements it): slots for a pass's tokens, K/V written
    per layer, and the masks of its valid slots."""

    max_tokens: int
    padded: bool

    def append(self, positions: Tensor, valid: Tensor | None) -> int: ...

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def ring_mask(self, layer: int, start: int, seqlen: int) -> Tensor | None: ...

    def attention_mask(self, start: int, seqlen: int) -> Tensor: ...

LinearFactory = Callable[[Any], nn.Module]
"""Builds a module computing x[..., in] -> [..., out] from one weight object (a tensor, a quantized blob)."""

LAYER_VECTORS = (
    *("attention_norm", "ffn_norm", "post_attention_norm", "post_ffn_norm"),
    *("attention.wqkv_bias", "attention.q_norm", "attention.k_norm"),
)
"""Per-layer norms and biases (those of the layer's architecture), relative to `layers.{i}`."""


def dense_linear(weight: Any) -> nn.Module:
    """The default factory: an `nn.Linear` (no bias) that uses `weight` itself as its parameter, no copy."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"dense_linear needs a Tensor, got {type(weight).__name__}; pass a linear_factory")
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


# --- layers ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight. Gemma's `1 + w` is folded into the weight at load (Transformer.from_weights)."""

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


class Bias(nn.Module):
    """x + weight: the q/k/v biases (Qwen2), apart from the linear so that any linear kernel (int8, int4...)
    computes the product and the bias stays fp32."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.weight


class ScaledEmbedding(nn.Embedding):
    """Embeddings times sqrt(dim) rounded to their dtype (Gemma): the table itself stays as stored, since a
    tied head reads it unscaled."""

    def forward(self, tokens: Tensor) -> Tensor:
        return super().forward(tokens) * torch.tensor(self.embedding_dim**0.5, dtype=self.weight.dtype)


def softcapped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, cap: float) -> Tensor:
    """Attention whose scores become cap * tanh(score / cap) before the mask and softmax (Gemma 2): SDPA has
    no such step. q [B, H, T, d], k/v [B, KV, S, d], mask [B|1, 1, T, S] bool; softmax in fp32, as HF."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        arch = cfg.arch
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv: nn.Module = nn.Linear(cfg.dim, self.q_size + 2 * self.kv_size, bias=False)
        self.wo: nn.Module = nn.Linear(self.q_size, cfg.dim, bias=False)
        self.wqkv_bias = Bias(self.q_size + 2 * self.kv_size) if arch.qkv_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if arch.qk_norm else None
        self.window = cfg.window(layer)
        self.scale = cfg.attn_scale
        self.softcap = cfg.attn_softcap
        # Sliding layers of a family with a local RoPE base rotate by the model's second table.
        self.local_rope = bool(self.window) and cfg.rope_local_theta is not None
        # Llama's path (SDPA, default scale, the decode grouping) unless something here departs from it.
        self.plain = not self.window and self.scale is None and self.softcap is None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: AttentionCache | None,
        layer: int,
        start: int,
    ) -> Tensor:
        bsz, seqlen, _ = x.shape
        n_heads, n_kv, head_dim = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x)
        if self.wqkv_bias is not None:
            qkv = self.wqkv_bias(qkv)
        qkv = qkv.view(bsz, seqlen, n_heads + 2 * n_kv, head_dim)
        qk = qkv[:, :, : n_heads + n_kv]
        if self.q_norm is not None and self.k_norm is not None:  # per head, before the rotation
            qk = torch.cat((self.q_norm(qk[:, :, :n_heads]), self.k_norm(qk[:, :, n_heads:])), dim=2)
        # One rotation for q and k together (cos/sin are [B, T, 1, head_dim], full width, see rope_tables).
        qk = apply_rope_full(qk, cos, sin)
        k = qk[:, :, n_heads:].transpose(1, 2)
        v = qkv[:, :, n_heads + n_kv :].transpose(1, 2)
        complete = False  # whether `mask` already says everything (a sliding layer's ring, out of time order)
        if cache is not None:
            k, v = cache.write(layer, start, k, v)
            k, v = k.to(x.dtype), v.to(x.dtype)
            if self.window:
                ring = cache.ring_mask(layer, start, seqlen)
                if ring is not None:
                    mask, complete = ring, True
        if not self.plain:
            q = qk[:, :, :n_heads].transpose(1, 2)
            y = self._attend(q, k, v, mask, start, complete)
            return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, self.q_size))
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

    def probabilities(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """This layer's attention weights [n_heads, T, T] (fp32) for x [1, T, dim] at positions 0..T-1, all
        valid: its own projections, biases, q/k norms, scale, soft-cap and window (the report's attention
        pictures, recomputed beside the pass). cos/sin: the layer's RoPE tables [positions, head_dim/2]."""
        t = x.shape[1]
        n_heads, n_kv = self.n_heads, self.n_kv_heads
        qkv = self.wqkv(x[:1])
        if self.wqkv_bias is not None:
            qkv = self.wqkv_bias(qkv)
        qk = qkv.view(1, t, n_heads + 2 * n_kv, self.head_dim)[:, :, : n_heads + n_kv]
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :n_heads]), self.k_norm(qk[:, :, n_heads:])), dim=2)
        c, s = rope_tables(cos[:t].to(qk.dtype)[None, :, None], sin[:t].to(qk.dtype)[None, :, None])
        qk = apply_rope_full(qk, c, s)[0].transpose(0, 1).float()  # [H + KV, T, d]
        q, k = qk[:n_heads], qk[n_heads:].repeat_interleave(n_heads // n_kv, dim=0)
        scores = q @ k.transpose(1, 2) * (self.scale if self.scale is not None else self.head_dim**-0.5)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        mask = window_mask(None, 0, t, t, self.window or t + 1, x.device)[0, 0]
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, start: int, complete: bool = False
    ) -> Tensor:
        """Attention of q [B, H, T, d] over k, v [B, KV, S, d] with this layer's window, scale and soft-cap.

        mask: [B, 1, T, S] bool ([B, 1, 1, S] for one query), or None: causal, the queries at the last T slots;
        complete: the mask has the window in it already (a ring's, llm/kv/layers.py)."""
        seqlen, keys = q.shape[2], k.shape[2]
        if complete:
            assert mask is not None
        elif mask is None:
            start = keys - seqlen
            mask = window_mask(None, start, seqlen, keys, self.window or keys + 1, q.device)
        elif self.window:
            mask = window_mask(mask, start, seqlen, keys, self.window, q.device)
        scale = self.scale if self.scale is not None else self.head_dim**-0.5
        if self.softcap is not None:
            return softcapped_attention(q, k, v, mask, scale, self.softcap)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=self.n_heads != self.n_kv_heads
        )


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w13: nn.Module = nn.Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)
        self.w2: nn.Module = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)
        self.gelu = cfg.arch.activation == "gelu_tanh"  # GeGLU (Gemma), else SwiGLU

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        if self.gelu:
            return self.w2(F.gelu(gate, approximate="tanh") * up)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention = Attention(cfg, layer)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        sandwich = cfg.arch.sandwich_norms  # Gemma: the attention's and the MLP's outputs are normalized too
        self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps) if sandwich else None
        self.post_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps) if sandwich else None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache: AttentionCache | None,
        layer: int,
        start: int,
        marks: list[int] | None = None,
    ) -> Tensor:
        """marks: when a LayerClock observes, the time after the attention and after the MLP are appended."""
        a = self.attention(self.attention_norm(x), cos, sin, mask, cache, layer, start)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        h = x + a
        if marks is not None:
            marks.append(now_ns(h.device))
        f = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            f = self.post_ffn_norm(f)
        out = h + f
        if marks is not None:
            marks.append(now_ns(out.device))
        return out


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, max_seq_len: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        # Weights always come from a checkpoint: skip the random init (on the meta device, Embedding's
        # normal_ goes through torch's Python decompositions and imports torch._dynamo: 2.3 s per load).
        embedding = ScaledEmbedding if cfg.arch.embed_scale else nn.Embedding
        self.tok_embeddings = embedding(cfg.vocab_size, cfg.dim, _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Module = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope_cos: Tensor
        self.rope_sin: Tensor
        self.rope_inv_freq: Tensor
        # The sliding layers' own tables when they rotate by another base (Gemma 3), else None.
        self.local_rope = any(block.attention.local_rope for block in self.layers)
        self.rope_local_cos: Tensor | None
        self.rope_local_sin: Tensor | None
        self.register_buffer("rope_local_cos", None, persistent=False)
        self.register_buffer("rope_local_sin", None, persistent=False)
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
        if self.local_rope:
            local = torch.outer(positions, rope_inv_freq(self.cfg, device, local=True))
            self.register_buffer("rope_local_cos", local.cos(), persistent=False)
            self.register_buffer("rope_local_sin", local.sin(), persistent=False)

    def rope_for(self, attention: Attention) -> tuple[Tensor, Tensor]:
        """The fp32 (cos, sin) tables [max_seq_len, head_dim/2] that `attention`'s layer rotates by."""
        if attention.local_rope and self.rope_local_cos is not None and self.rope_local_sin is not None:
            return self.rope_local_cos, self.rope_local_sin
        return self.rope_cos, self.rope_sin

    @property
    def device(self) -> torch.device:
        return self._activation_like().device

    @property
    def dtype(self) -> torch.dtype:
        return self._activation_like().dtype

    def _activation_like(self) -> Tensor:
        """A tensor in the activations' device and dtype: the embedding table, or (a GGUF's block table, which
        is uint8) the final norm's weight, built in the same dtype by from_weights."""
        if isinstance(self.tok_embeddings, GGUFEmbedding):
            return self.norm.weight
        return self.tok_embeddings.weight

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: AttentionCache | None = None,
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
        clock: per-layer timings of this pass are recorded into it (llm/model/layer_clock.py).
        """
        seqlen = tokens.shape[1]
        marks = [now_ns(tokens.device)] if clock is not None else None
        h = self._trunk(tokens, positions, cache, valid, marks)
        if last_only:
            h = h[:, -1:]
        logits = self.output(self.norm(h))
        if self.cfg.final_softcap is not None:  # Gemma 2
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        if clock is not None and marks is not None:
            marks.append(now_ns(logits.device))
            clock.record("torch", tokens.shape[0], seqlen, marks)
        return logits

    def hidden(
        self, tokens: Tensor, *, valid: Tensor | None = None, on_layer: Callable[[int, Tensor], None] | None = None
    ) -> Tensor:
        """The final hidden states [B, T, dim] (after the final norm) of `tokens` at positions 0..T-1, causal, no
        cache and no head: embeddings (`/v1/embeddings`) and the report's attention pass read them.
        on_layer(i, x): called with each layer's input before it runs (what its attention normalizes)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
        if valid is not None:
            positions = (valid.cumsum(1) - 1).clamp(min=0)
        return self.norm(self._trunk(tokens, positions, None, valid, None, on_layer))

    def _trunk(
        self,
        tokens: Tensor,
        positions: Tensor,
        cache: AttentionCache | None,
        valid: Tensor | None,
        marks: list[int] | None,
        on_layer: Callable[[int, Tensor], None] | None = None,
    ) -> Tensor:
        """Embeddings through every layer: the hidden states [B, T, dim] before the final norm."""
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        # Gather cos/sin before `cache.append`: `positions` may be a view of the cache's next positions.
        # Once per forward, shared by every layer: [B, T, 1, head_dim] (heads broadcast).
        cos, sin = rope_tables(self.rope_cos[positions].unsqueeze(2), self.rope_sin[positions].unsqueeze(2))
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        local = None
        if self.rope_local_cos is not None and self.rope_local_sin is not None:
            lc, ls = rope_tables(
                self.rope_local_cos[positions].unsqueeze(2), self.rope_local_sin[positions].unsqueeze(2)
            )
            local = lc.to(h.dtype), ls.to(h.dtype)
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
            if on_layer is not None:
                on_layer(i, h)
            if local is not None and layer.attention.local_rope:
                h = layer(h, *local, mask, cache, i, start, marks)
            else:
                h = layer(h, cos, sin, mask, cache, i, start, marks)
        return h

    # long: three closures share one shape table and one conversion cache, then fill the skeleton in model order
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
        stored = isinstance(embed, GGUFWeight)  # a GGUF's own block table: rows dequantized as tokens need them
        device = torch.device(device) if device is not None else (embed.blocks if stored else embed).device
        dtype = dtype or (torch.float32 if stored else embed.dtype)
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

        offset = cfg.arch.norm_offset

        def param(name: str) -> nn.Parameter:
            if offset and name.endswith(NORM_SUFFIX):  # Gemma's norms scale by 1 + w: fold it once, here
                return nn.Parameter(tensor(name) + offset, requires_grad=False)
            return nn.Parameter(tensor(name), requires_grad=False)

        with torch.device("meta"):
            model = cls(cfg, max_seq_len=max_seq_len)
        if stored:
            scale = cfg.dim**0.5 if cfg.arch.embed_scale else None
            model.tok_embeddings = GGUFEmbedding(_checked_table(embed, shapes["tok_embeddings.weight"]), dtype, scale)
            model.tok_embeddings.to(device=device)
        else:
            model.tok_embeddings.weight = param("tok_embeddings.weight")
        model.norm.weight = param("norm.weight")
        model.output = linear("output")
        for i, block in enumerate(model.layers):
            for rel in LINEAR_NAMES:
                parent, attr = rel.split(".")
                setattr(block.get_submodule(parent), attr, linear(f"layers.{i}.{rel}"))
            for rel in LAYER_VECTORS:
                parent, _, attr = rel.rpartition(".")
                module = block.get_submodule(parent) if parent else block
                if getattr(module, attr) is not None:
                    getattr(module, attr).weight = param(f"layers.{i}.{rel}.weight")
        model.setup_rope(device)
        return model.eval()


def _checked_table(embed: GGUFWeight, shape: tuple[int, ...]) -> GGUFWeight:
    if tuple(embed.shape) != shape:
        raise WeightError(f"tok_embeddings.weight: expected shape {shape}, got {tuple(embed.shape)}")
    return embed
