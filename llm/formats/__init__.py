"""Files weights come in: safetensors shards read through a bounded buffer, checkpoints written, GGUF files.

The names below are its public surface: code outside llm/ imports them from here. Each is imported
from its module on first use (llmplan/lazy_exports.py), so importing the package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmplan.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .checkpoint_writer import check_checkpoint_target, write_checkpoint
    from .shard_reader import ReadResult, ShardStats, read_shards

EXPORTS = {  # name -> the module that defines it
    "ReadResult": "shard_reader",
    "ShardStats": "shard_reader",
    "check_checkpoint_target": "checkpoint_writer",
    "read_shards": "shard_reader",
    "write_checkpoint": "checkpoint_writer",
}
__all__ = [
    "ReadResult",
    "ShardStats",
    "check_checkpoint_target",
    "read_shards",
    "write_checkpoint",
]
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
