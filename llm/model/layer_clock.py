"""Per-layer time of every forward pass, on the path the pass really takes.

A `LayerClock` set on the model runner (`ModelRunner.clock`) is read by both backends, so observing does not
change the path it measures (hooks on the layers would need the torch modules):

* the fused native step (llm/generation/fused_decode.py) writes its marks into `buffer` from C (`step_clock` in
  cpu_kernels.c), with CLOCK_MONOTONIC — the clock of `time.perf_counter_ns` here;
* the torch path (`Transformer.forward`, prefill and whatever cannot fuse) marks the same points in Python
  (after synchronizing a GPU, whose kernels are asynchronous).

Marks of one pass, 2 L + 2 of them: start, then after each layer's attention (with its residual) and after
its MLP (with its residual), then after the final norm and head. A pass costs one clock read per mark.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerPass:
    path: str  # "fused" (the native step) | "torch"
    rows: int  # batch rows in the pass
    tokens: int  # tokens per row: 1 = decode, more = a prefill chunk
    marks: list[int]  # perf_counter_ns marks, 2 L + 2

    @property
    def phase(self) -> str:
        return "decode" if self.tokens == 1 else "prefill"


class LayerClock:
    """The marks of up to `max_passes` forward passes (later ones are counted, not kept)."""

    def __init__(self, n_layers: int, max_passes: int = 20_000) -> None:  # ~2.5 KB a pass at 30 layers
        self.n_layers = n_layers
        self.buffer = torch.zeros(2 * n_layers + 2, dtype=torch.int64)  # the fused step's marks (written by C)
        self.passes: list[LayerPass] = []
        self.dropped = 0
        self.max_passes = max_passes

    def record(self, path: str, rows: int, tokens: int, marks: list[int]) -> None:
        if len(self.passes) < self.max_passes:
            self.passes.append(LayerPass(path, rows, tokens, marks))
        else:
            self.dropped += 1

    def record_fused(self, rows: int, tokens: int = 1) -> None:
        """After a fused pass (a decode step, or a prompt chunk of `tokens` per row): keep what C wrote."""
        self.record("fused", rows, tokens, self.buffer.tolist())


def now_ns(device: torch.device) -> int:
    """A mark for the torch path: on a GPU, once the queued kernels are done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter_ns()
