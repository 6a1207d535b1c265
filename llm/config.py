"""The model's shape, read from an HF-format `config.json` into one typed dataclass."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .files import FileProblem, read_json_limited

SUPPORTED_MODEL_TYPES = ("llama",)

# Ranges a value must lie in to describe a model this library can run. Sizes have no fixed upper bound
# here: `load.config` refuses a model whose weights cannot fit in memory, which is the real limit.
# rope_theta: real models use 1e4 to ~4e9; 1e300 (or inf) rotates nothing but the first pair of dims.
ROPE_THETA_RANGE = (1.0, 1e12)
# rms_norm_eps: real models use 1e-6 to 1e-5; 1e10 (or inf) swamps every activation.
NORM_EPS_RANGE = (0.0, 0.1)
MAX_POSITIONS = 1 << 24

# The HF field behind each of ModelConfig's names, so every message names what the user can fix.
HF_FIELDS = {
    "n_layers": "num_hidden_layers",
    "dim": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
}


class ConfigError(ValueError):
    """`config.json` is unreadable, of an unsupported model type, or inconsistent; `field` names the field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (`rope_scaling.rope_type == "llama3"`); None means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def check(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _in_range(f"rope_scaling.{name}", getattr(self, name), 0.0, 1e6, low_open=True)
        if self.high_freq_factor <= self.low_freq_factor:  # the llama3 formula divides by their difference
            raise ConfigError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must be above low_freq_factor "
                f"({self.low_freq_factor})",
                "rope_scaling.high_freq_factor",
            )
        if not 1 <= self.original_max_position_embeddings <= MAX_POSITIONS:
            raise ConfigError(
                f"rope_scaling.original_max_position_embeddings must be from 1 to {MAX_POSITIONS} "
                f"(got {_shown(self.original_max_position_embeddings)})",
                "rope_scaling.original_max_position_embeddings",
            )


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
        for name, hf in HF_FIELDS.items():
            if getattr(self, name) <= 0:
                raise ConfigError(f"{hf} must be > 0 (got {getattr(self, name)})", hf)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.n_heads}) must be divisible by num_key_value_heads ({self.n_kv_heads})",
                "num_key_value_heads",
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE (got {self.head_dim})", "head_dim")
        _in_range("rope_theta", self.rope_theta, *ROPE_THETA_RANGE, low_open=True)
        _in_range("rms_norm_eps", self.norm_eps, *NORM_EPS_RANGE, low_open=True)
        if not 1 <= self.max_position_embeddings <= MAX_POSITIONS:
            got = _shown(self.max_position_embeddings)
            raise ConfigError(
                f"max_position_embeddings must be from 1 to {MAX_POSITIONS} (got {got})", "max_position_embeddings"
            )
        for name, ids in (("bos_token_id", (self.bos_token_id,)), ("eos_token_id", self.eos_token_ids)):
            for token in ids:
                if token is not None and not 0 <= token < self.vocab_size:
                    raise ConfigError(
                        f"{name} {_shown(token)} is outside the vocabulary (vocab_size {self.vocab_size})", name
                    )
        if self.rope_scaling is not None:
            self.rope_scaling.check()

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
            raise ConfigError(f"num_attention_heads must be > 0 (got {n_heads})", "num_attention_heads")
        head_dim = _int(raw, "head_dim", None)
        if head_dim is None:
            if dim % n_heads:
                raise ConfigError(
                    f"hidden_size ({dim}) must be divisible by num_attention_heads ({n_heads})", "hidden_size"
                )
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
            raise ConfigError(f"{path}: {bad}", bad.field) from None


_MISSING: Any = object()


def _in_range(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    """A finite number in [low, high] (or (low, high] when `low_open`), else a message naming the field."""
    above = value > low if low_open else value >= low
    if not (math.isfinite(value) and above and value <= high):
        bound = f"above {low:g}" if low_open else f"at least {low:g}"
        raise ConfigError(f"{name} must be a finite number {bound} and at most {high:g} (got {_shown(value)})", name)


def _shown(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 128:  # repr of a 5000-digit integer raises
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(raw: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    """An integer field: JSON ints only (no bools, strings or floats), else a message naming the field."""
    value = raw.get(key, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise ConfigError(f"{key}: required field is missing", key)
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {_shown(value)}", key)
    return value


def _number(raw: dict[str, Any], key: str, default: Any, prefix: str = "") -> Any:
    value = raw.get(key)
    if value is None:
        if default is _MISSING:
            raise ConfigError(f"{prefix}{key}: required field is missing", prefix + key)
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ConfigError(f"{prefix}{key}: expected a number, got {_shown(value)}", prefix + key)
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float (e.g. 10**400)
        raise ConfigError(f"{prefix}{key}: {_shown(value)} is out of range", prefix + key) from None
    if not math.isfinite(number):
        raise ConfigError(f"{prefix}{key}: expected a finite number, got {_shown(value)}", prefix + key)
    return number


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {_shown(value)}", key)
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
