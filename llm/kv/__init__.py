"""The KV caches: per-layer K/V memory, a static batch's cache, the slot cache of continuous batching.

The names below are its public surface: code outside llm/ imports them from here. Each is imported
from its module on first use (llmplan/lazy_exports.py), so importing the package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmplan.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .cache import KVCache, planned_bytes
    from .layers import DEFAULT_CHUNK
    from .slot_cache import SlotCache

EXPORTS = {  # name -> the module that defines it
    "DEFAULT_CHUNK": "layers",
    "KVCache": "cache",
    "SlotCache": "slot_cache",
    "planned_bytes": "cache",
}
__all__ = [
    "DEFAULT_CHUNK",
    "KVCache",
    "SlotCache",
    "planned_bytes",
]
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
