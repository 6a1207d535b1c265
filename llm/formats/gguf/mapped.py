"""A GGUF file mapped into memory: each tensor's blocks as a uint8 torch view on the mapping, never copied.

Why: the fp32 import costs 6.4x the file on disk and 1.7x its memory, and re-quantizing moves perplexity;
the native kernels (llm/kernels/gguf_blocks.c) compute straight from the file's own blocks, so the model
can run on the bytes as stored, paged in by the kernel on first touch and shared with the page cache.

The file is hostile data until checked. `file.py` has read the header and tensor table with every count
bounded; here each tensor is checked again against what the kernels will read (its bytes lie inside the
file, in no other tensor, and are whole rows of whole blocks of a type `block_types.py` knows), and a type
the kernels do not read (Q2_K, Q3_K, the IQ and ternary types) is refused, naming the tensor, with the way
out (convert it). Each failure is one `GGUFFileError` line naming the file and the tensor.

What these checks do not read is the blocks themselves: a NaN or infinite fp16 scale would give NaN logits.
`check_block_values` reads every block's scales once; it belongs with the first hashing of the file (the
hash then vouches for the bytes it checked), not with every start.

The mapping is private (MAP_PRIVATE, ACCESS_COPY): the file is opened read-only and never written, and
torch gets the writable buffer it wants; a stray write would change a private copy of one page, not the
file. A file truncated while mapped raises SIGBUS on access, as with any mapping: the hash recorded on
first use and the file's identity (llm/trust/hash_cache.py) are what guard against a file changed under us.
"""

from __future__ import annotations

import itertools
import mmap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import torch
from torch import Tensor

from ...model.weight_formats import GGUFWeight
from .block_types import BLOCK_TYPES, BlockType
from .file import GGUFFile, GGUFFileError, TensorInfo, open_gguf

# Byte offsets of each quantized block's fp16 scales (d, and dmin/m where it has one): ggml-common.h's layouts
SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
_FLOAT_VIEWS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_CHECK_BLOCKS = 1 << 16  # blocks checked at a time: bounded temporaries (a few hundred KB)


@dataclass(frozen=True)
class MappedTensor:
    """One tensor of the mapping: `blocks` uint8 [rows, row bytes], rows of the file's own blocks."""

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]
    """numpy order: (rows, columns) for a matrix, (columns,) for a vector."""
    blocks: Tensor

    @property
    def nbytes(self) -> int:
        return int(self.blocks.numel())

    def weight(self) -> GGUFWeight:
        """The tensor as a linear or embedding weight [rows, columns] of its own type (no copy)."""
        rows = self.shape[0] if len(self.shape) == 2 else 1
        return GGUFWeight(self.blocks, self.ggml_type, (rows, self.shape[-1]), self.type_name)


