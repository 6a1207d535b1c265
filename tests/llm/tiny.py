"""A tiny random Llama checkpoint in HF format, the reference for every `llm/` equivalence test."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

    from llmplan.llm.model import Transformer

LLAMA3_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
"""A llama3 scaling whose original context (32) is short enough that tiny tests hit all three bands."""


def make_tiny_llama(
    tmp_path: Path,
    *,
    n_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 256,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    max_shard_size: str | int | None = None,
    seed: int = 0,
) -> tuple[Path, LlamaForCausalLM]:
    """Save a random fp32 LlamaForCausalLM (safetensors + config.json) under `tmp_path`; return (dir, model).

    The init range is wide (0.25, not HF's 0.02) so that next-token distributions are peaked: with
    near-uniform logits greedy and beam choices hinge on 1e-7 ties and equivalence tests get flaky.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling is not None:
        rope = {"rope_theta": 10000.0, **rope_scaling}
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        rope_parameters=rope,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # Norm weights init to ones; perturb them so a mis-mapped norm cannot pass unnoticed.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    out = Path(tmp_path) / f"tiny-llama-{seed}"
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    return out, model


def load_tiny(path: Path, **from_weights: Any) -> Transformer:
    """Our Transformer from a `make_tiny_llama` directory (all shards), via fuse_hf_state_dict."""
    from safetensors.torch import load_file

    from llmplan.llm.model import ModelConfig, Transformer
    from llmplan.llm.model.weights import fuse_hf_state_dict

    cfg = ModelConfig.from_file(Path(path) / "config.json")
    sd: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        sd |= load_file(shard)
    return Transformer.from_weights(cfg, fuse_hf_state_dict(sd, cfg, strict=True), **from_weights)
