"""config.json into ModelConfig: every field read, and unsupported or inconsistent configs refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmplan.llm.model import ConfigError, ModelConfig

BASE = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": [2, 5],
}


def write(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, **changes}), encoding="utf-8")
    return path


def test_every_field_is_read(tmp_path: Path) -> None:
    cfg = ModelConfig.from_file(write(tmp_path))
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (1536, 49152, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 5) and cfg.n_rep == 3
    assert cfg.rope_scaling is None


def test_llama3_rope_scaling(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = ModelConfig.from_file(write(tmp_path, rope_scaling=scaling))
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "gpt2"}, "model_type: unsupported 'gpt2' (supported: llama, mistral"),
        ({"hidden_size": 577}, "hidden_size (577) must be divisible by num_attention_heads (9)"),
        ({"num_key_value_heads": 4}, "num_attention_heads (9) must be divisible by num_key_value_heads (4)"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be > 0 (got 0)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling.rope_type: unsupported 'yarn'"),
    ],
)
def test_bad_configs_are_refused_with_the_field(tmp_path: Path, changes: dict, message: str) -> None:  # type: ignore[type-arg]
    path = write(tmp_path, **changes)
    with pytest.raises(ConfigError) as caught:
        ModelConfig.from_file(path)
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)


def test_missing_field_and_broken_json(tmp_path: Path) -> None:
    raw = dict(BASE)
    del raw["vocab_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(ConfigError, match="vocab_size: required field is missing"):
        ModelConfig.from_file(path)
    path.write_text("{", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(path)
    with pytest.raises(ConfigError, match="file not found"):
        ModelConfig.from_file(tmp_path / "nope.json")
