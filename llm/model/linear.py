"""The linear modules the model uses, each on one kernel path chosen at load.

`make_linear(weight, kernel="auto" | "reference")` wraps a weight of `llm/model/weight_formats.py`. `prepack()`
(called by `load.to_device` for every module, else on the first forward) chooses the module's `path`, one
of the names below, which the load stage counts into the run's metrics (`linear_kernels`); `forward` then
runs that path, or the reference where an input does not fit it (another device, a non-CPU input).

    path                          weights                 what runs
    native-<isa>-f32              fp32                    cpu_kernels.c fp32 GEMM (<isa>: avx512 or avx2)
    native-<isa>-bf16 / -fp16     bf16 / fp16             cpu_kernels.c, weights widened in registers (exact)
    native-avx512-bf16dot         bf16, bf16_inputs       x rounded to bf16, vdpbf16ps on the stored weights
    native-<isa>-bf16-xround      bf16, bf16_inputs       x rounded to bf16, then the exact path (no AVX512_BF16)
    native-<isa>-int8             int8                    cpu_kernels.c int8 GEMM, fp32 activations
    native-<isa>-int4             int4 (groups % 32 == 0) cpu_kernels.c int4 GEMM on the packed codes
    native-<isa>-int8-requant     int4, other groups      int4 re-quantized once to per-channel int8
    torch-f32                     fp32                    F.linear
    torch-f32-transposed          fp32, >= 16384 rows     x @ W^T from a contiguous W^T at <= 16 rows
    fbgemm-fp16                   fp16 / bf16             fbgemm's fp16 GEMM, fp32 activations (no native)
    torch-int8pack-bf16           int8                    _weight_int8pack_mm below 64 rows, else reference
    torch-int8pack-bf16-requant   int4                    the same on the int8 re-quantization
    native-<isa>-gguf-<TYPE>      a GGUF's blocks         gguf_blocks.c on the file's own blocks (x rounded to
                                                          int8 per 32 columns, llama.cpp's Q8_0 activations;
                                                          4-8+ rows by type on gguf_panels.c's panels, AVX-512)
    torch-gguf-dequantized        a GGUF's blocks         no native kernels: dequantized once to fp32, F.linear
    reference                     any                     the plain weight-only product (the oracle)

The native paths exist where `llm/kernels/native.py` loads (an AVX2 CPU with a C compiler); the torch ones are the
paths without it. Measured on the dev box (AMD EPYC Zen 3, AVX2, 2 threads; `benchmarks/kernels.py`):

* native fp32/int8/int4: weights widened to fp32 in registers, fp32 activations and sums: the exact
  weight-only product up to summation order (int4 at up to 32 rows on AVX-512, 8 on AVX2: x rounded to 16 bits
  per group, the codes' products summed in integers, vpdpwssd tiles past 8 rows; 4e-4 relative on SmolLM2's
  logits, see llm/kernels/cpu_kernels.c). [3072,576] int8
  at 1 row 0.058 ms vs 0.136 for `_weight_int8pack_mm`; the int8 head [49152,576] 2.2 ms vs 4.6; at 16 and
  128 rows 42-53 GMAC/s, 1.1-2x MKL's fp32 sgemm. Activations stay fp32 on purpose: int8 activations
  (VNNI) measured 0.056-0.151 relative logit error against 0.043 weight-only
  (benchmarks/activation_quant_accuracy.md).
* native bf16dot (`bf16_inputs`, AVX512_BF16): x rounded to bf16, as llama.cpp's BF16 does; on a Zen 5 at 2
  threads [2048, 640] 1.24x the exact path at 1 row, 1.60x at 16, 1.51x at 128; [640, 2048] at 128 rows 2.59x;
  the [262144, 640] head 4.2 ms (80 GB/s). SmolLM2's bf16 logits move 0.0091 relative from fp32 against 0.0057
  for the exact path (tests/pipeline/test_smollm2_precisions.py). Past FEW_ROWS rows the vdpbf16ps tiles run
  only where they measure faster than the exact tiles on the rounded x (`NativeKernels.bf16_dot_tiles`, once a
  process): an Intel Xeon runs vdpbf16ps on one pipe, 99 GMAC/s at 128 rows against 120 for the exact tiles.
* fbgemm-fp16: bf16 weights are converted to fp16, exact for every bf16 value with 2^-14 <= |w| <= 65504
  and off by < 2^-25 absolute below that; weights beyond fp16 range use the reference. More accurate than
  the reference (which rounds activations to bf16/fp16) and 2-4x faster.
* torch-int8pack-bf16: activations rounded to bf16, the per-channel scale applied to the sum; end to end on
  SmolLM2-135M a relative logit error of 0.041 against 0.042 for the exact weight-only product. From 64
  rows (prefill) the fp32 reference GEMM is faster (6.2 vs 8.6 ms for [3072, 576] at 128 rows).
* the int8 re-quantization of int4 adds 0.75% weight error in quadrature (0.0783 -> 0.0787 at group 32).

The reference paths: fp32/fp16/bf16 cast x to the weight's dtype and F.linear; int8 F.linear(x, q) * scale
(the per-row scale factors out, so this *is* the weight-only product); int4 dequantizes per call. The modules
keep their codes as buffers (so `.to()` / `state_dict()` work); a move or cast clears the chosen path.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels import native
from .weight_formats import (
    GGUFParts,
    GGUFWeight,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    dequantize,
    dequantize_gguf,
    quantize_weight,
)

Kernel = Literal["auto", "reference"]
REFERENCE = "reference"

_FP16_MAX = 65504.0
_SMALL_ROWS = 16  # up to this many rows (decode) the transposed fp32 head is faster
_WIDE = 16384  # "wide": the vocabulary head, not the per-layer matrices
_MANY_ROWS = 64  # from this many rows the fp32 GEMM beats torch's int8-weight GEMM


def _warn_fallback(what: str, err: Exception) -> None:
    warnings.warn(f"{what}: fast CPU kernel unavailable ({err}); using the reference path", stacklevel=3)


def _native_for(weight: Tensor) -> native.NativeKernels | None:
    """The native kernels when they can take this weight (CPU, row-major, in-features a multiple of 8)."""
    fast = native.kernels()
    probe = weight.new_empty(0, weight.shape[1], dtype=torch.float32)
    return fast if fast is not None and fast.supports(probe, weight) else None


def _prepack_fp16(w: Tensor, what: str) -> object | None:
    """fbgemm's packed fp16 weight, or None when the kernel or the value range does not allow it."""
    ops = torch.ops.quantized
    ready = "fbgemm" in torch.backends.quantized.supported_engines and all(
        hasattr(ops, name) for name in ("linear_prepack_fp16", "linear_dynamic_fp16")
    )
    if not ready or not torch.isfinite(w).all() or w.abs().max().item() > _FP16_MAX:
        return None
    try:
        # linear_prepack_fp16 takes fp32 and rounds to fp16 itself; bf16 → fp32 → fp16 is exact in fp16's
        # normal range, so the packed weight holds the same values
        return ops.linear_prepack_fp16(w.float().contiguous(), None)
    except (RuntimeError, NotImplementedError) as err:
        _warn_fallback(what, err)
        return None


