"""A GGUF model's products in the order a forward pass runs them, on the file's mapped blocks: one decode step's
(or one batch's) weights, each read once, at the rows given; optionally A/B against other builds of the kernels.

    .venv/bin/python benchmarks/gguf_model_products.py MODEL.gguf [--rows 1,4,16] [--reps 12]
    .venv/bin/python benchmarks/gguf_model_products.py MODEL.gguf --so /tmp/a.so /tmp/b.so   # builds, alternating

Why this and not `gguf_blocks.py`: one large matrix streamed alone reads at 0.8-0.95 of a plain read, while the
same kernel over a real model's ~140 products (of 0.2-180 MB each, many of them small) read at 0.63-0.70 on
Qwen2.5-1.5B; this is the figure batch-1 decode lives on. It times the products alone (no attention, norms or
sampling: `llmplan bench` has those), with the current build (`native.kernels()`) or the shared objects given
(built from other versions of llm/kernels/*.c, e.g. `cc -O3 -fopenmp -shared -fPIC -march=native ... -lm`),
each round alternating between them so the machine's load hits all alike. The plain read (torch's sum over
512 MiB) is measured in the same run: on a shared machine read the ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmplan.llm.formats.gguf import GGUFFileError, map_gguf, stored_weights
from llmplan.llm.kernels import native
from llmplan.llm.model import Transformer, make_linear
from llmplan.llm.model.linear import GGUFLinear


def _products(path: Path) -> tuple[list[GGUFLinear], Transformer]:
    cfg, weights = stored_weights(map_gguf(path))
    model = Transformer.from_weights(cfg, weights, linear_factory=make_linear, device="cpu")
    return [m for m in model.modules() if isinstance(m, GGUFLinear)], model


def _load(so: str, threads: int) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(so)
    except OSError as bad:
        raise SystemExit(f"--so {so}: cannot load ({bad})") from None
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gguf_linear.argtypes = [i64, pointer, pointer, pointer, i64, i64, i64, i64]
    lib.gguf_linear.restype = i64
    lib.set_kernel_threads.argtypes = [i64]
    lib.set_kernel_threads(threads)
    return lib


def _plain_read() -> float:
    big = torch.ones(128 * 2**20)  # 512 MiB
    best = min(_timed(big.sum) for _ in range(4))
    return big.numel() * 4 / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--rows", default="1,4,16", help="activation rows, e.g. 1,4,16")
    parser.add_argument("--reps", type=int, default=12, help="rounds over all products per build")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--so", nargs="*", default=[], help="kernel builds to compare (default: the current one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fast = native.kernels()
    if fast is None:
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    fast.set_threads(args.threads)
    builds = {Path(so).name: _load(so, args.threads) for so in args.so} or {"current": fast.lib}
    try:
        linears, _model = _products(args.model)
    except (GGUFFileError, OSError) as bad:  # one line, as llmplan says it: a missing or damaged file
        raise SystemExit(f"{args.model}: {bad}" if isinstance(bad, OSError) else str(bad)) from None
    gb = sum(lin.blocks.numel() for lin in linears) / 1e9
    print(f"{args.model.name}: {len(linears)} products, {gb:.3f} GB of blocks; {platform.processor() or 'cpu'}, "
          f"{args.threads} threads, load {' '.join(f'{v:.2f}' for v in _loadavg())}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {lin.in_features for lin in linears}}
        calls = [(lin.qtype, lin.blocks.data_ptr(), xs[lin.in_features].data_ptr(), torch.empty(rows, lin.out_features),
                  lin.out_features, lin.in_features) for lin in linears]
        times: dict[str, list[float]] = {name: [] for name in builds}
        for _ in range(args.reps):
            for name, lib in builds.items():
                start = time.perf_counter()
                for qtype, w, x, y, n, k in calls:
                    lib.gguf_linear(qtype, w, x, y.data_ptr(), rows, n, k, 8)
                times[name].append(time.perf_counter() - start)
        plain = _plain_read()
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  rows {rows:3d} {name:>16}: median {med * 1e3:7.2f} ms, best {min(ts) * 1e3:7.2f}; "
                  f"{gb / med:5.1f} GB/s, {gb / med / plain:.2f} of the plain read ({plain:.1f} GB/s)")


def _loadavg() -> tuple[float, ...]:
    return tuple(float(v) for v in Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
