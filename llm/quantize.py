"""Weight-only quantization: weight containers, (de)quantization and the linear modules the model uses.

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

Kernels (`make_linear(weight, kernel="auto" | "reference")`). Measured on the dev box (AMD EPYC Zen 3,
AVX2, no VNNI/AVX-512/bf16, 2 threads, torch 2.13 CPU; `benchmarks/kernels.py`), ms per call as a ratio
to fp32 F.linear, for batch 1 / 16 rows:

    kernel                                    [1536,576]   [960,576]    [576,1536]   head [49152,576]
    fp32 F.linear                             1.0 / 1.0    1.0 / 1.0    1.0 / 1.0    1.0 / 1.0
    bf16 F.linear (x cast to bf16)            1.15 / 4.2   1.44 / 3.9   1.2 / 3.9    0.38 / 1.5
    fbgemm fp16 (linear_dynamic_fp16)         0.66 / 0.57  0.98 / 0.57  0.67 / 0.57  0.27 / 0.28
    int8 fbgemm (linear_dynamic, prepacked)   0.59 / 0.42  1.03 / 0.44  0.59 / 0.37  0.14 / 0.11
    int8 _weight_int8pack_mm                  ~6.8 / ~100 (per the brief: 22.9 ms vs 17.9 for the head)
    int4 _weight_int4pack_mm_for_cpu, fp32 x  8.8 / 35    10.6 / 37    11 / 40      3.0 / 14
    int4 _weight_int4pack_mm_for_cpu, bf16 x  0.77 / 1.4  1.0 / 1.0    0.9 / 1.1    0.22 / 0.40

What "auto" picks on CPU (any other device, or kernel="reference", uses the reference path):

* fp32 and int8 (and int4, through its int8 re-quantization), decode and prefill: the native AVX2
  kernels of `cpu_kernels.c` (see `llm/native.py`): weights widened to fp32 in registers, fp32
  activations and sums, so the result is the exact weight-only product up to summation order. Measured
  per call, 2 threads, 1 row: [3072,576] int8 0.058 ms vs 0.136 for `_weight_int8pack_mm`; the int8 head
  [49152,576] 2.2 ms (13 GB/s, near the 16 GB/s this machine streams) vs 4.6. At 16 and 128 rows 42-53
  GMAC/s, 1.1-2x MKL's fp32 sgemm. Below, the paths where they cannot run (no compiler, no AVX2).
* fp32: F.linear.
* fp16 and bf16: fbgemm's fp16 GEMM (fp16 weights, fp32 activations and accumulation). bf16 weights are
  converted to fp16, which is exact for every bf16 value with 2^-14 <= |w| <= 65504 (fp16 has more mantissa
  bits) and off by < 2^-25 absolute below that; weights beyond fp16 range fall back to the reference.
  It is *more* accurate than the reference (which rounds activations to bf16/fp16) and 2-4x faster.
* int8: torch's int8-weight GEMM (`_weight_int8pack_mm`) on the stored codes, with activations rounded to
  bf16: a weight-only product (the per-channel scale applies to the sum), 1 byte/weight in RAM, nothing to
  pack at load. Measured, 1 thread, ms per call for [3072,576] / [960,576] / [576,1536] / head: fp32 0.225 /
  0.066 / 0.113 / 13.7; this kernel 0.162 / 0.055 / 0.080 / 8.7 (with fp32 activations it is 8x slower:
  1.8 ms). End to end on SmolLM2-135M (fp32 logits as reference, a 40-token chat prompt): relative logit
  error 0.041, top-1 agreement 97.7% - the same as the exact fp32 weight-only product (0.042), so the bf16
  activation rounding costs nothing measurable next to the int8 weights.
* int4: the native int4 kernel on the packed codes (groups a multiple of 32 columns): the exact int4
  product, 0.625 byte/weight in RAM. On this CPU it decodes at about the int8 kernel's speed: it reads half
  the bytes but widening nibbles costs more instructions than widening bytes, and the int8 kernel is
  already near the memory bandwidth. Without it: dequantized and re-quantized once to per-channel int8
  (adds 0.75% weight error in quadrature: 0.0783 → 0.0787 at group 32), then the int8 path.
* Not the default: fbgemm's dynamic int8 linear (`kernel: dynamic_int8`). It quantizes the activations per
  call with one scale for the whole tensor, and SmolLM2's residual stream has outlier channels: end to end
  it gave a relative logit error of 0.51 and 33% top-1 agreement. fbgemm's fp16 GEMM on dequantized
  weights was as accurate as the int8 GEMM but packing costs ~90 ms per matrix (12 s per load) and 2 byte
  /weight. (fbgemm's int8 path needs ``reduce_range=True`` on this AVX2 CPU: the full 8-bit range
  saturates the int16 pair-sums of vpmaddubsw; measured up to 2% error vs exact integers.)

The reference paths (the oracle in tests, and the path on non-CPU devices): fp32/fp16/bf16 cast x to the
weight's dtype and F.linear; int8 F.linear(x, q.to(x.dtype)) * scale (the per-row scale factors out of the
matmul, so this *is* the weight-only product); int4 dequantizes to x's dtype per call and F.linear.
The int8/int4 fast modules keep their codes as buffers (so `.to()` / `state_dict()` work) and build the
fbgemm packed copy lazily on the first CPU forward; RAM is the codes plus that copy (int8: ~2 byte/weight).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native

Kernel = Literal["auto", "reference", "dynamic_int8"]
QuantDtype = Literal["fp32", "fp16", "bf16", "int8", "int4"]

FLOAT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_DTYPES: tuple[str, ...] = (*FLOAT_DTYPES, "int8", "int4")
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


QuantizedWeight = Tensor | Int8Weight | Int4Weight


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
    return Int4Weight(q.packed.index_select(0, index), q.scale.index_select(0, index), q.zero.index_select(0, index))


def nbytes(q: QuantizedWeight) -> int:
    """Bytes the weight occupies as stored (codes + scales + zeros), i.e. on disk via `to_tensors`."""
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


# ---------------------------------------------------------------------------------------------------------
# linear modules


def _fbgemm_ready() -> bool:
    ops = torch.ops.quantized
    return "fbgemm" in torch.backends.quantized.supported_engines and all(
        hasattr(ops, name) for name in ("linear_prepack", "linear_dynamic", "linear_prepack_fp16")
    )


def _warn_fallback(what: str, err: Exception) -> None:
    warnings.warn(f"{what}: fast CPU kernel unavailable ({err}); using the reference path", stacklevel=3)


def _flatten(x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """fbgemm wants a contiguous fp32 2-D input; remember the leading dims to restore them."""
    lead = tuple(x.shape[:-1])
    return x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous(), lead


class FloatLinear(nn.Module):
    """y = x @ W.T with W stored as fp32/fp16/bf16; returns x's dtype.

    auto on CPU: fp32 → F.linear; fp16/bf16 → fbgemm fp16 GEMM (fp32 activations and accumulation).
    reference / other devices: x is cast to W's dtype and F.linear runs in it.
    """

    def __init__(self, weight: Tensor, kernel: Kernel = "auto") -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.kernel: Kernel = kernel
        self._packed: object | None = None  # fbgemm fp16 prepacked weight, built lazily
        self._transposed: Tensor | None = None  # wide fp32 weights only, built by prepack()

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if w.dtype == torch.float32 and self.kernel == "auto":
            fast = native.kernels()
            if fast is not None and fast.supports(x, w):
                return fast.linear_f32(x, w)
        if self._transposed is not None and x.numel() <= _SMALL_ROWS * w.shape[1]:
            return (x @ self._transposed).to(x.dtype)
        if w.dtype == torch.float32 or self.kernel == "reference" or w.device.type != "cpu":
            return F.linear(x.to(w.dtype), w).to(x.dtype)
        if self._packed is None:
            self._packed = self._prepack()
        if self._packed is False:
            return F.linear(x.to(w.dtype), w).to(x.dtype)
        return _fbgemm_fp16(x, self._packed, self.out_features)

    def _prepack(self) -> object:
        return _prepack_fp16(self.weight, "FloatLinear")

    def prepack(self) -> None:
        """Build the fast kernel's packed weight now (at load) instead of on the first forward."""
        w = self.weight
        auto_fp32_cpu = w.dtype == torch.float32 and self.kernel == "auto" and w.device.type == "cpu"
        if auto_fp32_cpu and w.shape[0] >= _WIDE and native.kernels() is None:
            # A wide fp32 matrix (the vocabulary head): x @ W^T from a contiguous W^T streams the weight
            # in the order the single-row product reads it; measured 2x faster at 1-16 rows (13.8 -> 8.7 ms
            # for [49152, 576], 1 row). Costs a transposed copy (113 MB for SmolLM2's tied head).
            self._transposed = w.t().contiguous()
        if self._packed is None and w.dtype != torch.float32 and self.kernel != "reference" and w.device.type == "cpu":
            self._packed = self._prepack()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._packed = self._transposed = None  # a move/cast invalidates the packed copies
        return super()._apply(fn, recurse)


