"""`output.release`: give memory back at the end of a run, even after a failure or Ctrl-C.

Drops the context's references to the KV cache, the host (pre-conversion) weights and — unless
`keep_weights` — the converted weights and the model, closing any that hold files (mmap'd shard
readers), and releases what `ctx.ext` holds with a `release()` (the observer, whose forward hooks
would otherwise keep the whole model alive), then collects garbage, trims the C heap (glibc's
malloc_trim) and empties the CUDA caching allocator, so the memory really returns to the system.
It measures RSS and device memory before and after, so the claim is checked each run:
`release_report` = {rss_before, rss_after, freed_bytes, device_before, device_after, released}.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from typing import Any

from pydantic import Field

from llmplan.engine import heap
from llmplan.engine.memory import device_bytes, mapped_resident, mib, resident_split, rss_bytes
from llmplan.engine.stage import Params, Phase, Stage

from .slots import InferenceContext

# In release order: the biggest, most derived holders first.
WEIGHT_SLOTS = ("model", "weights")
ALWAYS_SLOTS = ("draft_model", "model_runner", "kv_cache", "host_weights")  # the runner holds the cache's memory


class ReleaseParams(Params):
    keep_weights: bool = Field(False, description="keep the model and its weights (free only KV cache and buffers)")


class OutputRelease(Stage):
    """Free the KV cache, buffers and (unless keep_weights) the weights; report the memory freed."""

    name = "output.release"
    phase = Phase.OUTPUT
    Params = ReleaseParams
    always = True
    writes = ("release_report",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        rss_before, device_before, split_before = rss_bytes(), device_bytes(), resident_split()
        files = mapped_weight_files(ctx)
        weights_before = mapped_resident(files) if files else None
        slots = ALWAYS_SLOTS if params.keep_weights else (*WEIGHT_SLOTS, *ALWAYS_SLOTS)
        released: list[str] = []
        for slot in slots:
            value = getattr(ctx, slot, None)
            if value is None:
                continue
            _close(value)
            setattr(ctx, slot, None)
            released.append(slot)
        del value  # the loop variable would keep the last object alive
        for key in [k for k, v in ctx.ext.items() if callable(getattr(v, "release", None))]:
            ctx.ext.pop(key).release()  # e.g. the observer's hooks hold the whole model
            released.append(key)
        gc.collect()
        heap.trim()
        _empty_device_cache()
        rss_after, device_after, split_after = rss_bytes(), device_bytes(), resident_split()
        report: dict[str, Any] = {
            "rss_before": rss_before,
            "rss_after": rss_after,
            "freed_bytes": max(0, rss_before - rss_after),
            "device_before": device_before,
            "device_after": device_after,
            "released": released,
        }
        if split_before is not None and split_after is not None:  # each kind: mapped files' pages, own memory
            report |= {"file_backed_before": split_before[0], "file_backed_after": split_after[0]}
            report |= {"anonymous_before": split_before[1], "anonymous_after": split_after[1]}
        if weights_before is not None:  # the mapped weights' own pages (a cache entry's, a GGUF's)
            report |= {"mapped_weights_before": weights_before, "mapped_weights_after": mapped_resident(files)}
        ctx.release_report = report
        for key, number in report.items():
            ctx.metrics.set(key, number)
        if not ctx.json_mode:
            what = ", ".join(released) if released else "nothing"
            line = f"released {what}: RSS {mib(rss_before)} → {mib(rss_after)}"
            if split_before is not None and split_after is not None:
                line += f" (file-backed {mib(split_before[0])} → {mib(split_after[0])}, anonymous "
                line += f"{mib(split_before[1])} → {mib(split_after[1])})"
            if device_before is not None:
                line += f", device {mib(device_before)} → {mib(device_after)}"
            print(line, file=sys.stderr)


def mapped_weight_files(ctx: InferenceContext) -> list[str]:
    """The files load.convert mapped the weights from (its `mapped_files` metric), if any."""
    for bucket in ctx.metrics.by_stage.values():
        files = bucket.get("mapped_files") if isinstance(bucket, dict) else None
        if files:
            return [str(f) for f in files]
    return []


def _close(value: Any) -> None:
    """Close what holds files or handles (shard readers, mmaps); a failing close must not stop the release."""
    holders = [value, *(getattr(value, "tensors", {}) or {}).values()] if hasattr(value, "tensors") else [value]
    for holder in holders:
        close = getattr(holder, "close", None)
        if callable(close):
            # Best effort: the memory is released either way.
            with contextlib.suppress(Exception):
                close()


def _empty_device_cache() -> None:
    torch = sys.modules.get("torch")  # never import torch just to clean up
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
