"""Tiny random checkpoints of every supported family, made by transformers itself (its own *Config, its own
model class, `save_pretrained` in several safetensors shards): the references of tests/llm/test_architectures.py.

Each exercises what its family departs from Llama with: GQA everywhere, a sliding window (16) shorter than
the tests' 64-token prompt wherever the family has one, q/k/v biases, q/k norms, Gemma's soft-caps, scale and
local RoPE base, Phi-3's fused tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

WINDOW = 16
COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.25,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen2: q/k/v biases; its optional sliding window on the layers from max_window_layers on.
    "qwen2": (
        "Qwen2",
        {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    # Qwen3: per-head q/k RMSNorm, an explicit head_dim unlike hidden / heads.
    "qwen3": ("Qwen3", {"num_hidden_layers": 2, "head_dim": 32, "tie_word_embeddings": True}),
    # Mistral: every layer slides.
    "mistral": ("Mistral", {"num_hidden_layers": 2, "sliding_window": WINDOW}),
    # Gemma 2: 1 + w norms, four norms a layer, GeGLU, sqrt(d) embeddings, every other layer slides,
    # scores and logits soft-capped (caps small enough to bite on these logits), query_pre_attn_scalar.
    "gemma2": (
        "Gemma2",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 8.0,
        },
    ),
    # Gemma 3: Gemma 2's layer plus q/k norms, a local RoPE base on the sliding layers, linear scaling of
    # the global ones, no soft-caps.
    "gemma3_text": (
        "Gemma3Text",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
            },
        },
    ),
    # Phi-3: qkv_proj and gate_up_proj stored fused; every layer slides.
    "phi3": ("Phi3", {"num_hidden_layers": 2, "sliding_window": WINDOW}),
}


def make_tiny(tmp_path: Path, family: str, seed: int = 0, **changes: Any) -> tuple[Path, Any]:
    """Save a random fp32 model of `family` in 3+ safetensors shards; return (dir, the transformers model).
    changes: config fields over the family's (a vocab_size that fits a test's tokenizer).

    Norm weights and biases start at 1 / 0 (Gemma's norms at 0, i.e. scale 1): they are perturbed so a
    mis-mapped one cannot pass unnoticed."""
    import transformers

    prefix, fields = FAMILIES[family]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    config = config_cls(**{**COMMON, **fields, **changes})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.3)
    out = Path(tmp_path) / f"tiny-{family}-{seed}"
    model.save_pretrained(out, max_shard_size="100KB")
    return out, model
