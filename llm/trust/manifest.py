"""`SHA256SUMS` manifests: streamed hashing, reading and writing in the `sha256sum` format."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from llmplan.bounded_read import NotRegularFileError

MANIFEST_NAME = "SHA256SUMS"
_CHUNK = 8 << 20
_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")

ProgressFn = Callable[[int], None]
"""Called with the number of bytes just hashed, so a caller can drive a progress bar."""


class ManifestError(ValueError):
    """A `SHA256SUMS` file that cannot be parsed."""


def open_regular_fd(path: str | Path) -> int:
    """A blocking read-only descriptor of a regular file; NotRegularFileError (an OSError) for anything else.

    Opened non-blocking, so a FIFO in the file's place cannot hang the open, and checked with `fstat` on
    the descriptor, so what is checked is what is read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a file", str(path))
        raise NotRegularFileError(f"{path}: not a regular file (a FIFO, socket or device); refused")
    os.set_blocking(fd, True)
    return fd


def sha256_fd(fd: int, progress: ProgressFn | None = None) -> str:
    """The SHA-256 of everything from the descriptor's start, streamed in 8 MiB chunks."""
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, _CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
        if progress is not None:
            progress(len(chunk))
    return digest.hexdigest()


def sha256_file(path: str | Path, progress: ProgressFn | None = None) -> str:
    fd = open_regular_fd(path)
    try:
        return sha256_fd(fd, progress)
    finally:
        os.close(fd)


def read_sha256sums(path: str | Path) -> dict[str, str]:
    """Relative file name -> lowercase hex digest. Raises ManifestError naming the line."""
    from .files import FileProblem, read_text_limited

    path = Path(path)
    entries: dict[str, str] = {}
    try:
        text = read_text_limited(path)
    except FileProblem as bad:
        raise ManifestError(str(bad)) from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise ManifestError(f"{path}:{number}: not a 'HASH  FILE' line")
        name = match.group(2)
        if name in entries and entries[name] != match.group(1).lower():
            raise ManifestError(f"{path}:{number}: {name!r} is listed twice with different hashes")
        entries[name] = match.group(1).lower()
    return entries


def write_sha256sums(directory: str | Path, names: Iterable[str]) -> Path:
    """Hash each named file in `directory` and write the manifest atomically beside them."""
    directory = Path(directory)
    lines = [f"{sha256_file(directory / name)}  {name}\n" for name in sorted(names)]
    target = directory / MANIFEST_NAME
    temp = target.with_suffix(".tmp")
    temp.write_text("".join(lines), encoding="utf-8")
    os.replace(temp, target)
    return target


def manifest_fingerprint(path: str | Path) -> str:
    """A short identity of a whole checkpoint: the hash of its manifest's bytes."""
    from .files import FileProblem, read_bytes_limited

    try:
        return hashlib.sha256(read_bytes_limited(path)).hexdigest()[:16]
    except FileProblem as bad:
        raise ManifestError(str(bad)) from None
