"""The model's shape, read from an HF-format `config.json` into one typed dataclass."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama",)


class ConfigError(ValueError):
    """`config.json` is unreadable, of an unsupported model type, or inconsistent."""


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (`rope_scaling.rope_type == "llama3"`); None means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None
    model_type: str = "llama"

    def __post_init__(self) -> None:
        positive = ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.n_heads}) must be divisible by num_key_value_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE (got {self.head_dim})")

    @property
    def n_rep(self) -> int:
        """How many query heads share one KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type: unsupported {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        try:
            dim = int(raw["hidden_size"])
            n_heads = int(raw["num_attention_heads"])
            n_layers = int(raw["num_hidden_layers"])
            intermediate = int(raw["intermediate_size"])
            vocab = int(raw["vocab_size"])
        except KeyError as missing:
            raise ConfigError(f"{missing.args[0]}: required field is missing") from None
        except (TypeError, ValueError) as bad:
            raise ConfigError(f"a size field is not an integer: {bad}") from None
        if n_heads <= 0:
            raise ConfigError(f"num_attention_heads must be > 0 (got {n_heads})")
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if dim % n_heads:
                raise ConfigError(f"hidden_size ({dim}) must be divisible by num_attention_heads ({n_heads})")
            head_dim = dim // n_heads
        # transformers >= 5 writes `rope_parameters` (theta and scaling together) instead of the two fields.
        rope = raw.get("rope_parameters") or {}
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            intermediate_size=intermediate,
            vocab_size=vocab,
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope),
            norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
            model_type=model_type,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as bad:
            raise ConfigError(f"{path}: not valid JSON ({bad})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        try:
            return cls.from_hf_dict(raw)
        except ConfigError as bad:
            raise ConfigError(f"{path}: {bad}") from None


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ConfigError(f"rope_scaling.rope_type: unsupported {kind!r} (supported: llama3)")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )
