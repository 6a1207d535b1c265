"""Tiny GGUFs for the tests of a GGUF run as stored: random valid blocks of the K-quant types (gguf-py
quantizes only the legacy ones) and a small Llama/Qwen2 file with every linear in a block type."""

from __future__ import annotations

import numpy as np

from llmplan.llm.formats.gguf.block_types import BY_NAME
from llmplan.llm.formats.gguf.mapped import SCALE_OFFSETS


def random_blocks(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random valid blocks of a K-quant type (gguf-py quantizes only the legacy ones): random bytes, each fp16
    scale finite in [-1/16, 1/16]; uint8 [rows, row bytes]."""
    t = BY_NAME[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * (k // t.block_size), t.type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS[name]:
        raw[:, off : off + 2] = rng.uniform(-1 / 16, 1 / 16, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)