def _prepack_fp16(w: Tensor, what: str) -> object:
    """fbgemm's packed fp16 weight, or False when the kernel or the value range does not allow it."""
    if not _fbgemm_ready() or not torch.isfinite(w).all() or w.abs().max().item() > _FP16_MAX:
        return False
    try:
        # linear_prepack_fp16 takes fp32 and rounds to fp16 itself; bf16 → fp32 → fp16 is exact
        # in fp16's normal range, so the packed weight holds the same values
        return torch.ops.quantized.linear_prepack_fp16(w.float().contiguous(), None)
    except (RuntimeError, NotImplementedError) as err:
        _warn_fallback(what, err)
        return False


def _fbgemm_fp16(x: Tensor, packed: object, out_features: int) -> Tensor:
    x2, lead = _flatten(x)
    y = torch.ops.quantized.linear_dynamic_fp16(x2, packed)
    return y.reshape(*lead, out_features).to(x.dtype)


def _prepack_int8(qweight: Tensor, scale: Tensor, what: str) -> object:
    if not _fbgemm_ready():
        return False
    n = qweight.shape[0]
    try:
        with warnings.catch_warnings():
            # quantized-tensor constructors warn about a future deprecation; the fallback covers removal
            warnings.simplefilter("ignore")
            qt = torch._make_per_channel_quantized_tensor(
                qweight.contiguous(), scale.double(), torch.zeros(n, dtype=torch.long), 0
            )
            return torch.ops.quantized.linear_prepack(qt, None)
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        _warn_fallback(what, err)
        return False


