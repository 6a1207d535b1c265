"""The conversion cache: a conversion's result (codes, scales, the fused layout the kernels read) written once
into the model cache, keyed by what was converted and how, and mapped on every later start.

    key.py       the entry's identity: the source files' SHA-256, the config, the settings, the format version
    layout.py    converted weights <-> the flat tensors an entry stores (ties kept as aliases, not copies)
    mapping.py   a safetensors file mapped: each tensor a view on the file's pages, never copied
    store.py     write an entry atomically; open one (ownership, marker, SHA-256, then map)
    listing.py   where entries are, what each is, removing one (no torch: `llmplan models` lists at once)

The names below are its public surface; each is imported from its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmplan.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .key import FORMAT, ConversionKey
    from .layout import flatten, unflatten
    from .listing import EntryInfo, EntryProblem, conversions_root, discard_entry, entry_bytes, list_entries
    from .mapping import MappedFile, map_safetensors
    from .store import CacheEntry, find_entry, open_entry, write_entry

EXPORTS = {  # name -> the module that defines it
    "FORMAT": "key",
    "ConversionKey": "key",
    "flatten": "layout",
    "unflatten": "layout",
    "MappedFile": "mapping",
    "map_safetensors": "mapping",
    "CacheEntry": "store",
    "EntryInfo": "listing",
    "EntryProblem": "listing",
    "conversions_root": "listing",
    "discard_entry": "listing",
    "entry_bytes": "listing",
    "find_entry": "store",
    "list_entries": "listing",
    "open_entry": "store",
    "write_entry": "store",
}
__all__ = [
    "FORMAT",
    "CacheEntry",
    "ConversionKey",
    "EntryInfo",
    "EntryProblem",
    "MappedFile",
    "conversions_root",
    "discard_entry",
    "entry_bytes",
    "find_entry",
    "flatten",
    "list_entries",
    "map_safetensors",
    "open_entry",
    "unflatten",
    "write_entry",
]
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
