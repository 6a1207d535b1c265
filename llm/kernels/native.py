"""The native decode kernels (`cpu_kernels.c`, and the products on GGUF blocks: `gguf_blocks.c`, with
`gguf_panels.c` for many rows): built once with the system C compiler (the sources in one shared object), loaded
with ctypes.

Why C and ctypes rather than a torch extension: the kernels need no torch headers (raw pointers in, raw
pointers out), so they build with one `cc` call in under a second and need no ninja or Python headers.
The shared object is cached by source hash under `$LLMPLAN_CACHE/kernels` (default ~/.cache/llmplan), written
to a temporary name and renamed, so concurrent builds never load a half-written file.

Available when: the CPU has AVX2 (torch reports its capability as AVX2 or AVX512; FMA comes with both),
a C compiler is on PATH (`$CC`, else cc/gcc/clang), and `LLMPLAN_NATIVE` is not `0`. Otherwise
`kernels()` returns None and the callers use torch's kernels; the reason is kept in `unavailable_reason()`.

Runtime dispatch: the one source is built per instruction set (`ISAS`): "avx2" (AVX2+FMA+F16C, 8-lane
vectors) and "avx512" (F/BW/VL/DQ+VNNI+BF16, 16-lane vectors, 32 registers: wider register tiles). The AVX2
build always loads first (it runs on every CPU this module accepts) and reports the CPU's features from
cpuid and the OS's saved-state mask (`cpu_features`); where AVX-512 is usable its build is loaded instead.
`LLMPLAN_ISA=avx2` forces the AVX2 path (to test it, or to compare, on an AVX-512 machine); `avx512` asks for
AVX-512 and falls back to AVX2, with the reason in `isa_note()`, where the CPU lacks it. The path taken is
`NativeKernels.isa`, and the run's env metrics name it (stages/env_check.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# Compiled with SOURCE into the one shared object (one cc call; all hashed for the cache key)
SOURCES = (SOURCE, Path(__file__).with_name("gguf_blocks.c"), Path(__file__).with_name("gguf_panels.c"))
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
# Not -march=x86-64-v4 or -march=native: the build must not pick up AMX or other extensions that a CPU may
# list in cpuid and still fault on (this project has met one), and must run on every AVX-512 CPU it is loaded on.
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16")
ISAS: dict[str, tuple[str, ...]] = {"avx2": _AVX2, "avx512": _AVX512}
LIBS = ("-lm",)
# `cpu_features` bits (cpu_kernels.c)
FEATURE_AVX2, FEATURE_AVX512, FEATURE_VNNI, FEATURE_BF16 = 1, 2, 4, 8
# gemm_half's weight formats (cpu_kernels.c)
HALF_BF16, HALF_F16, HALF_BF16_INPUTS = 0, 1, 2

# GGML's float types (ids from ggml.h), run on the fp32/half kernels rather than gguf_blocks.c
_GGUF_FLOATS = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}

_lock = threading.Lock()
_loaded: NativeKernels | None = None
_reason: str | None = None
_note: str | None = None
_tried = False
_by_isa: dict[str, NativeKernels | None] = {}


class NativeKernels:
    """Typed entry points of the shared library. Inputs are checked by the wrappers, not by the C code."""

    # long: one ctypes signature table, each entry point's argtypes and restype together, read top to bottom
    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.lib = lib
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.kernel_isa.argtypes = []
        lib.kernel_isa.restype = ctypes.c_char_p
        lib.cpu_features.argtypes = []
        lib.cpu_features.restype = i64
        self.isa: str = lib.kernel_isa().decode()  # "avx2" or "avx512": the vector path this build runs
        self.features: int = int(lib.cpu_features())  # this CPU's FEATURE_* bits
        lib.forward_pass.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64]  # see generation/fused_decode.py
        lib.decode_layout.argtypes = [ptr, i64]
        lib.decode_layout.restype = i64
        lib.forward_pass.restype = None
        self._quantize = lib.quantize_int8_rows
        self._quantize.argtypes = [ptr, ptr, ptr, i64, i64]
        self._quantize.restype = i64
        self._quantize4 = lib.quantize_int4_groups
        self._quantize4.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64]
        self._quantize4.restype = i64
        self._error_terms = lib.int8_error_terms
        self._error_terms.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr]
        self._error_terms.restype = None
        self._int8 = lib.gemm_int8
        self._int8.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64]
        self._int8.restype = None
        self._f32 = lib.gemm_f32
        self._f32.argtypes = [ptr, ptr, ptr, i64, i64, i64]
        self._f32.restype = None
        self._half = lib.gemm_half
        self._half.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64]
        self._half.restype = None
        lib.bf16_dot_products.argtypes = []
        lib.bf16_dot_products.restype = i64
        # bf16 products with bf16 inputs run on vdpbf16ps (AVX512_BF16), else on the exact path after rounding x
        self.bf16_dot: bool = bool(lib.bf16_dot_products())
        lib.set_int4_integer_tiles.argtypes = [i64]
        lib.set_int4_integer_tiles.restype = None
        lib.int4_integer_tile_rows.argtypes = []
        lib.int4_integer_tile_rows.restype = i64
        lib.bf16_dot_tiles.argtypes = []
        lib.bf16_dot_tiles.restype = i64
        lib.set_bf16_dot_tiles.argtypes = [i64]
        lib.set_bf16_dot_tiles.restype = None
        self._int4 = lib.gemm_int4
        self._int4.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64]
        self._int4.restype = None
        self._bitmask = lib.apply_token_bitmask
        self._bitmask.argtypes = [ptr, ptr, i64]
        self._bitmask.restype = i64
        self._greedy = lib.greedy_pick
        self._greedy.argtypes = [ptr, i64, ptr]
        self._greedy.restype = i64
        self._gguf = lib.gguf_linear
        self._gguf.argtypes = [i64, ptr, ptr, ptr, i64, i64, i64, i64]
        self._gguf.restype = i64
        self._gguf_rows = lib.gguf_dequantize_rows
        self._gguf_rows.argtypes = [i64, ptr, ptr, i64, i64]
        self._gguf_rows.restype = i64
        lib.gguf_block_shape.argtypes = [i64, ptr]
        lib.gguf_block_shape.restype = i64
        lib.set_kernel_threads.argtypes = [i64]
        lib.set_kernel_threads.restype = None
        lib.kernel_threads_stats.argtypes = [ptr]
        lib.kernel_threads_stats.restype = None
        lib.pin_kernel_most.argtypes = [i64]
        lib.pin_kernel_most.restype = None
        self._torch_threads: int | None = None  # what torch_follows_team last set torch's count to
        self._stats = (ctypes.c_int64 * 8)()
        if os.environ.get("LLMPLAN_THREADS_ADAPT", "1") == "0":
            lib.set_kernel_threads(-1)  # every product on torch's thread count, as before #30

    @property
    def bf16_dot_tiles(self) -> bool:
        """Whether many rows of a `bf16_inputs` product run on the vdpbf16ps tiles too (measured once a process,
        a few ms: faster on a Zen 5, not on an Intel Xeon), else on the rounded x with the exact tiles."""
        return bool(self.lib.bf16_dot_tiles())

    def force_bf16_dot_tiles(self, use: bool | None) -> None:
        """Run many rows on the vdpbf16ps tiles (True) or the exact ones (False) whatever they measure; None:
        measure again on the next product."""
        self.lib.set_bf16_dot_tiles(-1 if use is None else int(use))

    @property
    def int4_integer_tile_rows(self) -> int:
        """The most rows an int4 product takes on the integer tiles (x rounded to 16 bits per group, as one row
        does); more rows, or 0 here (the AVX2 build), take the dequantizing fp32 tiles on x as it is."""
        return int(self.lib.int4_integer_tile_rows())

    def force_int4_integer_tiles(self, use: bool) -> None:
        """Many-row int4 products on the integer tiles (True, the default on AVX-512) or the dequantizing fp32
        tiles (False; the AVX2 build has only these): for A/B runs and the tests that hold both to one answer."""
        self.lib.set_int4_integer_tiles(int(use))

    def set_threads(self, n: int) -> None:
        """Run every product on `n` threads from now on (tests, A/B runs); 0: adapt the count to the machine's
        load again (the default, cpu_kernels.c "Threads on a busy machine"), -1: torch's count, not adapted.
        The most is torch's count again (unpinned: see torch_follows_team)."""
        self.lib.pin_kernel_most(0)
        self._torch_threads = None
        self.lib.set_kernel_threads(n)

    def thread_stats(self) -> dict[str, int]:
        """How the team size adapted so far: its size now, the most (torch's count), fixed (0: adapting),
        drops, raises, and the products timed with the first thread's wait at their ends."""
        out = (ctypes.c_int64 * 8)()
        self.lib.kernel_threads_stats(out)
        names = ("threads", "most", "fixed", "drops", "raises", "products", "product_ns", "wait_ns")
        return dict(zip(names, (int(v) for v in out), strict=True))

    def torch_follows_team(self) -> None:
        """Torch's own thread count follows the adapted team (after each forward pass): torch's ops between
        the passes (sampling over the vocabulary, penalties) split over its threads and meet at barriers just
        as the products did; beside one spinner, a server kept 0.22 of its quiet speed with the kernels on one
        thread and torch on two. A count someone else set (a plan's `threads`) is the most from then on."""
        now = torch.get_num_threads()
        if now != self._torch_threads:
            self.lib.pin_kernel_most(now)
        self.lib.kernel_threads_stats(self._stats)
        team, fixed = int(self._stats[0]), int(self._stats[2])
        if fixed == 0 and team != now:
            torch.set_num_threads(team)
            now = team
        self._torch_threads = now

    @staticmethod
    def supports(x: Tensor, weight: Tensor) -> bool:
        """Whether `x @ weight.T` fits these kernels: CPU tensors, in_features a multiple of 8."""
        k = weight.shape[1]
        return (
            x.device.type == "cpu"
            and weight.device.type == "cpu"
            and weight.is_contiguous()
            and k % 8 == 0
            and x.shape[-1] == k
        )

    def linear_int8(self, x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
        """y = (x @ qweight.T) * scale in fp32; x [..., K], qweight int8 [N, K], scale fp32 [N]."""
        x2, y = _rows(x, qweight.shape[0])
        self._int8(x2.data_ptr(), qweight.data_ptr(), scale.data_ptr(), y.data_ptr(), x2.shape[0], *qweight.shape)
        return _restore(x, y)

    @staticmethod
    def supports_int4(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor) -> bool:
        """Whether the int4 kernel fits: CPU, contiguous fp16 scale/zero, groups a multiple of 32 columns."""
        k = packed.shape[1] * 2
        groups = scale.shape[1]
        return (
            x.device.type == "cpu"
            and packed.device.type == "cpu"
            and all(t.is_contiguous() for t in (packed, scale, zero))
            and scale.dtype == zero.dtype == torch.float16
            and k % groups == 0
            and (k // groups) % 32 == 0
            and x.shape[-1] == k
        )

    def linear_int4(self, x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
        """y = x @ dequantize(Int4Weight(packed, scale, zero)).T in fp32, without dequantizing in memory."""
        n, k = packed.shape[0], packed.shape[1] * 2
        x2, y = _rows(x, n)
        ptrs = (x2.data_ptr(), packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), y.data_ptr())
        self._int4(*ptrs, x2.shape[0], n, k, k // scale.shape[1])
        return _restore(x, y)

    def linear_f32(self, x: Tensor, weight: Tensor) -> Tensor:
        """y = x @ weight.T in fp32; x [..., K], weight fp32 [N, K]."""
        x2, y = _rows(x, weight.shape[0])
        self._f32(x2.data_ptr(), weight.data_ptr(), y.data_ptr(), x2.shape[0], *weight.shape)
        return _restore(x, y)

    def linear_half(self, x: Tensor, weight: Tensor, bf16_inputs: bool = False) -> Tensor:
        """y = x @ weight.T in fp32 for a bf16 or fp16 weight [N, K], widened in registers (exact); with
        `bf16_inputs` (a bf16 weight) x is first rounded to bf16, as torch's and llama.cpp's bf16 products do,
        and the products run on vdpbf16ps where the CPU has it (`bf16_dot`)."""
        if weight.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"linear_half takes a bf16 or fp16 weight, not {weight.dtype}")
        if bf16_inputs and weight.dtype != torch.bfloat16:
            raise TypeError(f"bf16_inputs takes a bf16 weight, not {weight.dtype}")
        x2, y = _rows(x, weight.shape[0])
        fmt = HALF_BF16_INPUTS if bf16_inputs else HALF_F16 if weight.dtype == torch.float16 else HALF_BF16
        self._half(x2.data_ptr(), weight.data_ptr(), y.data_ptr(), x2.shape[0], *weight.shape, fmt)
        return _restore(x, y)

    def gguf_block_shape(self, qtype: int) -> tuple[int, int] | None:
        """(elements, bytes) of a block of GGML type `qtype` as gguf_blocks.c reads it; None for a type it
        does not know."""
        out = (ctypes.c_int64 * 2)()
        return (int(out[0]), int(out[1])) if self.lib.gguf_block_shape(qtype, out) else None

    def _gguf_rows_bytes(self, blocks: Tensor, qtype: int, n: int, k: int) -> None:
        """Refuse, in Python, blocks that are not N whole rows of `qtype` blocks over K columns."""
        shape = self.gguf_block_shape(qtype)
        if shape is None:
            raise ValueError(f"GGUF block type {qtype} is not one the native kernels read")
        elements, nbytes = shape
        if k <= 0 or n <= 0 or k % elements:
            raise ValueError(f"GGUF type {qtype}: K={k} must be a positive multiple of its {elements}-column blocks")
        if blocks.dtype != torch.uint8 or blocks.device.type != "cpu" or not blocks.is_contiguous():
            raise ValueError("GGUF blocks must be a contiguous uint8 CPU tensor")
        if blocks.numel() != n * (k // elements) * nbytes:
            raise ValueError(f"GGUF blocks: {blocks.numel()} bytes, expected {n * (k // elements) * nbytes}")

    def gguf_linear(self, x: Tensor, blocks: Tensor, qtype: int, n: int, k: int, xbits: int = 8) -> Tensor:
        """y = x @ W.T in fp32 for W [n, k] stored as GGUF blocks of `qtype` (uint8, the file's bytes). The
        quantized types round x per 32 columns: xbits 8 to int8 (llama.cpp's Q8_0 activations), 16 in two int8
        passes (see gguf_blocks.c; from 4 to 8 rows by type on gguf_panels.c's panels on AVX-512, the same rounding);
        F32/F16/BF16 run on linear_f32/linear_half, exact."""
        if xbits not in (8, 16):
            raise ValueError(f"GGUF activation bits must be 8 or 16, not {xbits}")
        self._gguf_rows_bytes(blocks, qtype, n, k)
        if x.shape[-1] != k:
            raise ValueError(f"gguf_linear: x has {x.shape[-1]} columns, the weight {k}")
        if qtype in _GGUF_FLOATS:
            return self._gguf_float(x, blocks, _GGUF_FLOATS[qtype], n, k)
        x2, y = _rows(x, n)
        if self._gguf(qtype, blocks.data_ptr(), x2.data_ptr(), y.data_ptr(), x2.shape[0], n, k, xbits):
            raise MemoryError("gguf_linear: no memory for the rounded activations or a row's scratch")
        return _restore(x, y)

    def _gguf_float(self, x: Tensor, blocks: Tensor, dtype: torch.dtype, n: int, k: int) -> Tensor:
        weight = blocks.view(dtype).view(n, k)
        if dtype == torch.float32 and k % 8 == 0:
            return self.linear_f32(x, weight)
        if k % 8 == 0:
            return self.linear_half(x, weight)
        return (x.to(torch.float32) @ weight.to(torch.float32).T).to(x.dtype)  # the kernels need K % 8 == 0

    def gguf_dequantize(self, blocks: Tensor, qtype: int, n: int, k: int) -> Tensor:
        """fp32 [n, k] of GGUF blocks, equal to gguf-py's `quants.dequantize` (for embeddings, and as a fallback)."""
        self._gguf_rows_bytes(blocks, qtype, n, k)
        out = torch.empty(n, k, dtype=torch.float32)
        if self._gguf_rows(qtype, blocks.data_ptr(), out.data_ptr(), n, k):
            raise MemoryError("gguf_dequantize: no memory for a row's scratch")
        return out

    def quantize_int8(self, w: Tensor) -> tuple[Tensor, Tensor] | None:
        """(codes int8 [N, K], scale fp32 [N]) of a 2-D CPU tensor, bit-identical to the torch version;
        None when w holds NaN or infinity (the torch version decides what those become)."""
        w = w.to(torch.float32).contiguous()
        n, k = w.shape
        q = torch.empty(n, k, dtype=torch.int8)
        scale = torch.empty(n, dtype=torch.float32)
        if self._quantize(w.data_ptr(), q.data_ptr(), scale.data_ptr(), n, k):
            return None
        return q, scale

    def quantize_int4(self, w: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """(packed uint8 [N, K/2], scale fp16, zero fp16 [N, K/group]), bit-identical to the torch version;
        None when w holds NaN, infinity or values beyond fp16 (the torch version decides what those mean)."""
        w = w.to(torch.float32).contiguous()
        n, k = w.shape
        packed = torch.empty(n, k // 2, dtype=torch.uint8)
        scale = torch.empty(n, k // group, dtype=torch.float16)
        zero = torch.empty(n, k // group, dtype=torch.float16)
        ptrs = (w.data_ptr(), packed.data_ptr(), scale.data_ptr(), zero.data_ptr())
        if self._quantize4(*ptrs, n, k, group):
            return None
        return packed, scale, zero

    def apply_token_bitmask(self, logits: Tensor, bits: Tensor) -> int:
        """Set to -inf, in place, the fp32 CPU logits [V] whose bit is clear in `bits` (int32 [ceil(V / 32)],
        llguidance's layout); the count of tokens left allowed."""
        if logits.dtype != torch.float32 or not logits.is_contiguous() or logits.device.type != "cpu":
            raise ValueError("apply_token_bitmask: logits must be contiguous fp32 on the CPU")
        if bits.dtype != torch.int32 or bits.numel() * 32 < logits.numel() or not bits.is_contiguous():
            raise ValueError(f"apply_token_bitmask: bits must be int32 [>= {(logits.numel() + 31) // 32}]")
        return int(self._bitmask(logits.data_ptr(), bits.data_ptr(), logits.numel()))

    def greedy_pick(self, logits: Tensor) -> tuple[int, float] | None:
        """The first maximum of fp32 CPU logits [V] and its log-softmax, in one native call; None where the row
        holds a NaN or an infinity (the caller's torch path handles those)."""
        if logits.dtype != torch.float32 or not logits.is_contiguous() or logits.device.type != "cpu":
            raise ValueError("greedy_pick: logits must be contiguous fp32 on the CPU")
        logprob = ctypes.c_float()
        token = int(self._greedy(logits.data_ptr(), logits.numel(), ctypes.byref(logprob)))
        return None if token < 0 else (token, logprob.value)

    def int8_error_terms(self, w: Tensor, qweight: Tensor, scale: Tensor, row_step: int) -> tuple[float, float]:
        """(sum (w - q * scale)^2, sum w^2) over every `row_step`-th row of a 2-D weight."""
        w = w.to(torch.float32).contiguous()
        out = torch.zeros(2, dtype=torch.float64)
        scale = scale.to(torch.float32).contiguous()
        self._error_terms(w.data_ptr(), qweight.data_ptr(), scale.data_ptr(), *w.shape, row_step, out.data_ptr())
        return float(out[0]), float(out[1])


def _rows(x: Tensor, out_features: int) -> tuple[Tensor, Tensor]:
    """x [..., K] as contiguous fp32 rows [M, K], and the fp32 output [M, out_features] the kernel fills."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()
    return x2, torch.empty(x2.shape[0], out_features, dtype=torch.float32)


def _restore(x: Tensor, y: Tensor) -> Tensor:
    """y [M, N] back to x's leading dims and dtype."""
    return y.view(*x.shape[:-1], y.shape[1]).to(x.dtype)


def kernels() -> NativeKernels | None:
    """The loaded kernels, building them on first use; None where they cannot run (see the module doc)."""
    global _loaded, _reason, _tried
    if _tried:
        return _loaded
    with _lock:
        if not _tried:
            try:
                _loaded = _load()
            except NativeUnavailable as why:
                _reason = str(why)
            _tried = True
    return _loaded


def unavailable_reason() -> str | None:
    """Why `kernels()` is None (after it was called), else None."""
    return _reason


def isa_note() -> str | None:
    """Why the loaded kernels are not the widest build this CPU could run (forced, or a failed build), else None."""
    return _note


def describe() -> str:
    """One line for the run's env metrics: the path taken and why, or why there is none."""
    fast = kernels()
    if fast is None:
        return f"unavailable: {unavailable_reason()}"
    note = f"; {_note}" if _note else ""
    return f"available: {fast.isa} ({fast.path.name}{note})"


def cpu_has(isa: str) -> bool:
    """Whether this CPU (and OS) can run the `isa` build; False where the native kernels cannot load at all."""
    base = kernels_for("avx2")
    need = {"avx2": FEATURE_AVX2, "avx512": FEATURE_AVX512 | FEATURE_VNNI}[isa]
    return base is not None and base.features & need == need


def kernels_for(isa: str) -> NativeKernels | None:
    """The `isa` build (tests run every kernel on both paths), loaded once; None where this CPU cannot run it
    or it cannot be built. Independent of `LLMPLAN_ISA` and of which build `kernels()` chose."""
    if isa not in ISAS:
        raise ValueError(f"isa: expected one of {', '.join(ISAS)}, got {isa!r}")
    with _lock:
        if isa not in _by_isa:
            try:
                _by_isa[isa] = _load_isa(isa)
            except NativeUnavailable:
                _by_isa[isa] = None
        return _by_isa[isa]


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be used here; the message says why."""


def _load() -> NativeKernels:
    """The build to use: AVX-512 where the CPU has it (F/BW/VL/DQ and VNNI) unless LLMPLAN_ISA says avx2."""
    global _note
    _note = None
    if os.environ.get("LLMPLAN_NATIVE", "1") == "0":
        raise NativeUnavailable("disabled by LLMPLAN_NATIVE=0")
    want = os.environ.get("LLMPLAN_ISA", "auto").strip().lower() or "auto"
    if want not in ("auto", *ISAS):
        raise NativeUnavailable(f"LLMPLAN_ISA={want!r}: expected auto, {' or '.join(ISAS)}")
    base = _load_isa("avx2")
    if want == "avx2":
        _note = "forced by LLMPLAN_ISA=avx2"
        return base
    need = FEATURE_AVX512 | FEATURE_VNNI
    if base.features & need != need:
        if want == "avx512":
            _note = "LLMPLAN_ISA=avx512, but this CPU lacks AVX-512 F/BW/VL/DQ or VNNI"
        return base
    try:
        return _load_isa("avx512")
    except NativeUnavailable as why:  # e.g. a compiler too old for -mavx512bf16: the AVX2 build still runs
        _note = f"the AVX-512 build failed, so AVX2: {why}"
        return base


def _load_isa(isa: str) -> NativeKernels:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise NativeUnavailable(f"needs an AVX2 CPU (torch reports {capability})")
    path = build(isa)
    try:
        return NativeKernels(ctypes.CDLL(str(path)), path)
    except OSError as err:
        raise NativeUnavailable(f"cannot load {path}: {err}") from None


def _names() -> str:
    return " and ".join(path.name for path in SOURCES)


def cache_dir() -> Path:
    root = os.environ.get("LLMPLAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmplan")
    return Path(root) / "kernels"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build(isa: str = "avx2") -> Path:
    """Compile the source for `isa` unless a build of this exact source (and flags) is cached; the .so path."""
    flags = (*FLAGS, *ISAS[isa])
    source = b"".join(path.read_bytes() for path in SOURCES)
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{isa}-{digest}.so"
    if target.exists():
        return target
    cc = compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler on PATH (set CC, or install gcc)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".cpu_kernels-", suffix=".so", dir=target.parent)
    except OSError as err:  # a read-only cache: run on torch's kernels rather than fail the load
        raise NativeUnavailable(f"cannot write to {target.parent}: {err.strerror or err}") from None
    os.close(fd)
    try:
        sources = [str(path) for path in SOURCES]
        done = subprocess.run([cc, *flags, *sources, "-o", tmp, *LIBS], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise NativeUnavailable(f"{cc} failed to build {_names()}: {first}")
        os.replace(tmp, target)  # atomic: a concurrent reader sees no file or a whole one
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NativeUnavailable(f"{cc} failed to build {_names()}: {err}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