_SMALL_ROWS = 16  # up to this many rows (decode) the transposed fp32 head is faster
_WIDE = 16384  # "wide": the vocabulary head, not the per-layer matrices
# From this many rows (prefill) converting the int8 codes to fp32 and using the fp32 GEMM beats the
# int8-weight GEMM, which is built for few rows: measured 6.2 vs 8.6 ms for [3072, 576] at 128 rows.
_MANY_ROWS = 64


def _int8_weight_ready(qweight: Tensor, scale: Tensor) -> Tensor | bool:
    """The bf16 scales `_weight_int8pack_mm` takes, or False when the kernel is missing or wrong here."""
    if qweight.shape[1] % 8:
        return False  # torch 2.13's CPU kernel returns wrong sums when K % 8 != 0 (measured: 37% error at K=20)
    try:
        scale16 = scale.to(torch.bfloat16).contiguous()
        probe = torch.zeros(1, qweight.shape[1], dtype=torch.bfloat16)
        torch._weight_int8pack_mm(probe, qweight[:1].contiguous(), scale16[:1])
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        _warn_fallback("Int8Linear", err)
        return False
    return scale16


def _int8_weight_mm(x: Tensor, qweight: Tensor, scale16: Tensor) -> Tensor:
    # A weight-only product: int8 codes times bf16 activations, the per-channel scale applied to the sum.
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch._weight_int8pack_mm(x2, qweight, scale16)
    return y.reshape(*x.shape[:-1], qweight.shape[0]).to(x.dtype)


def _fbgemm_int8(x: Tensor, packed: object, out_features: int) -> Tensor:
    x2, lead = _flatten(x)
    # reduce_range=True: 7-bit activations; the full 8-bit range saturates int16 sums on AVX2 (no VNNI)
    y = torch.ops.quantized.linear_dynamic(x2, packed, True)
    return y.reshape(*lead, out_features).to(x.dtype)


class Int8Linear(nn.Module):
    """Weight-only int8 linear. auto on CPU: torch's int8-weight GEMM with bf16 activations;
    dynamic_int8: fbgemm's dynamic int8 (activations quantized too); reference: F.linear(x, q) * scale."""

    def __init__(self, weight: Int8Weight, kernel: Kernel = "auto") -> None:
        super().__init__()
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scale", weight.scale.float())
        self.kernel: Kernel = kernel
        self._packed: object | None = None

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    def prepack(self) -> None:
        """Prepare the fast kernel now (at load) instead of on the first forward."""
        if self._packed is not None or self.kernel == "reference" or self.qweight.device.type != "cpu":
            return
        if self.kernel == "dynamic_int8":
            self._packed = _prepack_int8(self.qweight, self.scale, "Int8Linear")
        else:
            self._packed = _int8_weight_ready(self.qweight, self.scale)

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel == "auto":
            fast = native.kernels()
            if fast is not None and fast.supports(x, self.qweight):
                return fast.linear_int8(x, self.qweight, self.scale)
        if self.kernel != "reference" and self.qweight.device.type == "cpu":
            self.prepack()
            if self.kernel == "dynamic_int8" and self._packed is not False:
                return _fbgemm_int8(x, self._packed, self.out_features)
            if isinstance(self._packed, Tensor) and x.numel() < _MANY_ROWS * self.in_features:
                return _int8_weight_mm(x, self.qweight, self._packed)
        return self.reference(x)

    def reference(self, x: Tensor) -> Tensor:
        # compute in fp32 at least: int8 codes up to 127 summed over K overflow fp16's precision quickly
        dtype = torch.promote_types(x.dtype, torch.float32)
        y = F.linear(x.to(dtype), self.qweight.to(dtype)) * self.scale.to(dtype)
        return y.to(x.dtype)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._packed = None
        return super()._apply(fn, recurse)


