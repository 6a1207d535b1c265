"""The GGUF block kernels (llm/kernels/gguf_blocks.c, gguf_panels.c) against gguf-py's dequantizer and float64
products.

Tolerance. The kernels round each activation row per 32 columns to int8 (scale d = amax / 127, nearest, ties
to even) and sum integer products, so they are compared in two ways:
- against the product of the *rounded* activations (`_round_x`, the same fp32 operations as the C code, so
  the same int8 values) and gguf-py's dequantized weights in float64: the kernel then differs only by fp32
  rounding of the scales and sums, bounded by 1e-5 * sum |x_rounded| |w| per output (fp32 error over K / 16
  partial sums plus the weights' own rounding, ~1e-7 * K / 16 relative; a wrong scale index or nibble is an
  O(1) error and fails);
- against the exact product of x: the rounding moves each x by at most d / 2 = amax_block / 254, so the
  error is bounded by sum over blocks of amax_block / 254 * sum_block |w| (plus the 1e-5 term above), which
  the test asserts as well (a bound, not an estimate: typically it is ~sqrt(32) times smaller).
On AVX-512, 8 or more activation rows of every quantized type run on panels (gguf_panels.c), 6 or more of Q8_0
and Q5_0, 4 or more of Q4_K and Q6_K (below that the K-quants' and Q8_0's row form sums each group in integers):
the same rounded x, another order of the fp32 sums, so a row's result there equals its one-row product within
the fp32 room, and bitwise any other batch's on the same path.
The dequantized rows equal gguf-py's exactly (same fp32 operations, unfused).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from tiny_gguf import random_blocks

from llmplan.llm.formats.gguf import BY_NAME
from llmplan.llm.formats.gguf.block_types import BLOCK_TYPES, block_type
from llmplan.llm.kernels import native

FAST = native.kernels()
needs_native = pytest.mark.skipif(FAST is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")

QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
def _reference(raw: np.ndarray, name: str, k: int) -> np.ndarray:
    return quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(raw.shape[0], k)


def _round_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded as gguf_blocks.c's quantize_row does (fp32 amax / 127, 1 / d, round half even): the rounded x
    in float64, and each 32-column block's amax broadcast to its columns."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv)
    rounded = (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)
    return rounded, np.broadcast_to(amax, blocks.shape).reshape(x.shape).astype(np.float64)


def _k_for(name: str) -> int:
    return 256 * 3 if name.endswith("_K") else 32 * 7


@needs_native
def test_the_table_agrees_with_gguf_py_and_the_kernels() -> None:
    for t in BLOCK_TYPES.values():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)] == (t.block_size, t.type_size)
        assert gguf.GGMLQuantizationType(t.ggml_type).name == t.name
        assert FAST.gguf_block_shape(t.ggml_type) == (t.block_size, t.type_size)


@needs_native
@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 16, 33])
def test_product_equals_dequantize_then_float64_matmul(isa_path: native.NativeKernels, name: str, rows: int) -> None:
    n, k = 37, _k_for(name)
    raw = random_blocks(name, n, k, seed=rows)
    w = _reference(raw, name, k).astype(np.float64)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    got = isa_path.gguf_linear(x, torch.from_numpy(raw), BY_NAME[name].ggml_type, n, k).double().numpy()
    rounded, amax = _round_x(x.numpy())
    fp32_room = 1e-5 * (np.abs(rounded) @ np.abs(w).T)
    assert np.all(np.abs(got - rounded @ w.T) <= fp32_room)
    bound = (amax / 254) @ np.abs(w).T + fp32_room  # each x moved by at most amax / 254
    assert np.all(np.abs(got - x.double().numpy() @ w.T) <= bound)


@needs_native
@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantized_rows_equal_gguf_py(isa_path: native.NativeKernels, name: str) -> None:
    n, k = 37, _k_for(name)
    raw = random_blocks(name, n, k, seed=7)
    got = isa_path.gguf_dequantize(torch.from_numpy(raw), BY_NAME[name].ggml_type, n, k).numpy()
    assert np.array_equal(got, _reference(raw, name, k))


@needs_native
def test_real_quantized_weights_from_gguf_py(isa_path: native.NativeKernels) -> None:
    """gguf-py's own Q8_0/Q4_0/... quantizer output (not random bytes) runs the same."""
    w = np.random.default_rng(3).standard_normal((37, 32 * 7)).astype(np.float32)
    x = torch.randn(3, 32 * 7, generator=torch.Generator().manual_seed(3))
    for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        raw = quants.quantize(w, gguf.GGMLQuantizationType[name])
        ref = _reference(raw, name, 32 * 7).astype(np.float64)
        got = isa_path.gguf_linear(x, torch.from_numpy(raw), BY_NAME[name].ggml_type, 37, 32 * 7).double().numpy()
        rounded, _ = _round_x(x.numpy())
        assert np.all(np.abs(got - rounded @ ref.T) <= 1e-5 * (np.abs(rounded) @ np.abs(ref).T))


