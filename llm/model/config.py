"""The model's shape, read from an HF-format `config.json` into one typed dataclass."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..trust.files import FileProblem, read_json_limited
from .architecture import ARCHITECTURES, Architecture, architecture, sliding_layers

SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
# What each activation field may say, by the activation the architecture computes.
ACTIVATION_NAMES = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh",)}

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
    """Frequency scaling of RoPE: llama3-style (`rope_type == "llama3"`: high frequencies kept, low ones divided
    by `factor`, interpolated between) or linear (`"linear"`: every frequency divided by `factor`, positions
    interpolated; Gemma 3's global layers). None means plain RoPE."""

    factor: float
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0
    rope_type: str = "llama3"

    def check(self) -> None:
        _in_range("rope_scaling.factor", self.factor, 0.0, 1e6, low_open=True)
        if self.rope_type == "linear":
            return
        for name in ("low_freq_factor", "high_freq_factor"):
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
    layer_windows: tuple[int, ...] = ()
    """Per layer, the sliding window (keys within this many positions of the query, itself included), or 0
    for full attention; empty means every layer attends fully."""
    attn_scale: float | None = None
    """The attention scores' scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)."""
    attn_softcap: float | None = None
    """Scores become cap * tanh(score / cap) before the softmax (Gemma 2)."""
    final_softcap: float | None = None
    """Logits become cap * tanh(logit / cap) (Gemma 2)."""
    rope_local_theta: float | None = None
    """The RoPE base of sliding layers, which then have no scaling (Gemma 3); None: as the other layers."""

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
        if self.arch is None:
            raise ConfigError(f"model_type: unsupported {self.model_type!r}", "model_type")
        if self.layer_windows and len(self.layer_windows) != self.n_layers:
            raise ConfigError(
                f"layer_types: {len(self.layer_windows)} entries for {self.n_layers} layers", "layer_types"
            )
        for name in ("attn_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None:
                _in_range(name, value, 0.0, 1e6, low_open=True)
        if self.rope_local_theta is not None:
            _in_range("rope_local_base_freq", self.rope_local_theta, *ROPE_THETA_RANGE, low_open=True)

    @property
    def arch(self) -> Architecture:
        """The description of this config's family (llm/model/architecture.py)."""
        return ARCHITECTURES.get(self.model_type)  # type: ignore[return-value]

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, or 0 when it attends over everything."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def n_rep(self) -> int:
        """How many query heads share one KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        arch = architecture(model_type)
        if arch is None:
            raise ConfigError(
                f"model_type: unsupported {_shown(model_type)} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})",
                "model_type",
            )
        _check_fields(arch, raw)
        dim = _int(raw, "hidden_size")
        n_heads = _int(raw, "num_attention_heads")
        n_layers = _int(raw, "num_hidden_layers")
        intermediate = _int(raw, "intermediate_size")
        vocab = _int(raw, "vocab_size")
        if n_heads <= 0:
            raise ConfigError(f"num_attention_heads must be > 0 (got {n_heads})", "num_attention_heads")
        if n_layers <= 0:
            raise ConfigError(f"num_hidden_layers must be > 0 (got {n_layers})", "num_hidden_layers")
        head_dim = _int(raw, "head_dim", None)
        if head_dim is None:
            if dim % n_heads:
                raise ConfigError(
                    f"hidden_size ({dim}) must be divisible by num_attention_heads ({n_heads})", "hidden_size"
                )
            head_dim = dim // n_heads
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos_ids = tuple(_int({"eos_token_id": e}, "eos_token_id") for e in eos)
        else:
            eos_ids = () if eos is None else (_int(raw, "eos_token_id"),)
        theta, scaling, local_theta = _rope(arch, raw)
        scalar = _number(raw, "query_pre_attn_scalar", None) if arch.attn_scalar else None
        if scalar is not None:
            _in_range("query_pre_attn_scalar", scalar, 0.0, 1e9, low_open=True)
        return cls(
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=_int(raw, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            vocab_size=vocab,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=_number(raw, "rms_norm_eps", 1e-5),
            max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", arch.default_tie),
            bos_token_id=_int(raw, "bos_token_id", None),
            eos_token_ids=eos_ids,
            pad_token_id=_int(raw, "pad_token_id", None),
            model_type=model_type,
            layer_windows=_windows(arch, raw, n_layers),
            attn_scale=None if scalar is None else scalar**-0.5,
            attn_softcap=_number(raw, "attn_logit_softcapping", None) if arch.soft_caps else None,
            final_softcap=_number(raw, "final_logit_softcapping", None) if arch.soft_caps else None,
            rope_local_theta=local_theta,
        )

    def parameter_count(self) -> int:
        """Weights the model holds (embeddings, head unless tied, every layer's projections and norms)."""
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = self.dim * (q_out + 2 * kv_out) + q_out * self.dim + 3 * self.dim * self.intermediate_size
        per_layer += 2 * self.dim
        arch = self.arch
        if arch.qkv_bias:
            per_layer += q_out + 2 * kv_out
        if arch.qk_norm:
            per_layer += 2 * self.head_dim
        if arch.sandwich_norms:
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


# rope_scaling / rope_parameters keys each kind reads; any other key is refused like an unknown field.
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "linear": {"factor"},
}


def _rope_scaling(raw: Any) -> RopeScaling | None:
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"rope_scaling: expected an object, got {_shown(raw)}", "rope_scaling")
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        kind = "default"
    if kind not in _ROPE_KEYS:
        raise ConfigError(
            f"rope_scaling.rope_type: unsupported {_shown(kind)} (supported: llama3, linear)", "rope_scaling.rope_type"
        )
    for key in raw:
        if key not in _ROPE_KEYS["default"] | _ROPE_KEYS[kind]:
            raise ConfigError(
                f"rope_scaling.{key}: not a field of {kind} RoPE this library reads (refused, not ignored)",
                f"rope_scaling.{key}",
            )
    factor = raw.get("partial_rotary_factor")
    if factor is not None and factor != 1.0:
        raise ConfigError(
            f"rope_scaling.partial_rotary_factor: {_shown(factor)} is not supported (only 1.0: every dim rotates)",
            "rope_scaling.partial_rotary_factor",
        )
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(factor=_number(raw, "factor", _MISSING, "rope_scaling."), rope_type="linear")
    try:
        return RopeScaling(
            factor=_number(raw, "factor", _MISSING, "rope_scaling."),
            low_freq_factor=_number(raw, "low_freq_factor", _MISSING, "rope_scaling."),
            high_freq_factor=_number(raw, "high_freq_factor", _MISSING, "rope_scaling."),
            original_max_position_embeddings=_int(raw, "original_max_position_embeddings"),
        )
    except ConfigError as bad:
        raise ConfigError(f"rope_scaling.{bad}".replace("rope_scaling.rope_scaling.", "rope_scaling.")) from None


def _check_fields(arch: Architecture, raw: dict[str, Any]) -> None:
    """Every field is one the description covers, with a value this library computes; else the field named."""
    known = arch.known_fields
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(
                f"{_shown(key)}: not a field of a {arch.model_type} config this library knows "
                "(refused rather than ignored: it may change the model)",
                str(key),
            )
        check = arch.required.get(key)
        if check is not None and not check(value):
            raise ConfigError(f"{key}: {_shown(value)} is not supported for {arch.model_type}", key)
    names = ACTIVATION_NAMES[arch.activation]
    for key in arch.activation_fields:
        value = raw.get(key)
        if value is not None and value not in names:
            raise ConfigError(
                f"{key}: unsupported {_shown(value)} for {arch.model_type} (supported: {', '.join(names)})", key
            )


def _rope(arch: Architecture, raw: dict[str, Any]) -> tuple[float, RopeScaling | None, float | None]:
    """(theta, scaling) of the full-attention layers and the sliding layers' own theta (None: the same).

    Read from `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`), or from transformers 5's
    `rope_parameters`: theta and scaling in one object, or one object per layer type (Gemma 3)."""
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"rope_parameters: expected an object, got {_shown(rope)}", "rope_parameters")
    local_theta = None
    if arch.local_rope:
        local_theta = _number(raw, "rope_local_base_freq", None)
        if "full_attention" in rope or "sliding_attention" in rope:
            for key in rope:
                if key not in ("full_attention", "sliding_attention"):
                    raise ConfigError(f"rope_parameters.{key}: not a layer type", f"rope_parameters.{key}")
            local = rope.get("sliding_attention") or {}
            if not isinstance(local, dict):
                raise ConfigError("rope_parameters.sliding_attention: expected an object")
            if _rope_scaling(local) is not None:
                raise ConfigError(
                    "rope_parameters.sliding_attention: scaled RoPE on sliding layers is not supported",
                    "rope_parameters.sliding_attention",
                )
            local_theta = _number(local, "rope_theta", 10000.0, "rope_parameters.sliding_attention.")
            rope = rope.get("full_attention") or {}
            if not isinstance(rope, dict):
                raise ConfigError("rope_parameters.full_attention: expected an object")
        elif local_theta is None:
            local_theta = 10000.0  # Gemma 3's default local base
    theta = _number(raw, "rope_theta", None)
    if theta is None:
        theta = _number(rope, "rope_theta", 10000.0, "rope_parameters.")
    return theta, _rope_scaling(raw.get("rope_scaling") or rope), local_theta


def _windows(arch: Architecture, raw: dict[str, Any], n_layers: int) -> tuple[int, ...]:
    """Per layer the sliding window, 0 for full attention; () when no layer slides."""
    window = _int(raw, "sliding_window", None) if "sliding_window" in arch.fields else None
    if arch.window_rule == "qwen" and not raw.get("use_sliding_window"):
        window = None  # Qwen configs carry a window that applies only with use_sliding_window
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or any(t not in ("full_attention", "sliding_attention") for t in types):
            raise ConfigError("layer_types: expected a list of 'full_attention' or 'sliding_attention'", "layer_types")
        if len(types) != n_layers:
            raise ConfigError(f"layer_types: {len(types)} entries for {n_layers} layers", "layer_types")
    if window is None:
        return ()
    if window <= 0:
        raise ConfigError(f"sliding_window must be > 0 (got {window})", "sliding_window")
    sliding = sliding_layers(arch, raw, n_layers)
    if not any(sliding):
        return ()
    return tuple(window if s else 0 for s in sliding)
