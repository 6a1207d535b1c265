"""HF state dict -> this library's fused parameter names, with shape checks, for every family of
llm/model/architecture.py.

q/k/v are concatenated into one `wqkv` and gate/up into one `w13`: two matmuls fewer per layer, which
matters most where per-call overhead dominates (small layers, CPU, decode with batch 1). Phi-3 stores them
fused already; Qwen2's q/k/v biases are concatenated the same way into `wqkv_bias`.

Internal names all end in `.weight` (one tensor per module, as the converted-checkpoint format stores them):
besides the Llama ones, `attention.wqkv_bias.weight` (Qwen2), `attention.q_norm.weight` and
`attention.k_norm.weight` (Qwen3, Gemma 3: [head_dim]), `post_attention_norm.weight` and
`post_ffn_norm.weight` (Gemma 2/3's extra norms).
"""

from __future__ import annotations

import re
import warnings

import torch
from torch import Tensor

from .config import ModelConfig

# Buffers some older checkpoints carry that the model recomputes itself; never worth a warning.
_IGNORABLE = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


class WeightError(ValueError):
    """A tensor is missing, unexpected (in strict mode) or of the wrong shape."""


def _hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model needs, with its expected shape."""
    internal = internal_shapes(cfg)
    shapes: dict[str, tuple[int, ...]] = {}
    for ours, parts in fusion_table(cfg).items():
        if ours == "output.weight" and cfg.tie_word_embeddings:
            continue
        if len(parts) == 1:
            shapes[parts[0]] = internal[ours]
            continue
        for part, rows in zip(parts, _part_rows(cfg, ours), strict=True):
            shapes[part] = (rows, *internal[ours][1:])
    return shapes


def _part_rows(cfg: ModelConfig, internal: str) -> tuple[int, ...]:
    """The rows each HF part contributes to a fused internal tensor (q, k, v; gate, up)."""
    if internal.endswith(".feed_forward.w13.weight"):
        return (cfg.intermediate_size, cfg.intermediate_size)
    return (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim)


# What a weight may be stored as; anything else (I32, U8, F8…) is not a weight this loader converts.
FLOAT_STORAGE = frozenset({"F32", "F16", "BF16"})
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layout_problems(tensors: dict[str, tuple[str, tuple[int, ...]]], cfg: ModelConfig) -> list[str]:
    """Compare (dtype, shape) per tensor, as a checkpoint declares them, with the layout `cfg` expects.

    Returns one message per problem (the caller adds the file): a weight stored as a non-float dtype,
    a weight of the wrong shape, or a layer the config does not have (num_hidden_layers too small:
    the extra layer would be skipped silently and the answers would change).
    """
    shapes = _hf_shapes(cfg)
    problems = []
    for name, (dtype, shape) in tensors.items():
        expected = shapes.get(name)
        if expected is None:
            layer = _LAYER.match(name)
            if layer and int(layer.group(1)) >= cfg.n_layers and not _IGNORABLE.match(name):
                problems.append(
                    f"tensor {name!r} belongs to layer {layer.group(1)}, but config.json has "
                    f"num_hidden_layers {cfg.n_layers} (config and weights disagree)"
                )
            continue
        if dtype not in FLOAT_STORAGE:
            problems.append(f"tensor {name!r}: dtype {dtype}, expected a float weight (F32, F16 or BF16)")
        elif tuple(shape) != expected:
            problems.append(f"tensor {name!r}: shape {list(shape)}, expected {list(expected)} from config.json")
    return problems


def expected_hf_names(cfg: ModelConfig) -> set[str]:
    """The HF tensor names a checkpoint for `cfg` must contain (no `lm_head` when embeddings are tied)."""
    return set(_hf_shapes(cfg))


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensor names a checkpoint for `cfg` must contain, each with its shape (for importers)."""
    return _hf_shapes(cfg)


def unused_hf_names(sd: dict[str, Tensor], cfg: ModelConfig) -> list[str]:
    """Names in `sd` the model does not use (a tied checkpoint's `lm_head.weight` counts as unused)."""
    wanted = expected_hf_names(cfg)
    return sorted(name for name in sd if name not in wanted and not _IGNORABLE.match(name))


def check_hf_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> None:
    """Raise WeightError for the first missing tensor or shape mismatch (all missing names are listed)."""
    shapes = _hf_shapes(cfg)
    missing = sorted(name for name in shapes if name not in sd)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightError(f"missing tensors: {', '.join(missing[:5])}{more}")
    for name, shape in shapes.items():
        got = tuple(sd[name].shape)
        if got != shape:
            raise WeightError(f"{name}: expected shape {shape}, got {got}")


