"""`llmplan serve`'s default number of slots (requests decoded at once), from the memory the KV cache may take.

A plan that sets `place.max_batch` keeps it. Otherwise the slots are as many as fit in a quarter of the memory
free when the server starts (the GPU's free memory, or the host's available RAM: the rest is for the weights
and the work buffers), each slot `kv_cache.max_tokens` rows of K/V for every layer (sized at fp32 when the
cache's dtype is `auto`, the largest it can be), between 1 and 16 (llama-server's automatic slots are 4;
16 keeps a small model's many slots from spending the decode step's time on rows nobody uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KV_SHARE = 0.25
MAX_AUTO_SLOTS = 16
PLACE, SOURCE = "load.to_device", "model.source"


@dataclass(frozen=True)
class SlotChoice:
    slots: int
    why: str


def auto_slots(bound: Any) -> SlotChoice | None:
    """The slots for this bound plan, or None when the plan chose (`max_batch` set) or nothing can be known."""
    import torch

    from llmplan.engine.findings import StageFailure
    from llmplan.llm.model import ConfigError, ModelConfig
    from llmplan.stages.env_check import available_memory
    from llmplan.stages.load_to_device import CACHE_DTYPES, kv_cache_bytes
    from llmplan.stages.model_source import reads_gguf, resolve_source

    place = next((b for b in bound.stages if b.spec.uses == PLACE), None)
    source = next((b for b in bound.stages if b.spec.uses == SOURCE), None)
    if place is None or source is None or "max_batch" in place.params.model_fields_set:
        return None
    try:
        # imported once; the load reads the cache
        model_dir = resolve_source(source.params, None, reads_gguf(bound)).model_dir
        cfg = ModelConfig.from_file(model_dir / "config.json")
    except (ConfigError, StageFailure, OSError, ValueError):
        return None  # the load says what is wrong, in its own words
    one = place.params.model_copy(update={"max_batch": 1})
    per_slot = kv_cache_bytes(cfg, one, CACHE_DTYPES.get(place.params.kv_cache.dtype, torch.float32))
    device = bound.plan.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    where, free = available_memory(device)
    slots = max(1, min(MAX_AUTO_SLOTS, int(free * KV_SHARE) // max(per_slot, 1)))
    why = (
        f"{slots} slots of {place.params.kv_cache.max_tokens} tokens ({per_slot / (1 << 20):.0f} MiB of KV cache "
        f"each) in a quarter of the {free / (1 << 30):.1f} GiB {where}, at most {MAX_AUTO_SLOTS}"
    )
    return SlotChoice(slots, why)
