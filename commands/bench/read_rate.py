"""The memory's read rate, measured beside the runs: what bounds a batch-1 decode.

A batch-1 decode step reads every weight once, so no engine decodes faster than the memory's read rate over
the bytes it reads a token. `read_rate` measures that rate the plainest way: torch's sum over a buffer far
larger than the caches, on the bench's threads, best of a few passes (on a shared machine the best pass is
the nearest to what the memory gives). It is not a hard ceiling (an engine's own prefetching may read a
little faster), but it puts a memory-bound ratio in context: where llama.cpp already reads at 85 % of the
rate, no engine reading the same bytes a token can be much more than 1.2x faster than it.
"""

from __future__ import annotations

import time

import torch

READ_MIB = 512  # far past any L3 of the machines this runs on (a few dozen MB to a few hundred)
PASSES = 3


def read_rate(threads: int, mib: int | None = None, passes: int = PASSES) -> float:
    """GB/s of the best of `passes` plain reads of `mib` MiB (default READ_MIB) on `threads` threads."""
    buffer = torch.ones((mib or READ_MIB) * 2**20 // 4)  # written once, so every page is real memory
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for _ in range(passes):
            start = time.perf_counter()
            buffer.sum()
            took = time.perf_counter() - start
            best = max(best, buffer.nbytes / took / 1e9)
    finally:
        torch.set_num_threads(before)
    return best