@needs_native
@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types_run_exactly(isa_path: native.NativeKernels, name: str) -> None:
    n, k = 37, 32 * 7
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
    w = torch.randn(n, k).to(dtype)
    raw = w.contiguous().view(torch.uint8).reshape(n, -1)
    x = torch.randn(3, k)
    want = x.double() @ w.double().T
    got = isa_path.gguf_linear(x, raw, BY_NAME[name].ggml_type, n, k).double()
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.equal(isa_path.gguf_dequantize(raw, BY_NAME[name].ggml_type, n, k), w.float())


@needs_native
def test_leading_dims_and_dtype_are_kept(isa_path: native.NativeKernels) -> None:
    raw = torch.from_numpy(random_blocks("Q8_0", 5, 64, seed=1))
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    y = isa_path.gguf_linear(x, raw, 8, 5, 64)
    assert y.shape == (2, 3, 5) and y.dtype == torch.bfloat16


@needs_native
def test_unknown_types_and_wrong_shapes_are_refused_in_python() -> None:
    raw = torch.zeros(4, 34, dtype=torch.uint8)
    x = torch.randn(1, 32)
    q2_k = int(gguf.GGMLQuantizationType.Q2_K)
    with pytest.raises(ValueError, match=f"GGUF block type {q2_k} is not one the native kernels read"):
        FAST.gguf_linear(x, raw, q2_k, 4, 32)
    with pytest.raises(ValueError, match="no native block kernel"):
        block_type(q2_k)
    with pytest.raises(ValueError, match="multiple of its 32-column blocks"):
        FAST.gguf_linear(torch.randn(1, 48), raw, 8, 4, 48)
    with pytest.raises(ValueError, match="bytes, expected"):
        FAST.gguf_linear(torch.randn(1, 64), raw, 8, 4, 64)
    with pytest.raises(ValueError, match="contiguous uint8"):
        FAST.gguf_linear(x, raw.to(torch.int8), 8, 4, 32)
    with pytest.raises(ValueError, match="columns"):
        FAST.gguf_linear(torch.randn(1, 64), raw, 8, 4, 32)
    with pytest.raises(ValueError, match="not whole"):
        BY_NAME["Q4_K"].row_bytes(300)


@needs_native
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_long_rows_in_several_chunks_of_activation_rows(isa_path: native.NativeKernels, name: str) -> None:
    """K = 8960 (Qwen2.5-1.5B's MLP): 40 rows take two passes over the weights in the row form (32 rows a chunk of
    512 KiB of rounded rows); each row's result is bitwise the same row's in another batch on the same path (16
    rows: panels on AVX-512, the row form on AVX2) and within the fp32 room of the one-row product."""
    n, k, rows = 5, 8960, 40
    raw = random_blocks(name, n, k, seed=5)
    w = _reference(raw, name, k).astype(np.float64)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5))
    qtype = BY_NAME[name].ggml_type
    got = isa_path.gguf_linear(x, torch.from_numpy(raw), qtype, n, k)
    rounded, _ = _round_x(x.numpy())
    room = 1e-5 * (np.abs(rounded) @ np.abs(w).T)
    assert np.all(np.abs(got.double().numpy() - rounded @ w.T) <= room)
    for r in (0, 37, 39):
        at = min(r, rows - 16)
        other = isa_path.gguf_linear(x[at : at + 16], torch.from_numpy(raw), qtype, n, k)
        assert torch.equal(got[r], other[r - at])
        one = isa_path.gguf_linear(x[r : r + 1], torch.from_numpy(raw), qtype, n, k)[0].double().numpy()
        assert np.all(np.abs(one - got[r].double().numpy()) <= room[r])