def _int8_weight_ready(qweight: Tensor, scale: Tensor) -> Tensor | None:
    """The bf16 scales `_weight_int8pack_mm` takes, or None when the kernel is missing or wrong here."""
    if qweight.shape[1] % 8:
        return None  # torch 2.13's CPU kernel returns wrong sums when K % 8 != 0 (measured: 37% error at K=20)
    try:
        scale16 = scale.to(torch.bfloat16).contiguous()
        probe = torch.zeros(1, qweight.shape[1], dtype=torch.bfloat16)
        torch._weight_int8pack_mm(probe, qweight[:1].contiguous(), scale16[:1])
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        _warn_fallback("Int8Linear", err)
        return None
    return scale16


def _int8_weight_mm(x: Tensor, qweight: Tensor, scale16: Tensor) -> Tensor:
    # A weight-only product: int8 codes times bf16 activations, the per-channel scale applied to the sum.
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch._weight_int8pack_mm(x2, qweight, scale16)
    return y.reshape(*x.shape[:-1], qweight.shape[0]).to(x.dtype)


def _int8_reference(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    # compute in fp32 at least: int8 codes up to 127 summed over K overflow fp16's precision quickly
    dtype = torch.promote_types(x.dtype, torch.float32)
    return (F.linear(x.to(dtype), qweight.to(dtype)) * scale.to(dtype)).to(x.dtype)


class _Chosen(nn.Module):
    """What the three modules share: a kernel path chosen once (`prepack`), cleared by a move or cast."""

    def __init__(self, kernel: Kernel) -> None:
        super().__init__()
        if kernel not in ("auto", REFERENCE):
            raise ValueError(f"kernel: expected 'auto' or 'reference', got {kernel!r}")
        self.kernel: Kernel = kernel
        self.path: str | None = None  # set by prepack()
        self._fast: native.NativeKernels | None = None

    def _on_cpu_auto(self, t: Tensor) -> bool:
        return self.kernel == "auto" and t.device.type == "cpu"

    def _chosen(self) -> str:
        if self.path is None:
            self.prepack()
        assert self.path is not None
        return self.path

    def prepack(self) -> None:  # pragma: no cover - each module defines it
        raise NotImplementedError

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self.path, self._fast = None, None  # a move/cast invalidates packed copies and the choice
        self._clear()
        return super()._apply(fn, recurse)

    def _clear(self) -> None:
        pass


class FloatLinear(_Chosen):
    """y = x @ W.T with W stored as fp32/fp16/bf16; returns x's dtype.

    bf16_inputs (a bf16 W): x is rounded to bf16 before the product, as torch's bf16 matmul and llama.cpp's
    BF16 do, so each product is exact and the sums fp32; vdpbf16ps runs them where the CPU has AVX512_BF16.
    """

    def __init__(self, weight: Tensor, kernel: Kernel = "auto", bf16_inputs: bool = False) -> None:
        super().__init__(kernel)
        if bf16_inputs and weight.dtype != torch.bfloat16:
            raise ValueError(f"bf16_inputs: takes a bf16 weight, not {weight.dtype}")
        self.bf16_inputs = bf16_inputs
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self._packed: object | None = None  # fbgemm fp16 prepacked weight
        self._transposed: Tensor | None = None  # wide fp32 weights without the native kernels

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def _clear(self) -> None:
        self._packed = self._transposed = None

    @property
    def _rounds_x(self) -> bool:
        return self.bf16_inputs and self.weight.dtype == torch.bfloat16  # a cast to another dtype drops it

    def prepack(self) -> None:
        """Choose the kernel path now (at load) and build what it needs, instead of on the first forward."""
        w = self.weight
        self._clear()
        if not self._on_cpu_auto(w):
            self.path = REFERENCE
        elif w.dtype == torch.float32:
            self._fast = _native_for(w)
            if self._fast is not None:
                self.path = f"native-{self._fast.isa}-f32"
            elif w.shape[0] >= _WIDE:
                # A wide fp32 matrix (the vocabulary head): x @ W^T from a contiguous W^T streams the weight
                # in the order the single-row product reads it; measured 2x faster at 1-16 rows (13.8 -> 8.7
                # ms for [49152, 576], 1 row). Costs a transposed copy (113 MB for SmolLM2's tied head).
                self._transposed = w.t().contiguous()
                self.path = "torch-f32-transposed"
            else:
                self.path = "torch-f32"
        else:
            self._fast = _native_for(w)
            if self._fast is not None and self._rounds_x:
                # vdpbf16ps, or (without AVX512_BF16) x rounded to bf16 values and the exact widening path
                self.path = "native-avx512-bf16dot" if self._fast.bf16_dot else f"native-{self._fast.isa}-bf16-xround"
                return
            if self._fast is not None:
                self.path = f"native-{self._fast.isa}-{'bf16' if w.dtype == torch.bfloat16 else 'fp16'}"
                return
            self._packed = _prepack_fp16(w, "FloatLinear")
            self.path = "fbgemm-fp16" if self._packed is not None else REFERENCE

    def forward(self, x: Tensor) -> Tensor:
        path, w = self._chosen(), self.weight
        if self._fast is not None and self._fast.supports(x, w):
            if w.dtype == torch.float32:
                return self._fast.linear_f32(x, w)
            return self._fast.linear_half(x, w, self._rounds_x)
        if self._transposed is not None and x.numel() <= _SMALL_ROWS * w.shape[1]:
            return (x @ self._transposed).to(x.dtype)
        if path == "fbgemm-fp16" and x.device.type == "cpu":
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16 if self._rounds_x else torch.float32)
            x2 = x2.to(torch.float32).contiguous()
            y = torch.ops.quantized.linear_dynamic_fp16(x2, self._packed)
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return self.reference(x)

    def reference(self, x: Tensor) -> Tensor:
        if self._rounds_x and x.device.type == "cpu":  # bf16 inputs, fp32 sums: the native path's numbers
            return F.linear(x.to(torch.bfloat16).float(), self.weight.float()).to(x.dtype)
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


