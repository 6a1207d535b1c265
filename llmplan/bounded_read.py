"""Bounded reads of small files, shared by every layer (the engine's plans, the library's checkpoint files).

It lives in the top-level package because `engine` and `llm` may not import each other: one reader, each
layer turning its exceptions into its own kind of message.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_limited(path: str | Path, limit: int, what: str = "file") -> bytes:
    """At most `limit` bytes of a regular file; anything else is refused with a one-line reason.

    The limit counts bytes actually read (limit + 1 are asked for), never `st_size`: a FIFO, a device
    such as /dev/zero, or a file growing while read reports a size that means nothing. The file is
    opened non-blocking so that opening a FIFO with no writer cannot hang, and `fstat` on the open
    descriptor (not the name) decides whether it is a regular file.
    """
    data, size = read_head(path, limit + 1, what)
    if len(data) > limit:
        raise TooLargeError(path, max(size, len(data)), limit)
    return data


def read_head(path: str | Path, limit: int, what: str = "file") -> tuple[bytes, int]:
    """(the first `limit` bytes of a regular file, its size when opened); refused as `read_limited` refuses.

    For a file that may be far larger than what is used of it (a text to score): only the head is read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        mode = info.st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(f"{path}: is a directory, not a {what}")
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(f"{path}: not a regular file (a FIFO, socket or device); refused")
        chunks: list[bytes] = []
        total = 0
        while total < limit:
            chunk = os.read(fd, min(1 << 20, limit - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks), info.st_size


class NotRegularFileError(OSError):
    """A path that is not a regular file where one is required (FIFO, device, socket)."""


class TooLargeError(OSError):
    """A file with more bytes than its reading limit (`size`: at least this many bytes)."""

    def __init__(self, path: str | Path, size: int, limit: int) -> None:
        super().__init__(f"{path}: {size} bytes; the limit is {limit}")
        self.size, self.limit = size, limit