@needs_native
@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("rows", [1, 3, 16, 33])
def test_sixteen_bit_activations_are_two_int8_passes(isa_path: native.NativeKernels, name: str, rows: int) -> None:
    """xbits 16: x rounded per 32 columns, then what that left out (|r| <= amax / 254) rounded again with its
    own scale, the two products summed: x is off by at most amax / 254^2 (~15 bits), and the result is far
    closer to the exact product than one int8 pass (the same rows, the same weights)."""
    n, k = 37, _k_for(name)
    raw = torch.from_numpy(random_blocks(name, n, k, seed=rows))
    w = _reference(raw.numpy(), name, k).astype(np.float64)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    exact = x.double().numpy() @ w.T
    qtype = BY_NAME[name].ggml_type
    got = isa_path.gguf_linear(x, raw, qtype, n, k, xbits=16).double().numpy()
    _, amax = _round_x(x.numpy())
    fp32_room = 1e-5 * (np.abs(x.double().numpy()) @ np.abs(w).T)
    assert np.all(np.abs(got - exact) <= (amax / 254**2) @ np.abs(w).T + fp32_room)
    one_pass = isa_path.gguf_linear(x, raw, qtype, n, k, xbits=8).double().numpy()
    assert np.abs(got - exact).max() * 20 < np.abs(one_pass - exact).max()


@needs_native
def test_sixteen_bit_rows_in_several_chunks(isa_path: native.NativeKernels) -> None:
    """40 rows of K = 8960 are 80 rounded rows in pairs, over a panel's passes of 4 (AVX-512) or three chunks
    (AVX2): a pair never straddles two, so each row's result is bitwise the same row's in a batch of 8 (16 rounded
    rows: the same path)."""
    n, k, rows = 5, 8960, 40
    for name in ("Q4_K", "Q8_0"):
        raw = torch.from_numpy(random_blocks(name, n, k, seed=5))
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5))
        qtype = BY_NAME[name].ggml_type
        got = isa_path.gguf_linear(x, raw, qtype, n, k, xbits=16)
        for r in (0, 17, 18, 39):
            at = min(r, rows - 8)
            assert torch.equal(got[r], isa_path.gguf_linear(x[at : at + 8], raw, qtype, n, k, xbits=16)[r - at])


@needs_native
@pytest.mark.parametrize(("name", "k"), [("Q4_K", 256 * 6), ("Q5_K", 256 * 6), ("Q6_K", 256 * 6), ("Q8_0", 640)])
def test_integer_row_form_is_the_same_in_any_small_batch(isa_path: native.NativeKernels, name: str, k: int) -> None:
    """Up to 3 rows (Q8_0: 5, Q5_K: 7) the K-quants and Q8_0 run their row form (on AVX-512 kq_rows: columns
    transposed so a lane sums its 16-column group in integers; Q8_0's codes unsigned, the offset off in integers;
    K = 640 leaves half of its last superblock's blocks missing): each row's result is bitwise its one-row product,
    in a batch of 3 or 2, and within the fp32 room of the float64 product of its rounded x."""
    n = 37
    raw = random_blocks(name, n, k, seed=11)
    w = _reference(raw, name, k).astype(np.float64)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(11)) * 3
    qtype = BY_NAME[name].ggml_type
    got = isa_path.gguf_linear(x, torch.from_numpy(raw), qtype, n, k)
    rounded, _ = _round_x(x.numpy())
    assert np.all(np.abs(got.double().numpy() - rounded @ w.T) <= 1e-5 * (np.abs(rounded) @ np.abs(w).T))
    two = isa_path.gguf_linear(x[1:3], torch.from_numpy(raw), qtype, n, k)
    assert torch.equal(got[1:3], two)
    for r in range(3):
        assert torch.equal(got[r], isa_path.gguf_linear(x[r : r + 1], torch.from_numpy(raw), qtype, n, k)[0])


def test_activation_bits_other_than_8_or_16_are_refused() -> None:
    if FAST is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    with pytest.raises(ValueError, match="8 or 16, not 12"):
        FAST.gguf_linear(torch.randn(1, 32), torch.zeros(1, 34, dtype=torch.uint8), 8, 1, 32, xbits=12)