class Int8Linear(_Chosen):
    """Weight-only int8 linear: y = (x @ qweight.T) * scale."""

    def __init__(self, weight: Int8Weight, kernel: Kernel = "auto") -> None:
        super().__init__(kernel)
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scale", weight.scale.float())
        self._scale16: Tensor | None = None

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    def _clear(self) -> None:
        self._scale16 = None

    def prepack(self) -> None:
        """Choose the kernel path now (at load), instead of on the first forward."""
        self._clear()
        self._fast = _native_for(self.qweight) if self._on_cpu_auto(self.qweight) else None
        if self._fast is not None:
            self.path = f"native-{self._fast.isa}-int8"
        elif self._on_cpu_auto(self.qweight) and (scale16 := _int8_weight_ready(self.qweight, self.scale)) is not None:
            self._scale16, self.path = scale16, "torch-int8pack-bf16"
        else:
            self.path = REFERENCE

    def forward(self, x: Tensor) -> Tensor:
        self._chosen()
        if self._fast is not None and self._fast.supports(x, self.qweight):
            return self._fast.linear_int8(x, self.qweight, self.scale)
        if self._scale16 is not None and x.device.type == "cpu" and x.numel() < _MANY_ROWS * self.in_features:
            return _int8_weight_mm(x, self.qweight, self._scale16)
        return self.reference(x)

    def reference(self, x: Tensor) -> Tensor:
        return _int8_reference(x, self.qweight, self.scale)


