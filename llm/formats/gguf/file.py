"""A GGUF file's header and tensor table, read with every count checked against the file before it is used.

gguf-py's `GGUFReader` trusts the header: a string or array length, a tensor count or a dimension is used
as given (a loop of 10^12 iterations, a memory map sliced past the end), and tensor offsets are neither
aligned, bounded nor checked for overlap (two tensors sharing bytes imported as garbage, exit 0). This
reader takes nothing on trust:

* regular files only (a FIFO or a device is refused before a byte is read), read with `pread` from one
  descriptor, so what was checked is what is read;
* every length and count is checked against the bytes left in the file, and against a sane limit, before
  anything is allocated for it;
* every tensor has a known ggml type, at most 4 dimensions, a byte size that follows from its type and
  shape, an aligned offset, and data that lies inside the file and overlaps no other tensor's.

Failures are `GGUFFileError`, one line naming the file and the key or tensor.
"""

from __future__ import annotations

import itertools
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 16
MAX_KEY_BYTES = 1 << 16
MAX_STRING_BYTES = 64 << 20  # a chat template or a license; far below this
MAX_TENSOR_NAME_BYTES = 1024  # llama.cpp's own limit is 64
MAX_ARRAY_ITEMS = 1 << 22  # the largest vocabularies and merge lists hold well under a million
MAX_ALIGNMENT = 1 << 16
_READ_AHEAD = 1 << 20

# GGUF value types -> (struct format, size); 8 is a string, 9 an array
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<B", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}  # fmt: skip
_NUMPY: dict[int, str] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 10: "<u8", 11: "<i8"}
_NUMPY[12] = "<f8"
_STRING, _ARRAY, _BOOL = 8, 9, 7
# ggml types whose data numpy reads as plain elements (the others are blocks of bytes)
_PLAIN = {0: "<f4", 1: "<f2", 24: "<i1", 25: "<i2", 26: "<i4", 27: "<i8", 28: "<f8"}


