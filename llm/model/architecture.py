"""What differs between the decoder families this library runs, as data: one frozen description per
`model_type`, read by `config.py` (which fields a config.json may hold), `weights.py` (tensor names),
`model.py` (the torch reference) and `fused_decode.py` (the native pass).

Every family here is the same pre-norm decoder (RMSNorm, RoPE, GQA attention, gated MLP); a description
says only where one departs from Llama. A config field no description covers is refused by `config.py`:
a field that changes the arithmetic and is silently ignored gives wrong answers, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Activation = Literal["silu", "gelu_tanh"]

# Fields every HF config may carry that do not change a causal LM's forward pass: bookkeeping, training-time
# settings (dropout, init), generation defaults older transformers wrote into config.json, token ids (read
# by config.py itself) and other tools' metadata.
INERT_FIELDS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
        "use_cache", "initializer_range", "attention_dropout", "output_attentions", "output_hidden_states",
        "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
        "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
        "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "finetuning_task", "prefix",
        "task_specific_params", "tokenizer_class", "bos_token_id", "eos_token_id", "pad_token_id",
        "sep_token_id", "decoder_start_token_id", "max_length", "min_length", "do_sample", "early_stopping",
        "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
        "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
        "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
        "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "auto_map",
        "transformers.js_config", "cache_implementation",
    }
)  # fmt: skip

# Fields the shape and RoPE readers of config.py consume for every family.
CORE_FIELDS = frozenset(
    {
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
        "rope_theta", "rope_scaling", "rope_parameters",
    }
)  # fmt: skip


def _false(value: Any) -> bool:
    return value is None or value is False


def _one(value: Any) -> bool:
    return value is None or value == 1 or value == 1.0


@dataclass(frozen=True)
class Architecture:
    """How one decoder family departs from Llama. Everything is fixed per family except what config.py reads
    from the config itself (sizes, RoPE, windows, soft-caps, the attention scale)."""

    model_type: str
    norm_offset: float = 0.0
    """RMSNorm scales by `norm_offset + weight` (Gemma stores w - 1 and computes 1 + w)."""
    activation: Activation = "silu"
    """The gate's activation: SwiGLU (silu) or GeGLU with tanh-approximated GELU (gelu_pytorch_tanh)."""
    activation_fields: tuple[str, ...] = ("hidden_act",)
    """The config fields that name the activation; each present one must name `activation`."""
    qkv_bias: bool = False
    """q, k and v projections carry biases (Qwen2); o_proj never does here."""
    qk_norm: bool = False
    """A per-head RMSNorm (over head_dim) on q and k before RoPE (Qwen3, Gemma3)."""
    sandwich_norms: bool = False
    """Norms after the attention and around the MLP too (Gemma2/3): post_attention_layernorm is then the
    attention output's norm and pre_feedforward_layernorm the MLP input's."""
    embed_scale: bool = False
    """Embeddings are multiplied by sqrt(hidden_size), rounded to the activations' dtype (Gemma)."""
    fused_qkv: bool = False
    """The checkpoint stores q, k and v as one `qkv_proj` (Phi-3)."""
    fused_gate_up: bool = False
    """The checkpoint stores gate and up as one `gate_up_proj`, gate first (Phi-3)."""
    window_rule: Literal["none", "all", "qwen", "alternate", "pattern"] = "none"
    """Which layers slide when the config has a window and no `layer_types`: none, all (Mistral, Phi-3),
    layers from `max_window_layers` on when `use_sliding_window` (Qwen), every other one starting with the
    first (Gemma2), all but every `sliding_window_pattern`-th (Gemma3)."""
    soft_caps: bool = False
    """The config may ask for attention-score and final-logit soft-capping (Gemma2; Gemma3 allows null)."""
    attn_scalar: bool = False
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5."""
    local_rope: bool = False
    """Sliding layers rotate with their own base (Gemma3: rope_local_base_freq, or per-layer-type
    rope_parameters)."""
    fields: frozenset[str] = frozenset()
    """Fields this family reads beyond the core ones (or accepts as inert: dropouts, flags of other variants)."""
    required: dict[str, Any] = field(default_factory=dict)
    """Fields accepted only with a value this library computes: name -> predicate on the value."""
    default_tie: bool = False
    """tie_word_embeddings when the config does not say (Gemma ties by default)."""

    @property
    def known_fields(self) -> frozenset[str]:
        return INERT_FIELDS | CORE_FIELDS | self.fields | set(self.required) | set(self.activation_fields)


_LLAMA_FLAGS: dict[str, Any] = {"attention_bias": _false, "mlp_bias": _false, "pretraining_tp": lambda v: True}

ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture(
            "llama",
            # SmolLM2's nanotron export writes these two; they describe the layout Llama already has.
            fields=frozenset({"is_llama_config"}),
            required={**_LLAMA_FLAGS, "rope_interleaved": _false},
        ),
        Architecture(
            "mistral",
            window_rule="all",
            fields=frozenset({"sliding_window"}),
            required={"attention_bias": _false, "mlp_bias": _false},
        ),
        Architecture(
            "qwen2",
            qkv_bias=True,
            window_rule="qwen",
            fields=frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}),
            required={"use_mrope": _false},
        ),
        Architecture(
            "qwen3",
            qk_norm=True,
            window_rule="qwen",
            fields=frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}),
            required={"attention_bias": _false},
        ),
        Architecture(
            "gemma2",
            norm_offset=1.0,
            activation="gelu_tanh",
            activation_fields=("hidden_activation", "hidden_act"),
            sandwich_norms=True,
            embed_scale=True,
            window_rule="alternate",
            soft_caps=True,
            attn_scalar=True,
            default_tie=True,
            fields=frozenset(
                {"sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping"}
                | {"attn_logit_softcapping"}
            ),
            required={"attention_bias": _false, "use_bidirectional_attention": _false},
        ),
        Architecture(
            "gemma3_text",
            norm_offset=1.0,
            activation="gelu_tanh",
            activation_fields=("hidden_activation", "hidden_act"),
            qk_norm=True,
            sandwich_norms=True,
            embed_scale=True,
            window_rule="pattern",
            soft_caps=True,
            attn_scalar=True,
            local_rope=True,
            default_tie=True,
            fields=frozenset(
                {"sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping"}
                | {"attn_logit_softcapping", "sliding_window_pattern", "_sliding_window_pattern"}
                | {"rope_local_base_freq"}
            ),
            required={"attention_bias": _false, "use_bidirectional_attention": _false},
        ),
        Architecture(
            "phi3",
            fused_qkv=True,
            fused_gate_up=True,
            window_rule="all",
            # original_max_position_embeddings matters only to longrope scaling, which config.py refuses.
            fields=frozenset({"sliding_window", "original_max_position_embeddings"}),
            required={"resid_pdrop": lambda v: True, "embd_pdrop": lambda v: True, "partial_rotary_factor": _one},
        ),
    )
}
"""Every supported `model_type`, by name."""


def architecture(model_type: Any) -> Architecture | None:
    """The description of `model_type`, or None when it is not supported."""
    return ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None


def sliding_layers(arch: Architecture, raw: dict[str, Any], n_layers: int) -> list[bool]:
    """Which layers use the sliding window, by the family's rule (`layer_types` first, when present)."""
    types = raw.get("layer_types")
    if types is not None:
        return [t == "sliding_attention" for t in types]
    rule = arch.window_rule
    if rule == "all":
        return [True] * n_layers
    if rule == "qwen":
        start = raw.get("max_window_layers")
        start = start if isinstance(start, int) and not isinstance(start, bool) else 0
        return [bool(raw.get("use_sliding_window")) and i >= start for i in range(n_layers)]
    if rule == "alternate":
        return [i % 2 == 0 for i in range(n_layers)]
    if rule == "pattern":
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
        pattern = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0 else 6
        return [bool((i + 1) % pattern) for i in range(n_layers)]
    return [False] * n_layers