class Int4Linear(_Chosen):
    """Weight-only int4 linear: the native kernel on the packed codes (0.5 byte/weight) where it fits, else
    the codes re-quantized once to per-channel int8 for the int8 kernels; reference: dequantize per call."""

    def __init__(self, weight: Int4Weight, kernel: Kernel = "auto") -> None:
        super().__init__(kernel)
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("zero", weight.zero)
        self.int8: tuple[Tensor, Tensor] | None = None  # (codes, fp32 scale) of the int8 re-quantization
        self._scale16: Tensor | None = None

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

    def _clear(self) -> None:
        self.int8 = self._scale16 = None

    def prepack(self) -> None:
        """Choose the kernel path now (at load) and re-quantize to int8 if it needs that."""
        self._clear()
        if not self._on_cpu_auto(self.packed):
            self.path = REFERENCE
            return
        fast = native.kernels()
        probe = self.packed.new_empty(0, self.in_features, dtype=torch.float32)
        if fast is not None and fast.supports_int4(probe, self.packed, self.scale, self.zero):
            self._fast, self.path = fast, f"native-{fast.isa}-int4"
            return
        q8 = quantize_weight(dequantize(self.quantized_weight()), "int8")
        assert isinstance(q8, Int8Weight)
        qweight, scale = q8.qweight, q8.scale
        self.int8 = (qweight, scale.float().contiguous())
        self._fast = _native_for(qweight)
        if self._fast is not None:
            self.path = f"native-{self._fast.isa}-int8-requant"
        elif (scale16 := _int8_weight_ready(qweight, scale)) is not None:
            self._scale16, self.path = scale16, "torch-int8pack-bf16-requant"
        else:
            self.path = REFERENCE  # on the int8 re-quantization: F.linear on its codes

    def forward(self, x: Tensor) -> Tensor:
        path = self._chosen()
        if path == REFERENCE and self.int8 is None:
            return self.reference(x)
        if self.int8 is None:  # the packed codes
            assert self._fast is not None
            return self._fast.linear_int4(x, self.packed, self.scale, self.zero)
        qweight, scale = self.int8
        if self._fast is not None and self._fast.supports(x, qweight):
            return self._fast.linear_int8(x, qweight, scale)
        if self._scale16 is not None and x.numel() < _MANY_ROWS * self.in_features:
            return _int8_weight_mm(x, qweight, self._scale16)
        return _int8_reference(x, qweight, scale)

    def reference(self, x: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        return F.linear(x.to(dtype), dequantize(self.quantized_weight(), dtype)).to(x.dtype)


class GGUFLinear(_Chosen):
    """y = x @ W.T with W a GGUF's own blocks (`GGUFWeight`, a view on the file's mapping): gguf_blocks.c's
    products where the native kernels load; without them the blocks are dequantized once to fp32 (the
    memory of the fp32 import, but its speed), and the reference dequantizes on every call (the oracle)."""

    def __init__(self, weight: GGUFWeight, kernel: Kernel = "auto", activation_bits: int = 8) -> None:
        super().__init__(kernel)
        if activation_bits not in (8, 16):
            raise ValueError(f"activation_bits: 8 or 16, not {activation_bits}")
        self.activation_bits = activation_bits  # the block kernels' rounding of x (load.convert.activation_bits)
        self.qtype, self.type_name = weight.qtype, weight.type_name
        self.out_features, self.in_features = weight.shape
        self.register_buffer("blocks", weight.blocks)  # a view on the mapped file, not a copy
        self._dense: Tensor | None = None

    def gguf_weight(self) -> GGUFWeight:
        return GGUFWeight(self.blocks, self.qtype, (self.out_features, self.in_features), self.type_name)

    def _clear(self) -> None:
        self._dense = None

    def prepack(self) -> None:
        """Choose the path now (at load): the native block kernel for this type, else a one-off fp32 copy."""
        self._clear()
        if not self._on_cpu_auto(self.blocks):
            self.path = REFERENCE
            return
        fast = native.kernels()
        if fast is not None and fast.gguf_block_shape(self.qtype) is not None:
            self._fast, self.path = fast, f"native-{fast.isa}-gguf-{self.type_name or self.qtype}"
            return
        self._dense = dequantize_gguf(self.gguf_weight())
        self.path = "torch-gguf-dequantized"

    def forward(self, x: Tensor) -> Tensor:
        self._chosen()
        if self._fast is not None and x.device.type == "cpu":
            fast, bits = self._fast, self.activation_bits
            return fast.gguf_linear(x, self.blocks, self.qtype, self.out_features, self.in_features, bits)
        if self._dense is not None and x.device.type == "cpu":
            return F.linear(x.to(torch.float32), self._dense).to(x.dtype)
        return self.reference(x)

    def reference(self, x: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        return F.linear(x.to(dtype), dequantize(self.gguf_weight(), dtype)).to(x.dtype)


class GGUFPartsLinear(nn.Module):
    """A fused linear (wqkv, w13) of GGUF parts of different block types: each part its own `GGUFLinear`, the
    outputs concatenated in the parts' order (the rows the fused weight would have)."""

    def __init__(self, weight: GGUFParts, kernel: Kernel = "auto", activation_bits: int = 8) -> None:
        super().__init__()
        self.parts = nn.ModuleList(GGUFLinear(p, kernel, activation_bits) for p in weight.parts)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def make_linear(
    weight: QuantizedWeight, kernel: Kernel = "auto", bf16_inputs: bool = False, activation_bits: int = 8
) -> nn.Module:
    """The linear module for a (possibly quantized) [out, in] weight: x[..., in] → y[..., out] in x's dtype.

    kernel="auto" chooses a fast path at load (see the module doc); "reference" forces the plain weight-only
    product (always used on non-CPU devices). bf16_inputs: a bf16 weight's products take x rounded to bf16
    (FloatLinear); other weights ignore it. activation_bits: a GGUF weight's rounding of x (8 or 16).
    """
    if kernel not in ("auto", REFERENCE):
        raise ValueError(f"kernel: expected 'auto' or 'reference', got {kernel!r}")
    if isinstance(weight, Int8Weight):
        return Int8Linear(weight, kernel)
    if isinstance(weight, Int4Weight):
        return Int4Linear(weight, kernel)
    if isinstance(weight, GGUFWeight):
        return GGUFLinear(weight, kernel, activation_bits)
    if isinstance(weight, GGUFParts):
        return GGUFPartsLinear(weight, kernel, activation_bits)
    if isinstance(weight, Tensor):
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"weight: expected a 2-D float tensor, got {weight.dtype} {tuple(weight.shape)}")
        return FloatLinear(weight, kernel, bf16_inputs and weight.dtype == torch.bfloat16)
    raise TypeError(f"weight: expected a Tensor, Int8Weight, Int4Weight or GGUF weight, got {type(weight).__name__}")


def kernel_paths(model: nn.Module) -> dict[str, int]:
    """How many linear modules run on each path (after `prepack`): the run's `linear_kernels` metric."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, _Chosen):
            path = module.path or "unchosen"
            counts[path] = counts.get(path, 0) + 1
    return dict(sorted(counts.items()))
