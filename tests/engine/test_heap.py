"""The heap policies do what engine/heap.py says: under the loading one a freed 3 MiB block goes back to the OS
(so the next one faults its pages in anew), under the decoding one it is reused from the heap.

Each policy is process-wide, so the measurement runs in a child process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmplan.engine import heap

CHILD = """
import json, resource, sys
import torch
from llmplan.engine import heap

def faults_per_block(rows: int = 16, vocab: int = 49152, times: int = 20) -> float:
    for _ in range(10):  # glibc grows the heap for the first few before it reuses a freed one
        torch.empty(rows, vocab).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        torch.empty(rows, vocab).fill_(1.0)  # a batch-16 step's logits, dropped at once
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / times

set_loading = heap.for_loading()
loading = faults_per_block()
set_decoding = heap.for_decoding()
decoding = faults_per_block()
print(json.dumps({"set": [set_loading, set_decoding], "loading": loading, "decoding": decoding}))
"""


@pytest.mark.skipif(heap._libc() is None, reason="no glibc mallopt on this platform: the policies are no-ops")
def test_decoding_policy_reuses_step_sized_blocks_that_loading_returns_to_the_os() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["set"] == [True, True]
    pages = 16 * 49152 * 4 // 4096  # 768
    assert got["loading"] >= 0.9 * pages  # every block mmapped anew: all its pages fault in
    assert got["decoding"] <= 0.05 * pages  # reused from the heap


def test_policies_say_when_they_cannot_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_libc", lambda: None)
    assert heap.for_loading() is False
    assert heap.for_decoding() is False
    heap.trim()  # a no-op, not an error
