"""GGUF: the header and tensor table read with bounds, its metadata as a config and tokenizer, the import.

The names below are its public surface: code outside llm/ imports them from here. Each is imported
from its module on first use (llmplan/lazy_exports.py), so importing the package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmplan.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .block_types import BY_NAME
    from .file import GGUFFileError, open_gguf
    from .file_type import GGUFType, file_type_names, gguf_type, nominal_bits
    from .footprint import footprint_line, gguf_read_per_token, read_per_token, recorded_footprint, resident_parts
    from .importer import Imported, dequantized_tensors, has_shards, import_gguf, import_gguf_as
    from .mapped import MappedGGUF, check_block_values, map_gguf
    from .pin import PIN_NAME, PinError, check_pinned, read_pin
    from .stored import copied_bytes, copies, stored_types, stored_weights

EXPORTS = {  # name -> the module that defines it
    "BY_NAME": "block_types",
    "GGUFFileError": "file",
    "GGUFType": "file_type",
    "Imported": "importer",
    "PIN_NAME": "pin",
    "PinError": "pin",
    "check_pinned": "pin",
    "copied_bytes": "stored",
    "copies": "stored",
    "dequantized_tensors": "importer",
    "has_shards": "importer",
    "import_gguf_as": "importer",
    "read_pin": "pin",
    "MappedGGUF": "mapped",
    "check_block_values": "mapped",
    "file_type_names": "file_type",
    "footprint_line": "footprint",
    "gguf_read_per_token": "footprint",
    "gguf_type": "file_type",
    "import_gguf": "importer",
    "map_gguf": "mapped",
    "nominal_bits": "file_type",
    "open_gguf": "file",
    "read_per_token": "footprint",
    "recorded_footprint": "footprint",
    "resident_parts": "footprint",
    "stored_types": "stored",
    "stored_weights": "stored",
}
__all__ = [
    "BY_NAME",
    "PIN_NAME",
    "GGUFFileError",
    "GGUFType",
    "Imported",
    "MappedGGUF",
    "PinError",
    "check_block_values",
    "check_pinned",
    "copied_bytes",
    "copies",
    "dequantized_tensors",
    "file_type_names",
    "footprint_line",
    "gguf_read_per_token",
    "gguf_type",
    "has_shards",
    "import_gguf",
    "import_gguf_as",
    "map_gguf",
    "nominal_bits",
    "open_gguf",
    "read_per_token",
    "read_pin",
    "recorded_footprint",
    "resident_parts",
    "stored_types",
    "stored_weights",
]
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
