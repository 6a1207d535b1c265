"""Weight formats: the quantized weight containers, (de)quantization, error measures and (de)serialization.

Which tensors are quantized: the linear weights only (wqkv, wo, w13, w2 and the output head). Embeddings
and norms stay float: the embedding lookup is a gather of one row per token (cheap in any dtype) and
norm weights are tiny. A tied head that shares the embedding matrix is quantized as its own copy.

Formats (`quantize_weight(w, dtype, group_size)`):

* ``fp32`` / ``fp16`` / ``bf16`` - a plain cast; the result is a Tensor.
* ``int8`` - `Int8Weight`: per-output-channel symmetric, ``scale[n] = absmax(w[n]) / 127``,
  ``q = round(w / scale)`` in [-127, 127]; w ≈ q * scale. 1 byte/weight + 4 bytes/row.
* ``int4`` - `Int4Weight`: group-wise along the input dim (default group 32), *asymmetric* like GGUF Q4_1:
  ``scale = (max - min) / 15``, ``q = round((w - min) / scale)`` in [0, 15], w ≈ q * scale + min; two
  nibbles per byte (even k in the low nibble). scale and min are stored as fp16 (like Q4_1) and the codes
  are computed against the fp16-rounded values, so dequantization is exact w.r.t. what is stored:
  0.5 byte/weight + 4 bytes/group (0.625 byte/weight at group 32, 0.156 of fp32). Asymmetric because a
  16-level grid wastes a level or more when symmetric; on N(0,1) weights the relative Frobenius error is
  ~0.08 at group 32 and ~0.09 at group 64 (symmetric absmax/7 would be ~0.11-0.13).

The linear modules that multiply by these weights, and which kernel each uses, are in `llm/model/linear.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from ..kernels import native

QuantDtype = Literal["fp32", "fp16", "bf16", "int8", "int4"]
"""The precisions a linear weight is stored in: the one list (the plan's `convert.dtype` is this type)."""

FLOAT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_DTYPES: tuple[str, ...] = get_args(QuantDtype)
DEFAULT_GROUP_SIZE = 32
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class Int8Weight:
    """Per-output-channel symmetric int8: w[n, k] ≈ qweight[n, k] * scale[n]."""

    qweight: Tensor  # int8 [N, K]
    scale: Tensor  # float32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.qweight.shape[0]), int(self.qweight.shape[1]))


@dataclass(frozen=True)
class Int4Weight:
    """Group-wise asymmetric int4: w[n, k] ≈ code[n, k] * scale[n, g] + zero[n, g], g = k // group_size.

    `packed` holds two codes per byte along k: even k in the low nibble, odd k in the high nibble.
    `zero` is the group minimum (a float offset, not an integer zero point).
    """

    packed: Tensor  # uint8 [N, K // 2]
    scale: Tensor  # float16 [N, K // group_size]
    zero: Tensor  # float16 [N, K // group_size]

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.packed.shape[0]), int(self.packed.shape[1]) * 2)

    @property
    def group_size(self) -> int:
        return self.shape[1] // int(self.scale.shape[1])


@dataclass(frozen=True)
class GGUFWeight:
    """A weight [N, K] as a GGUF file stores it: N rows of ggml blocks of type `qtype` (ggml.h's id), `blocks`
    uint8 [N, row bytes], usually a view on the file's mapping (llm/formats/gguf/mapped.py), never re-quantized.

    The block layout is the kernels' (llm/kernels/gguf_blocks.c) and gguf-py's; which types exist is known to
    the format layer (llm/formats/gguf/block_types.py), which checks the rows before it makes one of these."""

    blocks: Tensor  # uint8 [N, row bytes]
    qtype: int
    shape: tuple[int, int]
    type_name: str = ""  # "Q4_K", for messages and the load's line

    def __post_init__(self) -> None:
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[0] != self.shape[0]:
            raise ValueError(
                f"GGUFWeight {self.type_name}: blocks {self.blocks.dtype} {tuple(self.blocks.shape)} are not "
                f"{self.shape[0]} uint8 rows"
            )

    @property
    def nbytes(self) -> int:
        return int(self.blocks.numel())

    def rows(self, index: Tensor) -> GGUFWeight:
        """The given rows (each row is whole blocks, so any row order is exact): a copy."""
        rows = (int(index.numel()), self.shape[1])
        return GGUFWeight(self.blocks.index_select(0, index), self.qtype, rows, self.type_name)


