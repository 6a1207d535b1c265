"""The native kernels' team of threads on a busy machine (#30, cpu_kernels.c "Threads on a busy machine").

The products' blocks are taken in pieces by whichever thread is free, and the team size adapts to the load;
neither may change a single bit of a result: every output element is computed by the same code whichever
thread takes it. Checked here on every product shape (one row, a few rows, several rows: each kernel family)
and on whole fused passes, under 1, 2, 3 and 5 threads (more threads than this machine's cores: the dynamic
split then differs from run to run) and under the adapting default.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny import load_tiny, make_tiny_llama

from llmplan.llm.generation.fused_decode import FusedDecoder, native_static_prefill
from llmplan.llm.kernels import native
from llmplan.llm.kv import KVCache

pytestmark = [
    pytest.mark.skipif(native.kernels() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"),
]
TEAMS = (1, 2, 3, 5, 0)  # 0: adapting


@pytest.fixture
def fast(isa_path: native.NativeKernels) -> Iterator[native.NativeKernels]:
    yield isa_path
    isa_path.set_threads(0)


def _products(fast: native.NativeKernels) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(203, 96, generator=gen)  # 203 rows: the last block and stream are short
    q, scale = fast.quantize_int8(w)
    int4 = fast.quantize_int4(w, 32)
    assert int4 is not None
    out = []
    for rows in (1, 3, 8, 40):  # one row, a few rows, several rows (dynamic blocks of the widened path)
        x = torch.randn(rows, 96, generator=gen)
        out += [fast.linear_int8(x, q, scale), fast.linear_f32(x, w), fast.linear_int4(x, *int4)]
        out += [fast.linear_half(x, w.to(dtype)) for dtype in (torch.bfloat16, torch.float16)]
    return out


def test_products_are_bitwise_equal_under_any_team(fast: native.NativeKernels) -> None:
    fast.set_threads(1)
    want = _products(fast)
    for n in TEAMS[1:]:
        fast.set_threads(n)
        for _ in range(3):  # a dynamic split differs between runs
            got = _products(fast)
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), f"{n} threads"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    path, _ = make_tiny_llama(tmp_path_factory.mktemp("threads"), n_layers=2, heads=8, kv_heads=2, tie=True, seed=5)
    return path


def _passes(path: Path) -> list[torch.Tensor]:
    """A 20-token prefill of 2 rows, then 4 decode steps, through the fused pass: every logit."""
    model = load_tiny(path)
    cache = KVCache.for_model(model, 2, 64, dtype=torch.float32)
    fused = FusedDecoder.build(model, cache)
    assert fused is not None
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(1, model.cfg.vocab_size, (2, 20), generator=gen)
    out = [native_static_prefill(fused, prompt, torch.arange(20).repeat(2, 1), cache, None, logits=True)]
    for step in range(4):
        out.append(fused.step(out[-1].argmax(-1), torch.full((2, 1), 20 + step), cache))
    assert all(bool(o.isfinite().all()) for o in out)
    return out


def test_fused_passes_are_bitwise_equal_under_any_team(fast: native.NativeKernels, tiny_dir: Path) -> None:
    fast.set_threads(1)
    want = _passes(tiny_dir)
    for n in TEAMS[1:]:
        fast.set_threads(n)
        got = _passes(tiny_dir)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), f"{n} threads"


def test_a_fixed_team_is_reported_and_kept(fast: native.NativeKernels) -> None:
    fast.set_threads(3)
    _products(fast)
    stats = fast.thread_stats()
    assert (stats["threads"], stats["fixed"]) == (3, 3)
    assert stats["products"] > 0 and 0 <= stats["wait_ns"] <= stats["product_ns"]


def test_an_oversubscribed_team_drops_threads(fast: native.NativeKernels) -> None:
    # Twice as many threads as cores: some are always descheduled, and the first thread waits at every
    # product's end for them, so the adapting team must shed threads within a few windows (100 ms each).
    most = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(2 * cores + 1)
    try:
        fast.set_threads(0)
        before = fast.thread_stats()
        w = torch.randn(2048, 512)
        q, scale = fast.quantize_int8(w)
        x = torch.randn(1, 512)
        end = time.monotonic() + 3.0
        while time.monotonic() < end and fast.thread_stats()["threads"] == 2 * cores + 1:
            fast.linear_int8(x, q, scale)
        stats = fast.thread_stats()
        assert stats["drops"] > before["drops"], stats
        assert stats["threads"] < stats["most"] == 2 * cores + 1
    finally:
        torch.set_num_threads(most)


def test_torch_follows_the_team_and_raises_still_reach_the_most(fast: native.NativeKernels) -> None:
    # torch's own ops (sampling between the passes) must not keep the threads the kernels dropped; lowering
    # torch's count lowers the OpenMP runtime's, so the most is pinned first or the team could never rise.
    most = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    over = 2 * cores + 1
    torch.set_num_threads(over)
    try:
        fast.set_threads(0)
        w = torch.randn(2048, 512)
        q, scale = fast.quantize_int8(w)
        x = torch.randn(1, 512)
        end = time.monotonic() + 3.0
        while time.monotonic() < end and fast.thread_stats()["threads"] == over:
            fast.linear_int8(x, q, scale)
        fast.torch_follows_team()
        team = fast.thread_stats()["threads"]
        assert team < over and torch.get_num_threads() == team
        assert fast.thread_stats()["most"] == over  # pinned: the runtime's count is now the team's
        torch.set_num_threads(over + 1)  # set by someone else (not the team size): the most from now on
        fast.torch_follows_team()
        assert fast.thread_stats()["most"] == over + 1
    finally:
        fast.set_threads(0)
        torch.set_num_threads(most)
