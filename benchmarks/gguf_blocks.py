"""Batch-1 products on GGUF blocks as stored (gguf_blocks.c) against a plain memory read and the project's own
int8/int4 kernels on the same shapes; with --rows, products of more activation rows (prefill: from 4 to 8 by type
run on gguf_panels.c's panels on AVX-512) in GFLOP/s.

    .venv/bin/python benchmarks/gguf_blocks.py [--isa avx512|avx2] [--threads 2] [--mib 256] [--passes 3]
    .venv/bin/python benchmarks/gguf_blocks.py --rows 16,128

Each kernel cycles through enough distinct copies of its weight (about `mib` MiB in all) that every call reads
the weight from memory, not from cache; GB/s is the weight bytes a call reads over its time (the fastest call of
`passes` passes over all copies). The plain read is torch's sum over a 512 MiB fp32 tensor, in the same run, on the same
thread count. On a shared machine read the ratios, measured back to back, not the absolute numbers. The torch
sum is a floor, not a ceiling: on the 2-core Zen 5 this was written on it read 13-24 GB/s while the project's
int8 kernel (4 streams a thread) read 42 GB/s, so compare the block kernels with int8/int4 as well.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np
import torch

from llmplan.llm.formats.gguf import BY_NAME
from llmplan.llm.kernels import native

SHAPES = [(8960, 1536), (1536, 8960)]  # (N out, K in): Qwen2.5-1.5B's MLP up/gate and down
TYPES = ["Q4_K", "Q6_K", "Q8_0"]
HALVES = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,)}  # fp16 fields, set finite


def _gguf_copies(name: str, n: int, k: int, mib: int) -> list[torch.Tensor]:
    t = BY_NAME[name]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n * (k // t.block_size), t.type_size), dtype=np.uint8)
    for off in HALVES[name]:
        raw[:, off : off + 2] = rng.uniform(-1 / 16, 1 / 16, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    one = torch.from_numpy(raw.reshape(n, -1))
    return [one.clone() for _ in range(_count(one.numel(), mib))]


def _count(nbytes: int, mib: int) -> int:
    return max(4, -(-mib * 2**20 // nbytes))


def _best(calls: list[Callable[[], object]], passes: int) -> float:
    """Seconds of the fastest call over `passes` passes through every copy: each call reads its copy from memory
    (the copies together far exceed the caches), and the fastest is the one the other processes of a shared
    machine disturbed least."""
    calls[0]()
    best = float("inf")
    for _ in range(passes):
        for call in calls:
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
    return best


def _read_rate(passes: int) -> float:
    big = torch.ones(128 * 2**20, dtype=torch.float32)  # 512 MiB
    seconds = _best([big.sum] * 4, passes)
    return big.numel() * 4 / seconds / 1e9


def _row(label: str, nbytes: int, seconds: float, plain: float) -> None:
    rate = nbytes / seconds / 1e9
    print(f"  {label:<22} {nbytes / 2**20:7.2f} MiB  {seconds * 1e6:8.1f} us  {rate:6.1f} GB/s  {rate / plain:5.2f}x")


def _project(fast: native.NativeKernels, n: int, k: int, mib: int, x: torch.Tensor, passes: int, plain: float) -> None:
    w = torch.randn(n, k)
    q8 = fast.quantize_int8(w)
    q4 = fast.quantize_int4(w, 32)
    assert q8 is not None and q4 is not None
    int8s = [(q8[0].clone(), q8[1]) for _ in range(_count(q8[0].numel(), mib))]
    int4s = [tuple(t.clone() for t in q4) for _ in range(_count(q4[0].numel() + 4 * q4[1].numel(), mib))]
    s8 = _best([lambda q=q, s=s: fast.linear_int8(x, q, s) for q, s in int8s], passes)
    _row("int8 (project)", q8[0].numel() + 4 * n, s8, plain)
    s4 = _best([lambda p=p, s=s, z=z: fast.linear_int4(x, p, s, z) for p, s, z in int4s], passes)
    _row("int4 g32 (project)", q4[0].numel() + 4 * q4[1].numel(), s4, plain)


def _gguf(
    fast: native.NativeKernels, name: str, n: int, k: int, x: torch.Tensor, args: argparse.Namespace, plain: float
) -> None:
    copies = _gguf_copies(name, n, k, args.mib)
    qtype = BY_NAME[name].ggml_type
    seconds = _best([lambda c=c: fast.gguf_linear(x, c, qtype, n, k) for c in copies], args.passes)
    _row(f"{name} (gguf blocks)", copies[0].numel(), seconds, plain)


def _many_rows(fast: native.NativeKernels, rows: int, args: argparse.Namespace) -> None:
    """Products of `rows` activation rows: compute-bound, so one copy of each weight (from cache) is enough."""
    print(f"{rows} activation rows (GFLOP/s: 2 * rows * N * K a call)")
    for n, k in SHAPES:
        x = torch.randn(rows, k)
        for name in TYPES:
            copy = _gguf_copies(name, n, k, 1)[0]
            qtype = BY_NAME[name].ggml_type
            call = functools.partial(fast.gguf_linear, x, copy, qtype, n, k)
            seconds = _best([call] * 2, args.passes)
            print(f"  [{n}, {k}] {name:<5} {seconds * 1e3:8.2f} ms  {2 * rows * n * k / seconds / 1e9:6.0f} GFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="avx512", choices=list(native.ISAS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--rows", default="", help="activation row counts beside batch 1, e.g. 16,128")
    args = parser.parse_args()
    fast = native.kernels_for(args.isa)
    if fast is None:
        raise SystemExit(f"no {args.isa} kernels here")
    torch.set_num_threads(args.threads)
    fast.set_threads(args.threads)
    plain = _read_rate(args.passes)
    print(f"{fast.isa}, {args.threads} threads; plain read (torch sum, 512 MiB): {plain:.1f} GB/s")
    for n, k in SHAPES:
        print(f"[{n}, {k}] batch 1 (rate / plain read)")
        x = torch.randn(1, k)
        for name in TYPES:
            _gguf(fast, name, n, k, x, args, plain)
        _project(fast, n, k, args.mib, x, args.passes, plain)
    for rows in [int(r) for r in args.rows.split(",") if r]:
        _many_rows(fast, rows, args)
    fast.set_threads(0)


if __name__ == "__main__":
    main()
