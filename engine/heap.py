"""The C heap's policy over a run (glibc's malloc, through mallopt), and giving its free pages back.

Loading and decoding want opposite things of it:

* **while loading**, blocks of 1 MiB and more are mmapped, so the fp32 tensors the loader converts and drops go
  back to the OS at once. glibc otherwise raises its mmap threshold as large blocks are freed, and the heap
  fragments: measured on the int8 plan, RSS after loading was 796 MiB with the default and 513 MiB with this.
* **once the model is placed**, the same-sized tensors of every step (the logits of a 16-row batch are 3 MiB)
  are kept in the heap and reused. Under the loading policy each was a fresh mmap whose 768 pages faulted in
  and were zeroed on every step: 3 % of an fp32 batch-16 decode step, measured (+10 MiB RSS instead).

Elsewhere (musl, macOS) there is no mallopt and these are no-ops that say so.
"""

from __future__ import annotations

import ctypes
import functools
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

LOADING_MMAP_THRESHOLD = 1 << 20
# glibc's own ceiling for its dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts)
DECODING_MMAP_THRESHOLD = 32 << 20
# free space kept at the heap's top before glibc trims it: a step's tensors, several times over
DECODING_TRIM_THRESHOLD = 64 << 20


@functools.cache  # looked up once a process
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None  # not on musl


def for_loading() -> bool:
    """Large blocks straight from and back to the OS (see the module doc). True when the policy was set."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD))


def for_decoding() -> bool:
    """Per-step tensors reused from the heap, not faulted in anew each step. True when the policy was set."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, DECODING_MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, DECODING_TRIM_THRESHOLD)
    )


def trim() -> None:
    """Return the heap's free pages to the OS now (at the end of a run)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
