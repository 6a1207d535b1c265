"""The model's shape, read from an HF-format `config.json` into one typed dataclass."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .files import FileProblem, read_json_limited

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
        dim = _int(raw, "hidden_size")
        n_heads = _int(raw, "num_attention_heads")
        n_layers = _int(raw, "num_hidden_layers")
        intermediate = _int(raw, "intermediate_size")
        vocab = _int(raw, "vocab_size")
        if n_heads <= 0:
            raise ConfigError(f"num_attention_heads must be > 0 (got {n_heads})")
        head_dim = _int(raw, "head_dim", None)
        if head_dim is None:
            if dim % n_heads:
                raise ConfigError(f"hidden_size ({dim}) must be divisible by num_attention_heads ({n_heads})")
            head_dim = dim // n_heads
        # transformers >= 5 writes `rope_parameters` (theta and scaling together) instead of the two fields.
        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters: expected an object, got {_shown(rope)}")
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos_ids = tuple(_int({"eos_token_id": e}, "eos_token_id") for e in eos)
        else:
            eos_ids = () if eos is None else (_int(raw, "eos_token_id"),)
        theta = _number(raw, "rope_theta", None)
        return cls(
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=_int(raw, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            vocab_size=vocab,
            rope_theta=theta if theta is not None else _number(rope, "rope_theta", 10000.0, "rope_parameters."),
            rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope),
            norm_eps=_number(raw, "rms_norm_eps", 1e-5),
            max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
            bos_token_id=_int(raw, "bos_token_id", None),
            eos_token_ids=eos_ids,
            pad_token_id=_int(raw, "pad_token_id", None),
            model_type=model_type,
        )

    def parameter_count(self) -> int:
        """Weights the model holds (embeddings, head unless tied, every layer's projections and norms)."""
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = self.dim * (q_out + 2 * kv_out) + q_out * self.dim + 3 * self.dim * self.intermediate_size
        per_layer += 2 * self.dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + head + self.dim + self.n_layers * per_layer

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = read_json_limited(path, 16 << 20)
        except FileProblem as bad:
            raise ConfigError(str(bad)) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        try:
            return cls.from_hf_dict(raw)
        except ConfigError as bad:
            raise ConfigError(f"{path}: {bad}") from None


_MISSING: Any = object()


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(raw: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    """An integer field: JSON ints only (no bools, strings or floats), else a message naming the field."""
    value = raw.get(key, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise ConfigError(f"{key}: required field is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {_shown(value)}")
    return value


def _number(raw: dict[str, Any], key: str, default: Any, prefix: str = "") -> Any:
    value = raw.get(key)
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"{prefix}{key}: required field is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ConfigError(f"{prefix}{key}: expected a number, got {_shown(value)}")
    return float(value)


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {_shown(value)}")
    return value


def _rope_scaling(raw: Any) -> RopeScaling | None:
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"rope_scaling: expected an object, got {_shown(raw)}")
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ConfigError(f"rope_scaling.rope_type: unsupported {kind!r} (supported: llama3)")
    try:
        return RopeScaling(
            factor=_number(raw, "factor", _MISSING, "rope_scaling."),
            low_freq_factor=_number(raw, "low_freq_factor", _MISSING, "rope_scaling."),
            high_freq_factor=_number(raw, "high_freq_factor", _MISSING, "rope_scaling."),
            original_max_position_embeddings=_int(raw, "original_max_position_embeddings"),
        )
    except ConfigError as bad:
        raise ConfigError(f"rope_scaling.{bad}".replace("rope_scaling.rope_scaling.", "rope_scaling.")) from None