class Int4Linear(nn.Module):
    """Weight-only int4 linear. auto on CPU: the native int4 kernel on the packed codes (0.5 byte/weight),
    else re-quantized once to per-channel int8 for the int8 kernels; dynamic_int8: the same int8 codes in
    fbgemm's dynamic int8; reference: dequantize per call."""

    NATIVE = "native int4"  # `_packed` when the native kernel reads the codes as they are

    def __init__(self, weight: Int4Weight, kernel: Kernel = "auto") -> None:
        super().__init__()
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("zero", weight.zero)
        self.kernel: Kernel = kernel
        self._packed: object | None = None

    @property
    def in_features(self) -> int:
        return int(self.packed.shape[1]) * 2

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0])

    @property
    def group_size(self) -> int:
        return self.in_features // int(self.scale.shape[1])

    def quantized_weight(self) -> Int4Weight:
        return Int4Weight(packed=self.packed, scale=self.scale, zero=self.zero)

    def prepack(self) -> None:
        """Choose the kernel now (at load) and re-quantize to int8 if it needs that, not on the first forward."""
        if self._packed is not None or self.kernel == "reference" or self.packed.device.type != "cpu":
            return
        fast = native.kernels() if self.kernel == "auto" else None
        probe = self.packed.new_empty(0, self.in_features, dtype=torch.float32)
        if fast is not None and fast.supports_int4(probe, self.packed, self.scale, self.zero):
            self._packed = self.NATIVE
            return
        q8 = _quantize_int8(dequantize(self.quantized_weight()))
        if self.kernel == "dynamic_int8":
            self._packed = _prepack_int8(q8.qweight, q8.scale, "Int4Linear")
            return
        self._packed = (q8.qweight, q8.scale.float().contiguous(), _int8_weight_ready(q8.qweight, q8.scale))

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel != "reference" and self.packed.device.type == "cpu":
            self.prepack()
            if self._packed == self.NATIVE:
                fast = native.kernels()
                assert fast is not None
                return fast.linear_int4(x, self.packed, self.scale, self.zero)
            if self.kernel == "dynamic_int8" and self._packed is not False:
                return _fbgemm_int8(x, self._packed, self.out_features)
            if isinstance(self._packed, tuple):
                qweight, scale, scale16 = self._packed
                fast = native.kernels() if self.kernel == "auto" else None
                if fast is not None and fast.supports(x, qweight):
                    return fast.linear_int8(x, qweight, scale)
                if isinstance(scale16, Tensor) and x.numel() < _MANY_ROWS * self.in_features:
                    return _int8_weight_mm(x, qweight, scale16)
                return (F.linear(x.float(), qweight.float()) * scale).to(x.dtype)
        return self.reference(x)

    def reference(self, x: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        return F.linear(x.to(dtype), dequantize(self.quantized_weight(), dtype)).to(x.dtype)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._packed = None
        return super()._apply(fn, recurse)


def make_linear(weight: QuantizedWeight, kernel: Kernel = "auto") -> nn.Module:
    """The linear module for a (possibly quantized) [out, in] weight: x[..., in] → y[..., out] in x's dtype.

    kernel="auto" uses the fast CPU kernels described in the module docstring; "reference" forces the
    plain weight-only path (always used on non-CPU devices).
    """
    if kernel not in ("auto", "reference", "dynamic_int8"):
        raise ValueError(f"kernel: expected 'auto', 'reference' or 'dynamic_int8', got {kernel!r}")
    if isinstance(weight, Int8Weight):
        return Int8Linear(weight, kernel)
    if isinstance(weight, Int4Weight):
        return Int4Linear(weight, kernel)
    if isinstance(weight, Tensor):
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"weight: expected a 2-D float tensor, got {weight.dtype} {tuple(weight.shape)}")
        return FloatLinear(weight, kernel)
    raise TypeError(f"weight: expected a Tensor, Int8Weight or Int4Weight, got {type(weight).__name__}")
