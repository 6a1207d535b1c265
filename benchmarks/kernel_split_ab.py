"""The cost of the dynamic split (#30) on its own: one product at a time, the kernels of another git revision
(static split, built from `git show REV:llm/kernels/cpu_kernels.c`) against this checkout's with the team fixed at
torch's count (no adaptation), call by call alternating in one process, so machine load hits both alike.

Usage: python benchmarks/kernel_split_ab.py OUT_PREFIX [--rev main] [--calls 300]

Shapes: SmolLM2-135M's int8 products (q|k|v, o, gate|up, down, head) at 1 row (decode), 16 rows (a batch) and
118 rows (a prompt). Per shape: the minimum and the median ns of each side over `--calls` calls, and new/old.
On a loaded machine the minimum is the figure to read: the calls no other job interrupted.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_checkouts import cpu_flags

from llmplan.llm.kernels import native

KERNEL_PATHS = ("llm/kernels/cpu_kernels.c", "llm/cpu_kernels.c")
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def old_library(rev: str, isa: str, where: Path) -> ctypes.CDLL:
    # the kernels' source moved from llm/ to llm/kernels/ (issue 53); an older revision has it at the old path
    show = [subprocess.run(["git", "show", f"{rev}:{p}"], capture_output=True, text=True) for p in KERNEL_PATHS]
    source = next(s for s in show if s.returncode == 0)
    src = where / "old_kernels.c"
    src.write_text(source.stdout)
    out = where / "old_kernels.so"
    cmd = [native.compiler() or "cc", *native.FLAGS, *native.ISAS[isa], str(src), "-o", str(out), *native.LIBS]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.gemm_int8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.gemm_int8.restype = None
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rev", default="main")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    new = native.kernels()
    if new is None:
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    new.set_threads(-1)  # torch's count, not adapted: the split alone
    rows = []
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        old = old_library(args.rev, new.isa, Path(tmp))
        for name, (n, k) in SHAPES.items():
            q, scale = new.quantize_int8(torch.randn(n, k))
            for m in (1, 16, 118):
                x = torch.randn(m, k)
                y = torch.empty(m, n)
                call = (x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), m, n, k)
                calls = {"old": old.gemm_int8, "new": new._int8}
                times: dict[str, list[int]] = {"old": [], "new": []}
                for i in range(args.calls):
                    for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
                        t = time.perf_counter_ns()
                        calls[side](*call)
                        times[side].append(time.perf_counter_ns() - t)
                got = {s: {"min": min(v), "median": statistics.median(v)} for s, v in times.items()}
                rows.append({"shape": name, "n": n, "k": k, "rows": m, **got,
                             "min_ratio": got["new"]["min"] / got["old"]["min"],
                             "median_ratio": got["new"]["median"] / got["old"]["median"]})  # fmt: skip
                print(f"{name} x{m}: new/old min {rows[-1]['min_ratio']:.3f}", file=sys.stderr, flush=True)
    meta = {"cpu": cpu_flags(), "isa": new.isa, "threads": torch.get_num_threads(), "rev": args.rev,
            "calls": args.calls, "loadavg_start": load_start, "loadavg_end": os.getloadavg()}  # fmt: skip
    Path(args.out + ".json").write_text(json.dumps({"machine": meta, "rows": rows}, indent=2))
    lines = [
        "# The dynamic split alone (#30): int8 products, this checkout (team fixed) against " + args.rev,
        "",
        f"Machine: {meta['cpu']}, {meta['isa']} path, {meta['threads']} threads; load average "
        f"{load_start[0]:.1f} at start, {meta['loadavg_end'][0]:.1f} at the end. {args.calls} calls a side, "
        "alternating; ns per call.",
        "",
        "| product | rows | old min | new min | new/old min | old median | new median | new/old median |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} {r['n']}x{r['k']} | {r['rows']} | {r['old']['min']} | {r['new']['min']} | "
            f"{r['min_ratio']:.3f} | {r['old']['median']:.0f} | {r['new']['median']:.0f} | {r['median_ratio']:.3f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
