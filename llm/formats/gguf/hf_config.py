"""A GGUF's metadata and tensor table -> the HF `config.json` and tensor names of its family.

One `Family` per `general.architecture` llama.cpp writes for the families of llm/model/architecture.py, saying
only what departs from the common decoder: the config fields llama.cpp keeps under its own keys (or does
not keep, and hard-codes), the tensor names, and the two value transforms llama.cpp applied on convert:

  * Llama's q/k rows are permuted (convert_hf_to_gguf.py's `LlamaModel.permute`) so that ggml's interleaved
    RoPE matches HF's rotate_half; no other family here is permuted (Qwen2/3, Gemma2/3 and Phi-3 use ggml's
    NEOX RoPE, which is rotate_half already);
  * Gemma's RMSNorm weights are stored as `1 + w` (its converter adds 1 to every `*norm.weight`, so that
    llama.cpp's plain RMSNorm computes Gemma's `(1 + w) * x`); HF wants `w`.

Mistral has no family of its own: llama.cpp writes it as `llama` (and keeps no sliding window for it), so
it imports as the Llama it computes the same as.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...model.config import MAX_POSITIONS, ConfigError, ModelConfig
from ...model.weights import expected_hf_shapes
from .file import TensorInfo
from .metadata import GGUFMetadata, fail, shown
from .metadata import f32 as _f32

_COMMON_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the MLP's input norm there, not the attention's output's
_SANDWICH = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # gate rows first, as HF's gate_up_proj (convert_hf_to_gguf keeps it fused)
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Sane upper bounds, checked before anything is sized by them; the tensors' shapes (bounded by the file's
# size) are then checked against every one.
_MAX_LAYERS = 4096
_MAX_WIDTH = 1 << 20
_MAX_HEADS = 1 << 12
_MAX_VOCAB = 1 << 24
# ggml types that hold float weights gguf-py dequantizes (integer tensors are no weight)
WEIGHT_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    | {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"}
    | {"MXFP4", "NVFP4"}
)
# config.json field -> the GGUF key it came from, so a value config.py refuses is reported by its key
_CONFIG_KEYS = {
    "num_hidden_layers": "{a}.block_count",
    "hidden_size": "{a}.embedding_length",
    "num_attention_heads": "{a}.attention.head_count",
    "num_key_value_heads": "{a}.attention.head_count_kv",
    "head_dim": "{a}.attention.key_length",
    "intermediate_size": "{a}.feed_forward_length",
    "vocab_size": "{a}.vocab_size",
    "rope_theta": "{a}.rope.freq_base",
    "rms_norm_eps": "{a}.attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "{a}.context_length",
    "sliding_window": "{a}.attention.sliding_window",
    "attn_logit_softcapping": "{a}.attn_logit_softcapping",
    "final_logit_softcapping": "{a}.final_logit_softcapping",
    "rope_scaling.factor": "{a}.rope.scaling.factor",
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
}

Extras = Callable[[GGUFMetadata, str, dict[str, Any]], dict[str, Any]]


def _no_extras(meta: GGUFMetadata, a: str, config: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    gguf_arch: str
    model_type: str
    hf_class: str
    layer_tensors: dict[str, str]
    """GGUF short name (blk.N.<name>.weight) -> HF module under model.layers.N."""
    act_field: str = "hidden_act"
    activation: str = "silu"
    biases: frozenset[str] = frozenset()
    """GGUF short names that also carry a `.bias` (Qwen2's q/k/v)."""
    permute_qk: bool = False
    norm_shift: float = 0.0
    extras: Extras = _no_extras
    fixed: dict[str, Any] = field(default_factory=dict)
    """Config fields with one value for every file of the family."""


def _attn_scalar(meta: GGUFMetadata, a: str, config: dict[str, Any], big_layers: int) -> float:
    # llama.cpp keeps no query_pre_attn_scalar: it scales by head_dim ** -0.5, except for the 27B model
    # (told apart by its layer count), scaled by (hidden / heads) ** -0.5, which is that model's HF value.
    if config["num_hidden_layers"] == big_layers:
        return config["hidden_size"] / config["num_attention_heads"]
    return config["head_dim"]


def _gemma2(meta: GGUFMetadata, a: str, config: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's defaults where a file lacks the key (they are Gemma 2's HF values too)
    return {
        "query_pre_attn_scalar": _attn_scalar(meta, a, config, big_layers=46),
        "sliding_window": meta.integer(f"{a}.attention.sliding_window", 4096, low=1, high=MAX_POSITIONS),
        "attn_logit_softcapping": meta.number(f"{a}.attn_logit_softcapping", 50.0),
        "final_logit_softcapping": meta.number(f"{a}.final_logit_softcapping", 30.0),
    }


def _gemma3(meta: GGUFMetadata, a: str, config: dict[str, Any]) -> dict[str, Any]:
    extras: dict[str, Any] = {
        "query_pre_attn_scalar": _attn_scalar(meta, a, config, big_layers=62),
        "sliding_window": meta.integer(f"{a}.attention.sliding_window", 4096, low=1, high=MAX_POSITIONS),
        # llama.cpp hard-codes both for gemma3: five sliding layers then one global, local RoPE base 10000
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
    }
    pattern = meta.get(f"{a}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer files: per layer, True where the layer slides
        if len(pattern) != config["num_hidden_layers"] or not all(isinstance(p, bool) for p in pattern):
            raise fail(meta.path, f"metadata {a}.attention.sliding_window_pattern: expected one bool per layer")
        del extras["sliding_window_pattern"]
        extras["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern is not None:
        extras["sliding_window_pattern"] = meta.integer(f"{a}.attention.sliding_window_pattern", low=1, high=4096)
    # Gemma 3 has no soft-caps (null in its config.json); the converter writes a key only where one is set.
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"{a}.{key}" in meta:
            extras[key] = meta.number(f"{a}.{key}")
    return extras


def _phi3(meta: GGUFMetadata, a: str, config: dict[str, Any]) -> dict[str, Any]:
    window = meta.integer(f"{a}.attention.sliding_window", None, low=1, high=MAX_POSITIONS)
    return {} if window is None else {"sliding_window": window}


_GEMMA_LAYER = {**_COMMON_LAYER, **_SANDWICH}
FAMILIES: dict[str, Family] = {
    f.gguf_arch: f
    for f in (
        Family(
            "llama",
            "llama",
            "LlamaForCausalLM",
            _COMMON_LAYER,
            permute_qk=True,
            fixed={"attention_bias": False, "mlp_bias": False},
        ),
        Family(
            "qwen2",
            "qwen2",
            "Qwen2ForCausalLM",
            _COMMON_LAYER,
            biases=frozenset({"attn_q", "attn_k", "attn_v"}),
            # llama.cpp keeps no window for Qwen2 and attends over everything, as HF does by default
            fixed={"use_sliding_window": False},
        ),
        Family("qwen3", "qwen3", "Qwen3ForCausalLM", {**_COMMON_LAYER, **_QK_NORM}, fixed={"attention_bias": False}),
        Family(
            "gemma2",
            "gemma2",
            "Gemma2ForCausalLM",
            _GEMMA_LAYER,
            act_field="hidden_activation",
            activation="gelu_pytorch_tanh",
            norm_shift=1.0,
            extras=_gemma2,
            fixed={"attention_bias": False},
        ),
        Family(
            "gemma3",
            "gemma3_text",
            "Gemma3ForCausalLM",
            {**_GEMMA_LAYER, **_QK_NORM},
            act_field="hidden_activation",
            activation="gelu_pytorch_tanh",
            norm_shift=1.0,
            extras=_gemma3,
            fixed={"attention_bias": False},
        ),
        Family("phi3", "phi3", "Phi3ForCausalLM", _PHI3_LAYER, extras=_phi3),
    )
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def family_of(meta: GGUFMetadata) -> Family:
    arch = meta.get("general.architecture")
    family = FAMILIES.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise fail(meta.path, f"unsupported architecture {shown(arch)} (supported: {', '.join(FAMILIES)})")
    return family


def hf_config(meta: GGUFMetadata, family: Family, tensors: dict[str, TensorInfo]) -> dict[str, Any]:
    """config.json for the file, checked by the same rules config.json is read by (reported by GGUF key)."""
    path, a = meta.path, family.gguf_arch
    hidden = meta.integer(f"{a}.embedding_length", low=1, high=_MAX_WIDTH)
    n_heads = meta.integer(f"{a}.attention.head_count", low=1, high=_MAX_HEADS)
    if isinstance(meta.get(f"{a}.attention.head_count_kv"), list):  # per-layer counts (some hybrids)
        raise fail(path, "per-layer attention.head_count_kv is not supported")
    n_kv = meta.integer(f"{a}.attention.head_count_kv", n_heads, low=1, high=n_heads)
    n_layers = meta.integer(f"{a}.block_count", low=1, high=_MAX_LAYERS)
    # A block_count the tensor table cannot hold is refused before anything is sized by it (a huge one once
    # built a set of names per layer and ran out of memory).
    per_layer = len(family.layer_tensors)
    if n_layers * per_layer > len(tensors):
        raise fail(
            path,
            f"metadata {a}.block_count {n_layers} needs {n_layers * per_layer} layer tensors, "
            f"but the file holds {len(tensors)} tensors",
        )
    head_dim = _head_dim(meta, a, hidden, n_heads)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise fail(path, "tensor token_embd.weight is missing")
    # ggml order: dims[-1] is the row count
    vocab = meta.integer(f"{a}.vocab_size", None, low=1, high=_MAX_VOCAB) or embd.dims[-1]
    # Generation stops at EOS, and at end-of-turn/-message tokens where the file names distinct ones.
    eos = [meta.integer(f"tokenizer.ggml.{key}", None) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos_ids = list(dict.fromkeys(i for i in eos if i is not None))
    config: dict[str, Any] = {
        "architectures": [family.hf_class],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "intermediate_size": meta.integer(f"{a}.feed_forward_length", low=1, high=_MAX_WIDTH * 8),
        "vocab_size": vocab,
        "rope_theta": meta.number(f"{a}.rope.freq_base", 10000.0),
        "rms_norm_eps": meta.number(f"{a}.attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": meta.integer(f"{a}.context_length", 2048, low=1, high=MAX_POSITIONS),
        "tie_word_embeddings": "output.weight" not in tensors,
        family.act_field: family.activation,
        **family.fixed,
        "bos_token_id": meta.integer("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": meta.integer("tokenizer.ggml.padding_token_id", None),
        "torch_dtype": "float32",
    }
    scaling = _rope_scaling(meta, a, tensors)
    if scaling is not None:
        config["rope_scaling"] = scaling
    config |= family.extras(meta, a, config)
    _check_config(path, a, config)
    # float32 in the file: written as its shortest repr, once the value is known to be in range
    config["rope_theta"], config["rms_norm_eps"] = _f32(config["rope_theta"]), _f32(config["rms_norm_eps"])
    return config


def _head_dim(meta: GGUFMetadata, a: str, hidden: int, n_heads: int) -> int:
    """The attention heads' width: key_length, else hidden / heads; values as wide and RoPE over all of it."""
    path = meta.path
    head_dim = meta.integer(f"{a}.attention.key_length", None, low=1, high=_MAX_WIDTH)
    if head_dim is None:
        if hidden % n_heads:
            raise fail(path, f"embedding_length {hidden} is not divisible by head_count {n_heads}")
        head_dim = hidden // n_heads
    value_dim = meta.integer(f"{a}.attention.value_length", head_dim, low=1, high=_MAX_WIDTH)
    if value_dim != head_dim:
        raise fail(path, f"attention.value_length {value_dim} != key_length {head_dim} is not supported")
    rope_dim = meta.integer(f"{a}.rope.dimension_count", None, low=1, high=_MAX_WIDTH) or head_dim
    if rope_dim != head_dim:
        raise fail(path, f"partial RoPE (rope.dimension_count {rope_dim} != head_dim {head_dim}) is unsupported")
    return head_dim


def _check_config(path: Path, a: str, config: dict[str, Any]) -> None:
    """config.json's own rules over the built config; a failure names the GGUF key the field came from."""
    try:
        ModelConfig.from_hf_dict(config)
    except ConfigError as bad:
        key = _CONFIG_KEYS.get(bad.field or "")
        where = f"metadata {key.format(a=a)}" if key else "metadata"
        raise fail(path, f"{where}: {bad}") from None


def _rope_scaling(meta: GGUFMetadata, a: str, tensors: dict[str, TensorInfo]) -> dict[str, Any] | None:
    """Linear scaling is the one kind llama.cpp keeps as plain keys that config.py computes; llama3's and
    longrope's per-frequency factors (rope_freqs / rope_factors_* tensors) and YaRN are refused."""
    kind = meta.text(f"{a}.rope.scaling.type")
    factor_tensors = sorted(n for n in tensors if n == "rope_freqs.weight" or n.startswith("rope_factors"))
    if factor_tensors or kind not in (None, "none", "linear"):
        raise fail(meta.path, f"RoPE scaling ({shown(kind) if kind else factor_tensors[0]}) is not supported yet")
    if kind != "linear":
        return None
    factor = meta.number(f"{a}.rope.scaling.factor")
    return None if factor == 1.0 else {"rope_type": "linear", "factor": _f32(factor)}


@dataclass(frozen=True)
class Planned:
    """One GGUF tensor: its HF name and shape, and what undoes llama.cpp's convert on its values."""

    gguf_name: str
    hf_name: str
    hf_shape: tuple[int, ...]
    type_name: str
    unpermute_heads: int | None = None
    """q/k of a Llama: the head count whose RoPE row permutation to undo."""
    norm_shift: float = 0.0
    """Subtracted from the values (Gemma's norms are stored as 1 + w)."""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.hf_shape)) * 4


def plan_tensors(family: Family, tensors: dict[str, TensorInfo], config: dict[str, Any], path: Path) -> list[Planned]:
    """Map every GGUF tensor to its HF name and shape; refuse unknown, missing or misshapen ones."""
    n_layers = config["num_hidden_layers"]
    planned: list[Planned] = []
    for name, tensor in tensors.items():
        unpermute: int | None = None
        if name in GLOBAL_TENSORS:
            hf_name, kind = GLOBAL_TENSORS[name], name.removesuffix(".weight")
        elif (match := _LAYER_NAME.match(name)) and match.group(2) in family.layer_tensors:
            layer, kind, suffix = int(match.group(1)), match.group(2), match.group(3)
            if suffix == "bias" and kind not in family.biases:
                raise fail(path, f"unexpected tensor {name} for a {family.gguf_arch} model")
            if layer >= n_layers:
                raise fail(path, f"tensor {name} is beyond block_count {n_layers}")
            hf_name = f"model.layers.{layer}.{family.layer_tensors[kind]}.{suffix}"
            if family.permute_qk and suffix == "weight" and kind in ("attn_q", "attn_k"):
                unpermute = config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
        else:
            raise fail(path, f"unexpected tensor {name} for a {family.gguf_arch} model")
        shift = family.norm_shift if name.endswith("norm.weight") else 0.0
        planned.append(Planned(name, hf_name, tensor.shape, tensor.type_name, unpermute, shift))
    cfg = ModelConfig.from_hf_dict(config)
    expected = expected_hf_shapes(cfg)
    have = {p.hf_name for p in planned}
    if missing := sorted(set(expected) - have, key=_hf_order_key):
        raise fail(path, f"{len(missing)} tensor(s) missing, e.g. {missing[0]}")
    for p in planned:
        want = expected.get(p.hf_name)
        if want is None:  # lm_head of a model whose config ties it cannot happen: tie follows output.weight
            raise fail(path, f"unexpected tensor {p.gguf_name} for a {family.gguf_arch} model")
        if p.hf_shape != want:
            raise fail(path, f"tensor {p.gguf_name} has shape {p.hf_shape}, expected {want}")
        if p.type_name not in WEIGHT_TYPES:
            raise fail(path, f"tensor {p.gguf_name}: type {p.type_name} is not a weight type this importer reads")
    return sorted(planned, key=lambda p: _hf_order_key(p.hf_name))


def _hf_order_key(hf_name: str) -> tuple[int, str]:
    if hf_name == "model.embed_tokens.weight":
        return (-1, hf_name)
    match = re.match(r"model\.layers\.(\d+)\.", hf_name)
    return (int(match.group(1)), hf_name) if match else (1 << 30, hf_name)