@dataclass(frozen=True)
class GGUFParts:
    """A fused weight (wqkv, w13) whose GGUF parts differ in block type (Q4_K q/k, Q6_K v): each part computes
    its own output rows, concatenated in order."""

    parts: tuple[GGUFWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def fuse_gguf(parts: list[GGUFWeight]) -> GGUFWeight | GGUFParts:
    """One weight of the parts' rows in order: their block rows joined where every part has one type (one
    kernel call, a copy of the rows), else the parts kept as they are (no copy)."""
    if len(parts) == 1:
        return parts[0]
    if len({(p.qtype, p.blocks.shape[1]) for p in parts}) == 1:
        first = parts[0]
        blocks = torch.cat([p.blocks for p in parts], dim=0)
        return GGUFWeight(blocks, first.qtype, (int(blocks.shape[0]), first.shape[1]), first.type_name)
    return GGUFParts(tuple(parts))


def dequantize_gguf(w: GGUFWeight) -> Tensor:
    """fp32 [N, K] of GGUF blocks: the native kernels where they load, else gguf-py's own definitions."""
    fast = native.kernels()
    if fast is not None and w.blocks.device.type == "cpu" and fast.gguf_block_shape(w.qtype) is not None:
        return fast.gguf_dequantize(w.blocks.contiguous(), w.qtype, *w.shape)
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(w.blocks.cpu().numpy(), GGMLQuantizationType(w.qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(w.shape)).to(w.blocks.device)


QuantizedWeight = Tensor | Int8Weight | Int4Weight | GGUFWeight | GGUFParts


# ---------------------------------------------------------------------------------------------------------
# the values a weight may hold

# The largest magnitude each stored form can hold: fp16 directly, int4 in its fp16 scale and minimum.
_RANGE_LIMITS = {"fp16": _FP16_MAX, "int4": _FP16_MAX}


def value_range(t: Tensor) -> tuple[float, float]:
    """(min, max) of a float tensor in one pass; NaN propagates to both, an infinity shows at its end.
    (0, 0) for integer codes and empty tensors, which hold no NaN."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0.0, 0.0
    low, high = torch.aminmax(t)
    return float(low), float(high)


def value_problem(low: float, high: float, dtype: str) -> str | None:
    """Why values spanning [low, high] cannot become `dtype`: NaN or infinity (a damaged checkpoint, found
    here at load instead of as NaN logits at the first token), or beyond what fp16 or int4 can store."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "holds NaN or infinite values (the weights are damaged)"
    limit = _RANGE_LIMITS.get(dtype)
    if limit is not None and max(-low, high) > limit:
        return f"holds values up to {max(-low, high):.4g}, beyond what {dtype} stores (±{limit:g}); use bf16 or fp32"
    return None


# ---------------------------------------------------------------------------------------------------------
# quantize / dequantize


def quantize_weight(w: Tensor, dtype: str, group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedWeight:
    """Quantize a linear weight [out, in] to `dtype` (one of QUANT_DTYPES); group_size is used by int4."""
    if w.dim() != 2:
        raise ValueError(f"w: expected a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    if dtype in FLOAT_DTYPES:
        return w.to(FLOAT_DTYPES[dtype])
    if dtype not in ("int8", "int4"):
        raise ValueError(f"dtype: unsupported {dtype!r} (supported: {', '.join(QUANT_DTYPES)})")
    # Rows are quantized independently, so a large matrix (the vocabulary head) is done in row blocks:
    # the fp32 temporaries then stay a few MB instead of several copies of the whole matrix.
    parts = [
        _quantize_int8(block) if dtype == "int8" else _quantize_int4(block, group_size)
        for block in w.split(_CHUNK_ROWS, dim=0)
    ]
    return parts[0] if len(parts) == 1 else concat_quantized(parts)


_CHUNK_ROWS = 2048


def concat_quantized(parts: list[Int8Weight] | list[Int4Weight]) -> Int8Weight | Int4Weight:
    if isinstance(parts[0], Int8Weight):
        return Int8Weight(
            qweight=torch.cat([p.qweight for p in parts]),  # type: ignore[union-attr]
            scale=torch.cat([p.scale for p in parts]),
        )
    return Int4Weight(
        packed=torch.cat([p.packed for p in parts]),  # type: ignore[union-attr]
        scale=torch.cat([p.scale for p in parts]),
        zero=torch.cat([p.zero for p in parts]),  # type: ignore[union-attr]
    )


def _quantize_int8(w: Tensor) -> Int8Weight:
    fast = native.kernels() if w.device.type == "cpu" and w.dim() == 2 else None
    done = fast.quantize_int8(w) if fast is not None else None
    if done is not None:  # the same codes and scales, 7x faster (two passes per row, in cache)
        return Int8Weight(qweight=done[0], scale=done[1])
    w = w.float()
    absmax = w.abs().amax(dim=1)
    # an all-zero row gets scale 1 so the division stays finite; its codes are 0 either way
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(qweight=q.contiguous(), scale=scale.contiguous())


def _quantize_int4(w: Tensor, group_size: int) -> Int4Weight:
    n, k = w.shape
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size: must be a positive even number (got {group_size})")
    if k % group_size:
        raise ValueError(f"group_size: in-features {k} is not a multiple of group_size {group_size}")
    fast = native.kernels() if w.device.type == "cpu" else None
    done = fast.quantize_int4(w, group_size) if fast is not None else None
    if done is not None:  # the same codes, scales and zeros, ~10x faster
        return Int4Weight(packed=done[0], scale=done[1], zero=done[2])
    groups = w.float().reshape(n, k // group_size, group_size)
    lo = groups.amin(dim=-1)
    hi = groups.amax(dim=-1)
    if max(hi.abs().max().item(), lo.abs().max().item()) > _FP16_MAX:
        raise ValueError("w: values beyond fp16 range cannot be stored as int4 (fp16 scales)")
    # round scale/min to fp16 first and quantize against the rounded values, so stored == used
    zero = lo.to(torch.float16)
    scale = ((hi - zero.float()) / 15.0).to(torch.float16)
    # a constant group (or one whose range underflows fp16) gets scale 1: all its codes are 0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    codes = codes.to(torch.uint8).reshape(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return Int4Weight(packed=packed.contiguous(), scale=scale.contiguous(), zero=zero.contiguous())


def _unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [N, K/2] → uint8 codes [N, K] in 0..15."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The float weight [out, in] a quantized weight stands for, in `dtype`."""
    if isinstance(q, Tensor):
        return q.to(dtype)
    if isinstance(q, GGUFWeight):
        return dequantize_gguf(q).to(dtype)
    if isinstance(q, GGUFParts):
        return torch.cat([dequantize_gguf(p) for p in q.parts], dim=0).to(dtype)
    if isinstance(q, Int8Weight):
        return (q.qweight.to(torch.float32) * q.scale[:, None].float()).to(dtype)
    if isinstance(q, Int4Weight):
        n, k = q.shape
        g = q.group_size
        codes = _unpack_int4(q.packed).reshape(n, k // g, g).to(torch.float32)
        w = codes * q.scale.float()[..., None] + q.zero.float()[..., None]
        return w.reshape(n, k).to(dtype)
    raise TypeError(f"q: expected a Tensor, Int8Weight or Int4Weight, got {type(q).__name__}")


def relative_error(w: Tensor, q: QuantizedWeight, row_step: int = 1) -> float:
    """Relative Frobenius error ||w - dequantize(q)|| / ||w||, in row blocks to bound memory.

    `row_step` > 1 measures every n-th row only: rows are quantized independently, so a strided sample
    estimates the whole matrix's error (the loader uses 8: its metric, not a test oracle, costs 1/8).
    """
    return relative_from_terms(*error_terms(w, q, row_step))


def relative_from_terms(num: float, den: float) -> float:
    """sqrt(num / den), the relative error from `error_terms` (summed over parts); absolute when w is 0."""
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def error_terms(w: Tensor, q: QuantizedWeight, row_step: int = 1) -> tuple[float, float]:
    """(||w - dequantize(q)||^2, ||w||^2) over every `row_step`-th row; terms of parts add up.

    fp32 per block (fast on CPUs without fast fp64), the block sums added in fp64.
    """
    fast = native.kernels() if isinstance(q, Int8Weight) and w.device.type == "cpu" and w.dim() == 2 else None
    if fast is not None:
        return fast.int8_error_terms(w, q.qweight, q.scale, row_step)
    num = den = 0.0
    rows = range(0, w.shape[0], row_step)
    for begin in range(0, len(rows), _CHUNK_ROWS):
        index = torch.tensor(rows[begin : begin + _CHUNK_ROWS])
        ref = w.index_select(0, index).float()
        approx = dequantize(_take_rows(q, index), torch.float32)
        den += float(ref.square().sum())
        num += float((ref - approx).square().sum())
    return num, den


def _take_rows(q: QuantizedWeight, index: Tensor) -> QuantizedWeight:
    """The given rows of a (possibly quantized) weight."""
    if isinstance(q, Tensor):
        return q.index_select(0, index)
    if isinstance(q, Int8Weight):
        return Int8Weight(q.qweight.index_select(0, index), q.scale.index_select(0, index))
    if isinstance(q, GGUFWeight):
        return q.rows(index)
    if isinstance(q, GGUFParts):
        return _take_rows(dequantize(q), index)
    return Int4Weight(q.packed.index_select(0, index), q.scale.index_select(0, index), q.zero.index_select(0, index))


def nbytes(q: QuantizedWeight) -> int:
    """Bytes the weight occupies as stored (codes + scales + zeros), i.e. on disk via `to_tensors`; a GGUF
    weight's blocks as the file holds them."""
    if isinstance(q, GGUFWeight | GGUFParts):
        return q.nbytes
    return sum(t.numel() * t.element_size() for t in to_tensors(q).values())


# ---------------------------------------------------------------------------------------------------------
# (de)serialization: flat name → tensor dicts that safetensors can store (int8, uint8, fp16 all supported)

_FLOAT_KEY = "weight"
_INT8_KEYS = ("weight_int8", "weight_scale")
_INT4_KEYS = ("weight_int4", "weight_scale", "weight_zero")


def to_tensors(q: QuantizedWeight, prefix: str = "") -> dict[str, Tensor]:
    """Name → tensor for saving; `prefix` (e.g. "layers.0.attention.wqkv.") is prepended to each key.

    The format is recoverable from the key names and shapes alone (the int4 group size is
    in_features / scale columns), so no side metadata is needed.
    """
    if isinstance(q, Tensor):
        return {prefix + _FLOAT_KEY: q}
    if isinstance(q, Int8Weight):
        return {prefix + _INT8_KEYS[0]: q.qweight, prefix + _INT8_KEYS[1]: q.scale}
    if isinstance(q, Int4Weight):
        return {prefix + _INT4_KEYS[0]: q.packed, prefix + _INT4_KEYS[1]: q.scale, prefix + _INT4_KEYS[2]: q.zero}
    raise TypeError(f"q: expected a Tensor, Int8Weight or Int4Weight, got {type(q).__name__}")


def from_tensors(tensors: dict[str, Tensor], prefix: str = "") -> QuantizedWeight:
    """Inverse of `to_tensors`: rebuild the weight stored under `prefix` (other keys are ignored)."""
    if prefix + _INT4_KEYS[0] in tensors:
        packed, scale, zero = (_require(tensors, prefix + key) for key in _INT4_KEYS)
        if packed.dtype != torch.uint8 or scale.shape != zero.shape or scale.shape[0] != packed.shape[0]:
            raise ValueError(f"{prefix}weight_int4: inconsistent int4 tensors")
        if (packed.shape[1] * 2) % scale.shape[1]:
            raise ValueError(f"{prefix}weight_scale: {scale.shape[1]} groups do not divide in-features")
        return Int4Weight(packed=packed, scale=scale, zero=zero)
    if prefix + _INT8_KEYS[0] in tensors:
        qweight, scale = (_require(tensors, prefix + key) for key in _INT8_KEYS)
        if qweight.dtype != torch.int8 or scale.shape != (qweight.shape[0],):
            raise ValueError(f"{prefix}weight_int8: inconsistent int8 tensors")
        return Int8Weight(qweight=qweight, scale=scale)
    return _require(tensors, prefix + _FLOAT_KEY)


def _require(tensors: dict[str, Tensor], key: str) -> Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise KeyError(f"{key}: missing from the tensor dict") from None