@dataclass
class MappedGGUF:
    """A mapped GGUF: its parsed header (`file`: metadata, tensor infos) and its tensors' block views.

    The views keep the mapping alive; `close` drops this object's references (the memory goes once the
    model that holds the views is gone too)."""

    path: Path
    file: GGUFFile
    tensors: dict[str, MappedTensor]
    _map: mmap.mmap | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def release(self, names: list[str]) -> int:
        """Give back the pages of tensors the model holds copies of (fused rows joined, Llama's q/k reordered):
        their file-backed pages leave this process's resident set (the page cache keeps them, shared) and are
        read again only if touched. Whole pages inside each tensor only; the bytes released."""
        if self._map is None:
            return 0
        released = 0
        for name in names:
            start, end = whole_pages(self.file.tensors[name])
            if end > start:
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
                released += end - start
        return released

    def drop_arrays(self) -> None:
        """Forget the header's array values (the vocabulary, merges, token scores: tens of MB as Python objects
        for a 150k-token vocabulary) once the config and weights are made; the tokenizer has its own files."""
        meta = self.file.metadata
        for key in [k for k, v in meta.items() if isinstance(v, list)]:
            meta[key] = []

    def close(self) -> None:
        self.tensors = {}
        self._map = None  # the mmap itself closes when the last view on it is freed

    def __enter__(self) -> MappedGGUF:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def whole_pages(info: TensorInfo) -> tuple[int, int]:
    """The file range [start, end) of the whole pages inside a tensor's bytes (end <= start: none)."""
    page = mmap.PAGESIZE
    return -(-info.offset // page) * page, (info.offset + info.nbytes) // page * page


def map_gguf(path: Path) -> MappedGGUF:
    """Map `path` and check every tensor as the kernels will read it; GGUFFileError (one line) when one fails."""
    path = Path(path)
    with open_gguf(path) as parsed:
        for info in parsed.tensors.values():
            check_tensor(path, info, parsed.size)
        _check_no_overlap(path, list(parsed.tensors.values()))
        if not parsed.tensors:
            raise GGUFFileError(f"{path}: holds no tensors")
        try:
            mapping = mmap.mmap(parsed._fd, 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as bad:
            raise GGUFFileError(f"{path}: cannot map the file ({bad})") from None
    # the descriptor is closed; the mapping stays valid (mmap keeps its own reference to the file)
    if len(mapping) != parsed.size:
        raise GGUFFileError(f"{path}: file changed while mapped ({len(mapping)} bytes, {parsed.size} parsed)")
    with warnings.catch_warnings():  # a private mapping is writable; torch's warning is for read-only buffers
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
    tensors = {name: _view(whole, info) for name, info in parsed.tensors.items()}
    return MappedGGUF(path, parsed, tensors, mapping)


def check_tensor(path: Path, info: TensorInfo, file_size: int) -> BlockType:
    """The tensor's block type, once its bytes are known to be whole rows of whole blocks inside the file."""
    found = BLOCK_TYPES.get(info.ggml_type)
    if found is None:
        raise GGUFFileError(
            f"{path}: tensor {info.name}: type {info.type_name} has no native block kernel, so it cannot run "
            "as stored; it needs conversion (load.convert dtype fp32, bf16, int8 or int4)"
        )
    if len(info.dims) > 2:
        raise GGUFFileError(f"{path}: tensor {info.name}: {len(info.dims)} dimensions; a weight has at most 2")
    columns, rows = info.dims[0], (info.dims[1] if len(info.dims) == 2 else 1)
    if columns % found.block_size:
        raise GGUFFileError(
            f"{path}: tensor {info.name}: {columns} columns are not whole {found.name} blocks of {found.block_size}"
        )
    want = rows * found.row_bytes(columns)
    if info.nbytes != want:
        raise GGUFFileError(f"{path}: tensor {info.name}: {info.nbytes} bytes, not whole {found.name} blocks ({want})")
    if info.offset < 0 or info.offset + info.nbytes > file_size:
        raise GGUFFileError(
            f"{path}: tensor {info.name}: bytes {info.offset} to {info.offset + info.nbytes} lie past the end "
            f"of the {file_size}-byte file"
        )
    return found


def _check_no_overlap(path: Path, infos: list[TensorInfo]) -> None:
    ordered = sorted(infos, key=lambda t: t.offset)
    for before, after in itertools.pairwise(ordered):
        if after.offset < before.offset + before.nbytes:
            raise GGUFFileError(f"{path}: tensor {after.name}: its bytes overlap tensor {before.name}'s; refused")


def _view(whole: Tensor, info: TensorInfo) -> MappedTensor:
    columns = info.dims[0]
    rows = info.nbytes // BLOCK_TYPES[info.ggml_type].row_bytes(columns)
    blocks = whole[info.offset : info.offset + info.nbytes].view(rows, -1)
    return MappedTensor(info.name, info.ggml_type, info.type_name, info.shape, blocks)


def check_block_values(mapped: MappedGGUF) -> int:
    """Read every block once: a NaN or infinite fp16 scale (or float value) is refused naming the tensor and
    block. Meant for the first hashing of the file, not every start (it reads every byte's page). Returns the
    number of blocks checked."""
    checked = 0
    for tensor in mapped.tensors.values():
        checked += _check_tensor_values(mapped.path, tensor)
    return checked


def _check_tensor_values(path: Path, tensor: MappedTensor) -> int:
    kind = BLOCK_TYPES[tensor.ggml_type]
    flat = tensor.blocks.reshape(-1)
    if tensor.type_name in _FLOAT_VIEWS:
        values = flat.view(_FLOAT_VIEWS[tensor.type_name])
        for begin in range(0, values.numel(), _CHECK_BLOCKS * 16):
            chunk = values[begin : begin + _CHECK_BLOCKS * 16]
            if not bool(torch.isfinite(chunk).all()):
                bad = begin + int((~torch.isfinite(chunk)).nonzero()[0, 0])
                raise GGUFFileError(f"{path}: tensor {tensor.name}: value {bad} is NaN or infinite; refused")
        return values.numel()
    blocks = flat.view(-1, kind.type_size)
    for begin in range(0, blocks.shape[0], _CHECK_BLOCKS):
        chunk = blocks[begin : begin + _CHECK_BLOCKS]
        for offset in SCALE_OFFSETS[tensor.type_name]:
            scales = chunk[:, offset : offset + 2].contiguous().view(torch.float16).reshape(-1)
            finite = torch.isfinite(scales)
            if not bool(finite.all()):
                bad = begin + int((~finite).nonzero()[0, 0])
                raise GGUFFileError(
                    f"{path}: tensor {tensor.name}: block {bad} has a NaN or infinite fp16 scale "
                    f"(byte {offset} of the block); refused"
                )
    return int(blocks.shape[0])
