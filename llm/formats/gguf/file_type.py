"""What a GGUF is quantized as, in llama.cpp's own words ("Q4_K_M", "Q8_0", "F32"), read from the file.

llama.cpp's tools write `general.file_type` (a `LlamaFileType`: MOSTLY_Q4_K_M is "Q4_K_M", ALL_F32 "F32");
a file without it (or with GUESSED) is named by the ggml type holding the most weights of its matrices.
A K-quant mix is more than one type (Q4_K_M keeps some tensors in Q5_0, Q6_K, Q8_0): the file type names
the recipe, `tensor_bytes` says what it came to.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .file import GGUFFile, open_gguf

FILE_TYPE_KEY = "general.file_type"


@dataclass(frozen=True)
class GGUFType:
    name: str  # "Q4_K_M", "Q8_0", "F32"
    source: str  # "general.file_type" or "most weights" (no file type in the header)
    file_bytes: int
    tensor_bytes: dict[str, int]  # ggml type name -> bytes of the tensors stored in it


def file_type_names() -> dict[int, str]:
    """LlamaFileType's values -> llama.cpp's names (the ones llama-quantize takes)."""
    from gguf import LlamaFileType

    return {
        int(e.value): e.name.removeprefix("MOSTLY_").removeprefix("ALL_") for e in LlamaFileType if e.name != "GUESSED"
    }


def gguf_type_of(gguf: GGUFFile) -> GGUFType:
    by_bytes: Counter[str] = Counter()
    by_weights: Counter[str] = Counter()
    for tensor in gguf.tensors.values():
        by_bytes[tensor.type_name] += tensor.nbytes
        if len(tensor.dims) >= 2:  # matrices: the norms' F32 vectors say nothing of the quantization
            count = 1
            for d in tensor.dims:
                count *= d
            by_weights[tensor.type_name] += count
    code = gguf.metadata.get(FILE_TYPE_KEY)
    name = file_type_names().get(code) if isinstance(code, int) else None
    if name is not None:
        return GGUFType(name, FILE_TYPE_KEY, gguf.size, dict(by_bytes))
    most = (by_weights or by_bytes).most_common(1)
    return GGUFType(most[0][0] if most else "F32", "most weights", gguf.size, dict(by_bytes))


def gguf_type(path: Path) -> GGUFType:
    """The type of the GGUF at `path` (GGUFFileError, one line, when it is not a well-formed GGUF)."""
    with open_gguf(Path(path)) as gguf:
        return gguf_type_of(gguf)


def nominal_bits(name: str) -> int | None:
    """The bits a weight a type's name promises: F32 32, F16/BF16 16, Q4_K_M / IQ4_XS 4, Q8_0 8; None if
    the name is none of those shapes."""
    upper = name.upper()
    if upper in ("F32", "F16", "BF16", "F64"):
        return 64 if upper == "F64" else 32 if upper == "F32" else 16
    match = re.match(r"(?:I|T)?Q(\d)", upper)
    return int(match.group(1)) if match else None
