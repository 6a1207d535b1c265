"""The native decode kernels (llm/kernels/cpu_kernels.c) against float64 products, and how they are built and loaded.

Tolerance: the kernels multiply and accumulate in fp32 like the reference, in another order (8 lanes,
then a horizontal sum), so they differ from the float64 product by fp32 rounding over K terms:
~K * 2^-24 relative in the worst case, ~1e-7 typically. 1e-5 relative to the output's scale leaves room
for K up to a few thousand without letting a wrong index (an O(1) error) pass. The one-row int4 kernel
rounds x to 16 bits per group first: its reference rounds x the same way (`_round_x16`), and a test of its
own bounds what the rounding costs against the unrounded product.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from llmplan.llm.kernels import native
from llmplan.llm.model import make_linear, quantize_weight
from llmplan.llm.model.linear import Int8Linear

FAST = native.kernels()
needs_native = pytest.mark.skipif(FAST is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")
# The tests marked needs_native take `isa_path` (tests/llm/conftest.py): they run on the AVX2 and the AVX-512
# build, and native.kernels() returns that build meanwhile (the modules' own dispatch included).


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 1e-5 * scale


# rows: 1 (the one-row kernel), 2..5 and 16 (the 3x4 / 4x6 register tiles with a partial last tile), 130
# (chunks of 96 activation rows and a partial one); N not a multiple of the 4- or 3-row blocks; K = 24 is a
# multiple of 8 but not 16 (the one-row kernel's tail, the AVX-512 masked tail), 1536 is SmolLM2's MLP
@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 130])
@pytest.mark.parametrize(("n", "k"), [(70, 24), (9, 1536), (4, 8)])
def test_int8_kernel_equals_the_exact_product(isa_path: native.NativeKernels, rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, generator=gen) + 0.01
    x = torch.randn(rows, k, generator=gen)
    want = (x.double() @ qweight.double().T) * scale.double()
    _close(isa_path.linear_int8(x, qweight, scale), want)


# K = 2072: the tiles' column blocks of 1024 (KC_F32), the last of 24 columns with the 8-column tail
@needs_native
@pytest.mark.parametrize("rows", [1, 3, 16, 130])
@pytest.mark.parametrize(("n", "k"), [(70, 24), (1027, 576), (33, 2072)])
def test_f32_kernel_equals_the_exact_product(isa_path: native.NativeKernels, rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    _close(isa_path.linear_f32(x, w), x.double() @ w.double().T)


# bf16 and fp16 weights are widened to fp32 exactly, so the kernel is the exact product of the 16-bit values
# (same tolerance as fp32). rows 600: more than one chunk of activation rows at K = 1536 where L2 is small.
@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 130, 600])
@pytest.mark.parametrize(("n", "k"), [(70, 24), (9, 1536)])
def test_half_kernels_equal_the_exact_product(
    isa_path: native.NativeKernels, dtype: torch.dtype, rows: int, n: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + n)
    w, x = torch.randn(n, k, generator=gen).to(dtype), torch.randn(rows, k, generator=gen)
    _close(isa_path.linear_half(x, w), x.double() @ w.double().T)


# bf16 inputs: x rounded to bf16 (nearest even, as torch casts), so each product is exact and only the fp32
# sums' order differs: the tolerance above, against the float64 product of the rounded x. K covers every tail
# of the 64-column steps (24: a part only; 40: a part after a full 32; 104: 64 + 32 + 8; 576: whole steps);
# rows cover one row, the few-rows groups (2, 5, 8), the tiles (9, 16, 130) and several chunks (600); 4136: the
# tiles' column blocks of 2048, the last of 40 columns.
@needs_native
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 130, 600])
@pytest.mark.parametrize(("n", "k"), [(70, 24), (33, 40), (5, 104), (1027, 576), (9, 1536), (7, 4136)])
def test_bf16_inputs_kernel_equals_the_exact_product_of_rounded_inputs(
    isa_path: native.NativeKernels, rows: int, n: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(rows * 13 + n)
    w, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(rows, k, generator=gen)
    _close(isa_path.linear_half(x, w, bf16_inputs=True), x.bfloat16().double() @ w.double().T)


# Many rows run on the vdpbf16ps tiles or on the rounded x with the exact tiles, whichever this CPU measured
# faster (`bf16_dot_tiles`): both give the exact product of the rounded inputs up to the sums' order, and a few
# rows keep vdpbf16ps whatever the choice (their sums stay bitwise the one-row kernel's).
@needs_native
@pytest.mark.parametrize("tiles", [True, False])
def test_bf16_inputs_tiles_either_way_equal_the_exact_product(isa_path: native.NativeKernels, tiles: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(1027, 4136, generator=gen).bfloat16(), torch.randn(130, 4136, generator=gen)
    want = x.bfloat16().double() @ w.double().T
    one = isa_path.linear_half(x[:1], w, bf16_inputs=True)
    try:
        isa_path.force_bf16_dot_tiles(tiles)
        assert isa_path.bf16_dot_tiles is (tiles and isa_path.bf16_dot)
        _close(isa_path.linear_half(x, w, bf16_inputs=True), want)
        assert torch.equal(isa_path.linear_half(x[:3], w, bf16_inputs=True)[:1], one)
    finally:
        isa_path.force_bf16_dot_tiles(None)
    assert isinstance(isa_path.bf16_dot_tiles, bool)  # measured again
    assert isa_path.bf16_dot or not isa_path.bf16_dot_tiles


@needs_native
def test_bf16_inputs_round_x_and_pass_non_finite_values_on(isa_path: native.NativeKernels) -> None:
    w = torch.ones(4, 64, dtype=torch.bfloat16)
    x = torch.full((1, 64), 1.0 + 2.0**-9)  # halfway between two bf16 values: rounds to even, 1.0
    assert torch.equal(isa_path.linear_half(x, w, bf16_inputs=True), torch.full((1, 4), 64.0))
    x[0, 5] = float("nan")
    assert isa_path.linear_half(x, w, bf16_inputs=True).isnan().all()
    x[0, 5] = float("inf")
    assert isa_path.linear_half(x, w, bf16_inputs=True).isinf().all()


# A few activation rows (a decode row and its speculative guesses) must give each row exactly what a one-row
# product gives it: verification then sees the logits a plain decode step would, so greedy answers cannot
# part at a near-tie. 2..8 rows take the few-rows kernel (groups of 6 or 2 rows, int4 4 or 2, an odd last
# group); 9 rows the tiled one, which may differ (it is only checked against the exact product above).
@needs_native
@pytest.mark.parametrize("kind", ["int8", "f32", "bf16", "f16", "int4", "bf16-inputs"])
@pytest.mark.parametrize("rows", [2, 3, 5, 7, 8])
@pytest.mark.parametrize(("n", "k"), [(70, 24), (9, 1536), (1027, 576), (33, 104)])
def test_a_few_rows_are_bitwise_the_one_row_products(
    isa_path: native.NativeKernels, kind: str, rows: int, n: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(rows * 31 + n)
    x = torch.randn(rows, k, generator=gen)
    if kind == "int8":
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        scale = torch.rand(n, generator=gen) + 0.01
        product = lambda a: isa_path.linear_int8(a, qweight, scale)  # noqa: E731
    elif kind == "int4":  # groups of 32 columns: K rounded up to whole groups, 64 (two groups) at least
        q = quantize_weight(torch.randn(n, max(64, -(-k // 32) * 32), generator=gen), "int4", 32)
        x = torch.randn(rows, max(64, -(-k // 32) * 32), generator=gen)
        product = lambda a: isa_path.linear_int4(a, q.packed, q.scale, q.zero)  # noqa: E731
    elif kind == "bf16-inputs":
        wb = torch.randn(n, k, generator=gen).bfloat16()
        product = lambda a: isa_path.linear_half(a, wb, bf16_inputs=True)  # noqa: E731
    else:
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[kind]
        w = torch.randn(n, k, generator=gen).to(dtype)
        product = (lambda a: isa_path.linear_f32(a, w)) if kind == "f32" else (lambda a: isa_path.linear_half(a, w))
    together = product(x)
    alone = torch.cat([product(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)


@needs_native
def test_half_kernel_refuses_other_weights(isa_path: native.NativeKernels) -> None:
    with pytest.raises(TypeError, match="bf16 or fp16"):
        isa_path.linear_half(torch.randn(1, 8), torch.randn(4, 8))


@needs_native
def test_bf16_and_fp16_modules_take_the_native_path(isa_path: native.NativeKernels) -> None:
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        w = torch.randn(48, 64).to(dtype)
        module = make_linear(w, "auto")
        module.prepack()
        assert module.path == f"native-{isa_path.isa}-{name}"
        x = torch.randn(3, 64)
        _close(module(x), x.double() @ w.double().T)


@needs_native
def test_bf16_inputs_modules_name_their_path_and_keep_the_reference(isa_path: native.NativeKernels) -> None:
    w = torch.randn(48, 64).bfloat16()
    module = make_linear(w, "auto", bf16_inputs=True)
    module.prepack()
    dot = isa_path.isa == "avx512" and bool(isa_path.features & native.FEATURE_BF16)
    assert module.path == ("native-avx512-bf16dot" if dot else f"native-{isa_path.isa}-bf16-xround")
    x = torch.randn(3, 64)
    want = x.bfloat16().double() @ w.double().T
    _close(module(x), want)
    _close(make_linear(w, "reference", bf16_inputs=True)(x), want)  # the oracle rounds x the same way
    # other weights ignore the flag; a bf16 module cast to fp32 drops it (its weight is no longer bf16)
    assert make_linear(torch.randn(8, 16), "auto", bf16_inputs=True).bf16_inputs is False
    module.float().prepack()
    assert module.path == f"native-{isa_path.isa}-f32"


@needs_native
def test_leading_dims_and_dtype_are_kept(isa_path: native.NativeKernels) -> None:
    w = torch.randn(12, 16)
    x = torch.randn(2, 3, 16).bfloat16()
    y = isa_path.linear_f32(x, w)
    assert y.shape == (2, 3, 12) and y.dtype == torch.bfloat16


@needs_native
def test_modules_take_the_native_path_only_where_it_fits(isa_path: native.NativeKernels) -> None:
    q = quantize_weight(torch.randn(40, 20), "int8")  # K = 20: not a multiple of 8
    assert not isa_path.supports(torch.randn(1, 20), q.qweight)
    module, reference = make_linear(q, "auto"), make_linear(q, "reference")
    x = torch.randn(3, 20)
    torch.testing.assert_close(module(x), reference(x))  # torch's int8 kernel is wrong at K % 8 != 0: not used
    q = quantize_weight(torch.randn(40, 32), "int8")
    assert isa_path.supports(torch.randn(300, 32), q.qweight)  # prefill too
    assert not isa_path.supports(torch.randn(3, 32), q.qweight.t())  # a transposed view: not row-major
    module = make_linear(q, "auto")
    assert isinstance(module, Int8Linear)
    x = torch.randn(2, 32)
    _close(module(x), (x.double() @ q.qweight.double().T) * q.scale.double())


@needs_native
def test_the_library_shares_torchs_openmp_runtime(isa_path: native.NativeKernels) -> None:
    # Two OpenMP runtimes in one process would each keep a pool of spinning threads on 2 cores.
    maps = Path(f"/proc/{os.getpid()}/maps")
    if not maps.exists():
        pytest.skip("no /proc on this system")
    gomp = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    assert len(gomp) <= 1, gomp


def test_build_is_cached_by_source_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if native.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("LLMPLAN_CACHE", str(tmp_path))
    first = native.build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind


def test_an_unwritable_cache_is_a_reason_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if native.compiler() is None:
        pytest.skip("no C compiler")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("LLMPLAN_CACHE", str(blocker))  # kernels/ cannot be made under a file
    with pytest.raises(native.NativeUnavailable, match="cannot write to"):
        native.build()


def test_disabled_or_without_a_compiler_it_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMPLAN_NATIVE", "0")
    with pytest.raises(native.NativeUnavailable, match="LLMPLAN_NATIVE=0"):
        native._load()
    monkeypatch.delenv("LLMPLAN_NATIVE")
    monkeypatch.setenv("LLMPLAN_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler reachable
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(native.NativeUnavailable, match="no C compiler"):
        native.build()


def _torch_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


@needs_native
@pytest.mark.parametrize("shape", [(64, 576), (7, 1539), (3, 5)])  # vector body, a tail, a tail only
def test_native_quantization_is_bit_identical_to_torchs(isa_path: native.NativeKernels, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(shape[1])
    w = torch.randn(*shape, generator=gen) * (torch.rand(shape[0], 1, generator=gen) * 3)
    w[0] = 0  # an all-zero row: scale 1
    step = w[-1].abs().max() / 127
    w[-1, :3] = torch.tensor([0.5, -2.5, 1.5]) * step  # exact halves: ties round to even
    got = isa_path.quantize_int8(w)
    assert got is not None
    want = _torch_int8(w)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_native
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("col", [3, 17])  # in the vector body, in the tail
def test_native_quantization_leaves_non_finite_weights_to_torch(
    isa_path: native.NativeKernels, bad: float, col: int
) -> None:
    w = torch.randn(4, 18)
    w[2, col] = bad
    assert isa_path.quantize_int8(w) is None
    q = quantize_weight(w, "int8")  # falls back to the torch arithmetic, whatever it makes of them
    assert torch.equal(q.qweight, _torch_int8(w)[0])


@needs_native
@pytest.mark.parametrize("row_step", [1, 8])
def test_native_error_terms_equal_the_torch_ones(
    isa_path: native.NativeKernels, row_step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmplan.llm.model import error_terms

    w = torch.randn(300, 76)  # 76: a tail after the 8-wide body
    q = quantize_weight(w, "int8")
    got = error_terms(w, q, row_step)
    monkeypatch.setattr(native, "kernels", lambda: None)
    want = error_terms(w, q, row_step)
    assert got == pytest.approx(want, rel=1e-5)  # fp32 sums within a row, in another order


# (7, 2112, 96): groups that do not divide the tiles' 1024-column blocks (blocks of 960 columns, 10 groups)
# 13 and 31 rows: the integer tiles' 16-, 8-, 4-, 2- and 1-row tiles; 130: past them, the dequantizing tiles. K = 64,
# 576, 2112: superblocks of 256 columns cut short (masked loads); 2112 also in 1024-column blocks.
@needs_native
@pytest.mark.parametrize("rows", [1, 3, 13, 16, 31, 130])
@pytest.mark.parametrize(("n", "k", "group"), [(70, 64, 32), (9, 1536, 64), (5, 576, 32), (7, 2112, 96)])
def test_int4_kernel_equals_the_exact_product(
    isa_path: native.NativeKernels, rows: int, n: int, k: int, group: int
) -> None:
    from llmplan.llm.model import Int4Weight, dequantize

    gen = torch.Generator().manual_seed(rows + n + group)
    q = quantize_weight(torch.randn(n, k, generator=gen), "int4", group)
    assert isinstance(q, Int4Weight)
    x = torch.randn(rows, k, generator=gen)
    w = dequantize(q).double()
    if rows > max(8, isa_path.int4_integer_tile_rows):  # the dequantized weights against x in fp32
        _close(isa_path.linear_int4(x, q.packed, q.scale, q.zero), x.double() @ w.T)
        return
    # One row, a few (the few-rows kernel) and up to int4_integer_tile_rows (the integer tiles): the codes
    # against x rounded to 16 bits per group; the zero term takes x unrounded
    rounded = _round_x16(x, group)
    zero = q.zero.double().repeat_interleave(group, dim=1)  # [n, k]
    want = rounded @ w.T + (x.double() - rounded) @ zero.T
    _close(isa_path.linear_int4(x, q.packed, q.scale, q.zero), want)


@needs_native
@pytest.mark.parametrize("rows", [9, 16, 32])
def test_int4_integer_tiles_switch_off_to_the_dequantizing_tiles(isa_path: native.NativeKernels, rows: int) -> None:
    """Many rows take the integer tiles on AVX-512 (the AVX2 build has none): off, the same product runs on the
    dequantizing fp32 tiles on x as it is, and the two differ by x's 16-bit rounding alone."""
    from llmplan.llm.model import dequantize

    gen = torch.Generator().manual_seed(rows)
    q = quantize_weight(torch.randn(40, 640, generator=gen), "int4", 32)
    x = torch.randn(rows, 640, generator=gen)
    exact = x.double() @ dequantize(q).double().T
    assert isa_path.int4_integer_tile_rows == (32 if isa_path.isa == "avx512" else 0)
    integer = isa_path.linear_int4(x, q.packed, q.scale, q.zero).double()
    try:
        isa_path.force_int4_integer_tiles(False)
        assert isa_path.int4_integer_tile_rows == 0
        widened = isa_path.linear_int4(x, q.packed, q.scale, q.zero).double()
    finally:
        isa_path.force_int4_integer_tiles(True)
    _close(widened, exact)
    gap = (integer - exact).abs().max().item() / exact.abs().max().item()
    if isa_path.isa == "avx512":
        assert 1e-7 < gap < 1e-4  # the rounding shows, within its bound (measured ~3e-5)
    else:
        assert torch.equal(integer, widened)