def fuse_hf_state_dict(sd: dict[str, Tensor], cfg: ModelConfig, *, strict: bool = False) -> dict[str, Tensor]:
    """Map HF names to internal ones, fusing q/k/v -> `wqkv` and gate/up -> `w13`.

    Unused names raise WeightError when `strict`, else are reported in one `UserWarning`; they are never
    dropped silently. Tied models get `output.weight` as the very same tensor as `tok_embeddings.weight`.
    Fusion concatenates, so the fused tensors are new allocations; the caller may drop `sd` afterwards.
    """
    check_hf_state_dict(sd, cfg)
    unused = unused_hf_names(sd, cfg)
    if unused:
        message = f"{len(unused)} checkpoint tensors are not used by the model: {', '.join(unused[:10])}"
        if strict:
            raise WeightError(message)
        warnings.warn(message, stacklevel=2)
    out: dict[str, Tensor] = {}
    for internal, parts in fusion_table(cfg).items():
        if internal == "output.weight" and cfg.tie_word_embeddings:
            out[internal] = out["tok_embeddings.weight"]  # the very same tensor
        else:
            out[internal] = sd[parts[0]] if len(parts) == 1 else torch.cat([sd[p] for p in parts], dim=0)
    return out


def fusion_table(cfg: ModelConfig) -> dict[str, list[str]]:
    """Internal name -> the HF tensors concatenated (dim 0) to make it, in model order.

    The one statement of the HF -> internal mapping: `fuse_hf_state_dict` uses it on a whole state dict,
    the streaming loader (stages/load_convert.py) group by group as tensors arrive.
    """
    arch = cfg.arch
    table = {
        "tok_embeddings.weight": ["model.embed_tokens.weight"],
        "norm.weight": ["model.norm.weight"],
        "output.weight": ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        attn, mlp = f"{hf}.self_attn", f"{hf}.mlp"
        qkv = [f"{attn}.qkv_proj.weight"] if arch.fused_qkv else [f"{attn}.{p}_proj.weight" for p in "qkv"]
        gate_up = (
            [f"{mlp}.gate_up_proj.weight"] if arch.fused_gate_up else [f"{mlp}.{p}_proj.weight" for p in ("gate", "up")]
        )
        table |= {
            f"{ours}.attention.wqkv.weight": qkv,
            f"{ours}.attention.wo.weight": [f"{attn}.o_proj.weight"],
            f"{ours}.feed_forward.w13.weight": gate_up,
            f"{ours}.feed_forward.w2.weight": [f"{mlp}.down_proj.weight"],
            f"{ours}.attention_norm.weight": [f"{hf}.input_layernorm.weight"],
        }
        if arch.sandwich_norms:  # Gemma: post_attention_layernorm normalizes the attention's output
            table |= {
                f"{ours}.post_attention_norm.weight": [f"{hf}.post_attention_layernorm.weight"],
                f"{ours}.ffn_norm.weight": [f"{hf}.pre_feedforward_layernorm.weight"],
                f"{ours}.post_ffn_norm.weight": [f"{hf}.post_feedforward_layernorm.weight"],
            }
        else:
            table[f"{ours}.ffn_norm.weight"] = [f"{hf}.post_attention_layernorm.weight"]
        if arch.qkv_bias:
            table[f"{ours}.attention.wqkv_bias.weight"] = [f"{attn}.{p}_proj.bias" for p in "qkv"]
        if arch.qk_norm:
            table[f"{ours}.attention.q_norm.weight"] = [f"{attn}.q_norm.weight"]
            table[f"{ours}.attention.k_norm.weight"] = [f"{attn}.k_norm.weight"]
    return table


def internal_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every internal (fused) name, for loaders that build weights another way (GGUF)."""
    arch = cfg.arch
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (cfg.vocab_size, cfg.dim),
        "norm.weight": (cfg.dim,),
        "output.weight": (cfg.vocab_size, cfg.dim),
    }
    for i in range(cfg.n_layers):
        p = f"layers.{i}"
        shapes |= {
            f"{p}.attention.wqkv.weight": (q_out + 2 * kv_out, cfg.dim),
            f"{p}.attention.wo.weight": (cfg.dim, q_out),
            f"{p}.feed_forward.w13.weight": (2 * cfg.intermediate_size, cfg.dim),
            f"{p}.feed_forward.w2.weight": (cfg.dim, cfg.intermediate_size),
            f"{p}.attention_norm.weight": (cfg.dim,),
            f"{p}.ffn_norm.weight": (cfg.dim,),
        }
        if arch.sandwich_norms:
            shapes |= {f"{p}.post_attention_norm.weight": (cfg.dim,), f"{p}.post_ffn_norm.weight": (cfg.dim,)}
        if arch.qkv_bias:
            shapes[f"{p}.attention.wqkv_bias.weight"] = (q_out + 2 * kv_out,)
        if arch.qk_norm:
            shapes |= {f"{p}.attention.q_norm.weight": (cfg.head_dim,), f"{p}.attention.k_norm.weight": (cfg.head_dim,)}
    return shapes


NORM_SUFFIX = "norm.weight"
"""Every RMSNorm's internal name ends so (attention_norm, ffn_norm, q_norm, post_ffn_norm, norm...): the ones
an architecture's `norm_offset` applies to."""