class GGUFFileError(ValueError):
    """The file is not a well-formed GGUF: one line naming the file and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    type_name: str
    dims: tuple[int, ...]
    """ggml order: fastest-varying first (numpy's shape is the reverse)."""
    offset: int
    """Absolute offset of the data in the file."""
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    """Key -> value: int, float, bool or str; arrays as lists of those."""
    types: dict[str, str]
    """Key -> its GGUF value type's name ("u32", "string", "array[string]"...), for messages and checks."""
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    size: int
    _fd: int

    def read(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's data: plain types as their elements in numpy's (reversed) shape, quantized ones as
        bytes shaped [..., row bytes] (what gguf-py's `quants.dequantize` takes). A copy, not a mapping: a
        file truncated under us gives a short read (refused), never a SIGBUS."""
        data = os.pread(self._fd, tensor.nbytes, tensor.offset)
        if len(data) != tensor.nbytes:
            raise GGUFFileError(f"{self.path}: tensor {tensor.name}: file changed while read (short read)")
        plain = _PLAIN.get(tensor.ggml_type)
        if plain is not None:
            return np.frombuffer(data, dtype=plain).reshape(tensor.shape)
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
        shape = (*tensor.shape[:-1], tensor.shape[-1] // block * type_size)
        return np.frombuffer(data, dtype=np.uint8).reshape(shape)


@contextmanager
def open_gguf(path: Path) -> Iterator[GGUFFile]:
    """Parse and check the header and tensor table of `path`; the descriptor stays open for `read`."""
    path = Path(path)
    fd = _open_regular(path)
    try:
        yield _parse(path, fd)
    finally:
        os.close(fd)


def _open_regular(path: Path) -> int:
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        raise GGUFFileError(f"{path}: cannot open ({error.strerror or error})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
        raise GGUFFileError(f"{path}: {kind}; refused")
    os.set_blocking(fd, True)
    return fd


class _Cursor:
    """Sequential reads from a descriptor, each checked against the bytes the file has left."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path, self.fd, self.size = path, fd, size
        self.pos = 0
        self._buf = b""
        self._start = 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise GGUFFileError(f"{self.path}: {what} needs {n} bytes at offset {self.pos}, the file has {self.left}")
        end = self.pos + n
        if self.pos < self._start or end > self._start + len(self._buf):
            self._buf = os.pread(self.fd, max(n, _READ_AHEAD), self.pos)
            self._start = self.pos
            if len(self._buf) < n:
                raise GGUFFileError(f"{self.path}: file changed while read (short read at offset {self.pos})")
        chunk = self._buf[self.pos - self._start : end - self._start]
        self.pos = end
        return chunk

    def unpack(self, fmt: str, size: int, what: str) -> Any:
        return struct.unpack(fmt, self.take(size, what))[0]

    def count(self, what: str, limit: int, each: int) -> int:
        """A u64 count of items at least `each` bytes long: within `limit` and what the file still holds."""
        n = self.unpack("<Q", 8, what)
        if n > limit:
            raise GGUFFileError(f"{self.path}: {what} is {n}, more than the limit of {limit}; refused")
        if n * each > self.left:
            raise GGUFFileError(f"{self.path}: {what} is {n}, but only {self.left} bytes follow; refused")
        return n

    def string(self, what: str, limit: int) -> str:
        n = self.count(f"{what}: length", limit, 1)
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise GGUFFileError(f"{self.path}: {what} is not UTF-8 ({bad.reason} at byte {bad.start})") from None


def _parse(path: Path, fd: int) -> GGUFFile:
    size = os.fstat(fd).st_size
    cur = _Cursor(path, fd, size)
    if size < 24 or cur.take(4, "magic") != MAGIC:
        raise GGUFFileError(f"{path}: no GGUF magic at the start (not a GGUF file)")
    version = cur.unpack("<I", 4, "version")
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in SUPPORTED_VERSIONS:
            raise GGUFFileError(f"{path}: big-endian GGUF is not supported")
        raise GGUFFileError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors = cur.count("tensor count", MAX_TENSORS, 24)  # a tensor's entry takes at least 24 bytes
    n_keys = cur.count("metadata key count", MAX_KEYS, 13)  # a key/value at least 13

    metadata: dict[str, Any] = {}
    types: dict[str, str] = {}
    for i in range(n_keys):
        key = cur.string(f"metadata key #{i}", MAX_KEY_BYTES)
        if key in metadata:
            raise GGUFFileError(f"{path}: metadata key {key} appears twice")
        kind = cur.unpack("<I", 4, f"metadata {key}: type")
        metadata[key], types[key] = _value(cur, key, kind)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and types["general.alignment"] != "u32":
        raise GGUFFileError(f"{path}: metadata general.alignment: expected u32, got {types['general.alignment']}")
    if not 1 <= alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise GGUFFileError(f"{path}: metadata general.alignment {alignment} is not a power of two up to 65536")

    infos: list[tuple[str, int, tuple[int, ...], int]] = []
    for i in range(n_tensors):
        name = cur.string(f"tensor #{i} name", MAX_TENSOR_NAME_BYTES) or f"#{i} (no name)"
        n_dims = cur.unpack("<I", 4, f"tensor {name}: dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFFileError(f"{path}: tensor {name}: {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = struct.unpack(f"<{n_dims}Q", cur.take(8 * n_dims, f"tensor {name}: dimensions"))
        ggml_type = cur.unpack("<I", 4, f"tensor {name}: type")
        offset = cur.unpack("<Q", 8, f"tensor {name}: offset")
        infos.append((name, ggml_type, dims, offset))
    data_offset = -(-cur.pos // alignment) * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, ggml_type, dims, offset in infos:
        if name in tensors:
            raise GGUFFileError(f"{path}: tensor {name} appears twice")
        tensors[name] = _tensor(path, name, ggml_type, dims, offset, alignment, data_offset, size)
    _check_overlap(path, list(tensors.values()))
    return GGUFFile(path, version, metadata, types, tensors, alignment, data_offset, size, fd)


def _value(cur: _Cursor, key: str, kind: int) -> tuple[Any, str]:
    if kind == _STRING:
        return cur.string(f"metadata {key}", MAX_STRING_BYTES), "string"
    if kind in _SCALARS:
        fmt, size = _SCALARS[kind]
        value = cur.unpack(fmt, size, f"metadata {key}")
        if kind == _BOOL:
            if value not in (0, 1):
                raise GGUFFileError(f"{cur.path}: metadata {key}: bool byte {value} is neither 0 nor 1")
            return bool(value), "bool"
        return value, _type_name(kind)
    if kind == _ARRAY:
        item = cur.unpack("<I", 4, f"metadata {key}: array item type")
        if item == _STRING:
            n = cur.count(f"metadata {key}: array length", MAX_ARRAY_ITEMS, 8)
            return [cur.string(f"metadata {key}[{i}]", MAX_STRING_BYTES) for i in range(n)], "array[string]"
        if item in _SCALARS:
            size = _SCALARS[item][1]
            n = cur.count(f"metadata {key}: array length", MAX_ARRAY_ITEMS, size)
            raw = cur.take(n * size, f"metadata {key}")
            if item == _BOOL:
                values = np.frombuffer(raw, dtype=np.uint8)
                if values.size and int(values.max()) > 1:
                    raise GGUFFileError(f"{cur.path}: metadata {key}: a bool entry is neither 0 nor 1")
                return values.astype(bool).tolist(), "array[bool]"
            return np.frombuffer(raw, dtype=_NUMPY[item]).tolist(), f"array[{_type_name(item)}]"
        what = "arrays of arrays are" if item == _ARRAY else f"array item type {item} is"
        raise GGUFFileError(f"{cur.path}: metadata {key}: {what} not supported")
    raise GGUFFileError(f"{cur.path}: metadata {key}: unknown value type {kind}")


def _type_name(kind: int) -> str:
    return {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 10: "u64", 11: "i64", 12: "f64"}[kind]


def _tensor(
    path: Path, name: str, ggml_type: int, dims: tuple[int, ...], offset: int, alignment: int, base: int, size: int
) -> TensorInfo:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise GGUFFileError(f"{path}: tensor {name}: unknown ggml type {ggml_type}; refused") from None
    if any(d < 1 for d in dims):
        raise GGUFFileError(f"{path}: tensor {name}: dimensions {list(dims)} include 0")
    if dims[0] % block:
        raise GGUFFileError(
            f"{path}: tensor {name}: row length {dims[0]} is not a multiple of {qtype.name}'s block of {block}"
        )
    elements = 1
    for d in dims:  # Python integers: a product of four u64 cannot wrap around
        elements *= d
    nbytes = elements // block * type_size
    if offset % alignment:
        raise GGUFFileError(f"{path}: tensor {name}: offset {offset} is not a multiple of the alignment {alignment}")
    begin = base + offset
    if begin + nbytes > size:
        raise GGUFFileError(
            f"{path}: tensor {name}: {qtype.name}{list(dims)} needs {nbytes} bytes at offset {begin}, "
            f"past the end of the {size}-byte file"
        )
    return TensorInfo(name, ggml_type, qtype.name, tuple(dims), begin, nbytes)


def _check_overlap(path: Path, tensors: list[TensorInfo]) -> None:
    ordered = sorted(tensors, key=lambda t: t.offset)
    for before, after in itertools.pairwise(ordered):
        if after.offset < before.offset + before.nbytes:
            raise GGUFFileError(
                f"{path}: tensors {before.name} and {after.name} overlap (bytes {after.offset} to "
                f"{min(after.offset + after.nbytes, before.offset + before.nbytes)} belong to both); refused"
            )
