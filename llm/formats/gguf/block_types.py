"""The GGUF tensor types whose blocks the native kernels read as stored (llm/kernels/gguf_blocks.c).

A tensor row of K columns is K / `block_size` blocks of `type_size` bytes each (llama.cpp's ggml-common.h
layouts); `BLOCK_TYPES` maps a GGML type id (ggml.h's enum, as in a GGUF tensor's header) to its entry.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockType:
    ggml_type: int  # the id in ggml.h and in a GGUF tensor info
    name: str
    block_size: int  # elements a block
    type_size: int  # bytes a block

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` columns; ValueError where `k` is not whole blocks."""
        if k <= 0 or k % self.block_size:
            raise ValueError(f"{self.name}: {k} columns are not whole {self.block_size}-element blocks")
        return k // self.block_size * self.type_size


BLOCK_TYPES: dict[int, BlockType] = {
    t.ggml_type: t
    for t in (
        BlockType(0, "F32", 1, 4),
        BlockType(1, "F16", 1, 2),
        BlockType(2, "Q4_0", 32, 18),
        BlockType(3, "Q4_1", 32, 20),
        BlockType(6, "Q5_0", 32, 22),
        BlockType(7, "Q5_1", 32, 24),
        BlockType(8, "Q8_0", 32, 34),
        BlockType(12, "Q4_K", 256, 144),
        BlockType(13, "Q5_K", 256, 176),
        BlockType(14, "Q6_K", 256, 210),
        BlockType(30, "BF16", 1, 2),
    )
}
BY_NAME: dict[str, BlockType] = {t.name: t for t in BLOCK_TYPES.values()}


def block_type(ggml_type: int) -> BlockType:
    """The entry of a GGML type id; ValueError naming the type for one the kernels do not read."""
    found = BLOCK_TYPES.get(ggml_type)
    if found is None:
        names = ", ".join(t.name for t in BLOCK_TYPES.values())
        raise ValueError(f"GGML type {ggml_type} has no native block kernel (these do: {names})")
    return found
