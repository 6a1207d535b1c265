"""The identity of one conversion, and so the name of its cache entry.

Two starts may share an entry only if they would convert the same bytes the same way: the same source files
(by SHA-256, as `load.verify` checked them, never by name or date), the same config.json (it decides the fusion
and the layout), the same settings (dtype, group size, head, what embeddings are kept in) and the same code
(`CONVERSION_VERSION`, bumped whenever the conversion's output changes for the same input). Any difference
gives another digest, so another entry: a stale one is never found, let alone used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

FORMAT = "llmplan.conversion/v1"
CONVERSION_VERSION = 1  # bump when quantize_weight, the fusion table or the stored layout changes its output


@dataclass(frozen=True)
class ConversionKey:
    sources: tuple[tuple[str, str], ...]
    """(file name, SHA-256) of every shard converted, sorted."""
    config_sha256: str
    settings: dict[str, Any] = field(hash=False)
    """What the conversion was asked for (dtype, group_size, head, kept_as): JSON values."""

    def record(self) -> dict[str, Any]:
        """What the digest covers, as the entry's marker states it."""
        return {
            "format": FORMAT,
            "version": CONVERSION_VERSION,
            "sources": [list(pair) for pair in self.sources],
            "config_sha256": self.config_sha256,
            "settings": self.settings,
        }

    @property
    def digest(self) -> str:
        body = json.dumps(self.record(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode("utf-8")).hexdigest()
