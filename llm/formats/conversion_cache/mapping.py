"""A safetensors file mapped: each tensor a torch view on the file's pages, never copied.

Why: a converted model mapped from its cache entry costs no conversion and no copy at start; its pages are
file-backed (the page cache: shared by every process that maps the entry, evictable under pressure) instead
of anonymous memory each process fills for itself.

The header is checked before anything is mapped (llm/trust/checkpoint.py `read_safetensors_header`: bounded,
every span inside the file, no overlap, no gap); the entry's SHA-256 is checked by the caller. The mapping is
private (ACCESS_COPY): the file is opened read-only and never written, and a stray write would change a
private copy of one page, not the entry.
"""

from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ...trust.checkpoint import IntegrityError, open_regular, read_safetensors_header

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass
class MappedFile:
    path: Path
    tensors: dict[str, Tensor]
    nbytes: int
    _map: mmap.mmap | None = field(default=None, repr=False)


def map_safetensors(path: Path) -> MappedFile:
    """The file's tensors as views on one private mapping; IntegrityError (one line naming the file) when its
    header or size is wrong or a dtype is one torch cannot view."""
    header = read_safetensors_header(path)
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size != header.expected_size:
            raise IntegrityError(f"{path}: changed while it was opened")
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if header.expected_size else None
    except (OSError, ValueError) as bad:
        raise IntegrityError(f"{path}: cannot map the file ({bad})") from None
    finally:
        os.close(fd)  # the mapping keeps its own reference to the file
    start = header.expected_size - sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.tensors.values())
    tensors: dict[str, Tensor] = {}
    with warnings.catch_warnings():  # a private mapping is writable; torch's warning is for read-only buffers
        warnings.simplefilter("ignore", UserWarning)
        for name, entry in header.tensors.items():
            tensors[name] = _view(path, mapping, start, name, entry)
    data = sum(t.nbytes for t in tensors.values())
    return MappedFile(path, tensors, data, mapping)


def _view(path: Path, mapping: mmap.mmap | None, start: int, name: str, entry: dict) -> Tensor:
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise IntegrityError(f"{path}: tensor {name!r}: dtype {entry['dtype']} cannot be mapped")
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if mapping is None or end == begin:
        return torch.empty(shape, dtype=dtype)
    count = (end - begin) // dtype.itemsize
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + begin).view(shape)