def _round_x16(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the one-row int4 kernel rounds it: per group of columns to a multiple of absmax / 32767 (nearest,
    ties to even: the CPU's default rounding), in float64."""
    g = x.double().view(x.shape[0], -1, group)
    step = (g.abs().amax(-1, keepdim=True).float() / 32767.0).double()  # the kernel's fp32 scale
    inv = torch.where(step > 0, 32767.0 / g.abs().amax(-1, keepdim=True), torch.zeros_like(step)).float()
    codes = torch.round((g.float() * inv).double())  # the kernel multiplies in fp32, then rounds
    return (codes * step).view_as(x)


@needs_native
@pytest.mark.parametrize("group", [32, 64])
def test_int4_one_row_rounding_of_x_moves_the_product_little(isa_path: native.NativeKernels, group: int) -> None:
    """The 16-bit x costs at most one rounding step per element: |error| <= sum_k |code * scale| * step / 2."""
    from llmplan.llm.model import dequantize

    gen = torch.Generator().manual_seed(group)
    q = quantize_weight(torch.randn(64, 1536, generator=gen), "int4", group)
    x = torch.randn(1, 1536, generator=gen) * torch.logspace(-2, 1, 1536)  # spread magnitudes, as activations
    exact = x.double() @ dequantize(q).double().T
    got = isa_path.linear_int4(x, q.packed, q.scale, q.zero).double()
    step = x.view(1, -1, group).abs().amax(-1).double().repeat_interleave(group, dim=1) / 32767.0
    codes_scaled = (dequantize(q).double() - q.zero.double().repeat_interleave(group, dim=1)).abs()
    bound = (codes_scaled * step / 2).sum(1) + 1e-5 * exact.abs().max()  # plus the fp32 arithmetic
    assert bool(((got - exact).abs() <= bound).all())
    assert (got - exact).abs().max().item() <= 1e-4 * exact.abs().max().item()  # measured: ~1e-5


@needs_native
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_int4_one_row_passes_non_finite_x_on(isa_path: native.NativeKernels, bad: float, rows: int) -> None:
    """A NaN or infinity in x must not be rounded away: every output row it meets is non-finite (the NaN check
    of the generation loop relies on it), and the other rows stay finite."""
    q = quantize_weight(torch.randn(12, 64), "int4", 32)
    x = torch.randn(rows, 64)
    x[0, 37] = bad
    got = isa_path.linear_int4(x, q.packed, q.scale, q.zero)
    assert not bool(torch.isfinite(got[0]).any())
    assert bool(torch.isfinite(got[1:]).all())


@needs_native
def test_int4_modules_read_the_packed_codes_or_fall_back_to_int8(isa_path: native.NativeKernels) -> None:
    from llmplan.llm.model import dequantize
    from llmplan.llm.model.linear import Int4Linear

    w = torch.randn(40, 64)
    native_module = make_linear(quantize_weight(w, "int4", 32))
    native_module.prepack()
    assert isinstance(native_module, Int4Linear) and native_module.path == f"native-{isa_path.isa}-int4"
    # past the few-rows kernel and the integer tiles (which round x as one row does): the exact product
    x = torch.randn(max(9, isa_path.int4_integer_tile_rows + 1), 64)
    _close(native_module(x), x.double() @ dequantize(native_module.quantized_weight()).double().T)
    odd_groups = make_linear(quantize_weight(w, "int4", 16))  # groups of 16: not the kernel's 32-column steps
    odd_groups.prepack()
    assert odd_groups.int8 is not None and odd_groups.path == f"native-{isa_path.isa}-int8-requant"
    got, want = odd_groups(x), odd_groups.reference(x)
    assert float((got - want).norm() / want.norm()) < 0.02  # the re-quantization: ~0.01 (see test_quantize)


def _torch_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """`_quantize_int4` with the native kernels switched off: the arithmetic the kernel must reproduce."""
    from llmplan.llm.model import weight_formats

    saved = native.kernels
    native.kernels = lambda: None  # type: ignore[assignment]
    try:
        q = weight_formats._quantize_int4(w, group)
    finally:
        native.kernels = saved  # type: ignore[assignment]
    return q.packed, q.scale, q.zero


@needs_native
@pytest.mark.parametrize("group", [32, 64, 2])
def test_native_int4_quantization_is_bit_identical_to_torchs(isa_path: native.NativeKernels, group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    w = torch.randn(33, 128, generator=gen) * (torch.rand(33, 1, generator=gen) * 3)
    w[0] = 0.25  # a constant row: every group's scale is 1
    w[1, :group] = torch.linspace(-1, 1, group)  # exact halves of the step: ties round to even
    got = isa_path.quantize_int4(w, group)
    assert got is not None
    for mine, theirs in zip(got, _torch_int4(w, group), strict=True):
        assert torch.equal(mine, theirs)


@needs_native
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 70000.0])
def test_native_int4_quantization_leaves_odd_values_to_torch(isa_path: native.NativeKernels, bad: float) -> None:
    w = torch.randn(4, 64)
    w[3, 40] = bad
    assert isa_path.quantize_int4(w, 32) is None
    if bad == 70000.0:  # beyond fp16: the torch version's error, unchanged
        with pytest.raises(ValueError, match="beyond fp16"):
            quantize_weight(w, "int4", 32)


def test_the_isa_path_is_chosen_from_the_cpu_and_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    if native.compiler() is None or native.kernels() is None:
        pytest.skip("native kernels unavailable")
    monkeypatch.setenv("LLMPLAN_ISA", "avx2")
    assert native._load().isa == "avx2" and native.isa_note() == "forced by LLMPLAN_ISA=avx2"
    monkeypatch.setenv("LLMPLAN_ISA", "auto")
    assert native._load().isa == ("avx512" if native.cpu_has("avx512") else "avx2")
    monkeypatch.setenv("LLMPLAN_ISA", "sse2")
    with pytest.raises(native.NativeUnavailable, match="LLMPLAN_ISA"):
        native._load()
    assert native.kernels_for("avx2").isa == "avx2"  # type: ignore[union-attr]
    assert native.kernels() is not None and native.kernels().isa in native.describe()  # type: ignore[union-attr]


@needs_native
@pytest.mark.parametrize("vocab", [13, 1031, 49152, 262144])
def test_greedy_pick_is_the_first_maximum_and_its_log_softmax(isa_path: native.NativeKernels, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=gen) * 4
    top = int(logits.argmax())
    logits[vocab // 2 :][logits[vocab // 2 :] == logits[vocab // 2 :].max()] = logits[top]  # a tie past it
    token, logprob = isa_path.greedy_pick(logits) or (-1, 0.0)
    assert token == int(logits.argmax()) == top  # the first of equal maxima, as argmax
    want = float(torch.log_softmax(logits.double(), -1)[top])
    assert logprob == pytest.approx(want, abs=1e-5)  # fp32 sums in blocks of 1024, the blocks in double


@needs_native
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_greedy_pick_leaves_non_finite_rows_to_the_caller(isa_path: native.NativeKernels, bad: float) -> None:
    for at in (3, 1000):  # in the vector body and in the tail
        logits = torch.randn(1003)
        logits[at] = bad
        assert isa_path.greedy_pick(logits) is None
