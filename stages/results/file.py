"""Which file may become, or already is, a results database: decided before anything writes to it.

A path is usable when nothing is there (the database is then made whole in a hidden file beside it and
linked into place, so no other process ever sees a half-made one), or when the file is a regular file
whose first 100 bytes are an SQLite header that llmplan wrote: our `application_id`, a `user_version` this
llmplan reads, whole pages. A file whose header says nothing (application_id 0: a database written before
llmplan stamped its files, or another program's) is looked at through an immutable read-only connection,
which takes no lock and creates no `-wal`/`-shm` file; the store then compares its tables with ours.
Anything else — another program's database, a non-SQLite file, an empty or truncated file, a directory,
a FIFO, a device — is refused with one line naming it, and left exactly as it was.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

APPLICATION_ID = 0x6C6C6D70  # "llmp": PRAGMA application_id of every results database llmplan writes
HEADER_BYTES = 100
MAGIC = b"SQLite format 3\x00"
_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}
# A checkpoint of another llmplan process writes page 1 (with the new page count) before the pages that
# grow the file: a file that looks short is read again for this long before it is called truncated.
_SETTLE_S = 0.3


class StoreError(Exception):
    """The database cannot be used: not ours, damaged, a newer schema, or locked for too long. One line."""


def refusal(path: str | Path, reason: str) -> StoreError:
    return StoreError(f"{path}: cannot use the results database: {reason}")


def path_problem(path: str | Path) -> str | None:
    """Why `path` can never hold a results database (None: it can), from its kind alone, reading nothing.

    A regular file, or a new name in a folder that exists or can be made; never a directory, a FIFO, a
    device, a socket, a link to nothing, or a name below a file.
    """
    text = str(path)
    if not text.strip():
        return "db is empty; give the results database's file path"
    if "\x00" in text:
        return "db contains a NUL character; give the results database's file path"
    target = Path(text).expanduser()
    try:
        mode = os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):
        if os.path.lexists(target):
            return f"{target}: is a symbolic link to nothing; give the results database's file path"
        folder = target.absolute().parent
        while not os.path.lexists(folder) and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            return f"{target}: {folder} is not a folder, so the results database cannot be made there"
        return None
    except OSError as bad:
        return f"{target}: cannot look at the results database ({bad.strerror or bad})"
    if stat.S_ISREG(mode):
        return None
    what = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
    return f"{target}: is {what}, not a results database file; give a file path"


@dataclass(frozen=True)
class Header:
    """The fields of an SQLite file header that decide whether the file is ours (sqlite.org/fileformat2)."""

    size: int
    page_size: int
    pages: int | None  # the in-header database size, when the header says it is valid
    application_id: int
    user_version: int


def read_header(path: Path) -> Header | None:
    """The file's header (None: nothing at `path`); StoreError for anything that is not a whole SQLite file.

    Opened non-blocking and checked with fstat on the descriptor, so a FIFO swapped in cannot hang the read.
    """
    deadline = time.monotonic() + _SETTLE_S
    while True:
        problem = path_problem(path)
        if problem is not None:
            raise StoreError(problem)
        try:
            header, short = _read_header_once(path)
        except FileNotFoundError:
            return None
        if short is None or time.monotonic() >= deadline:
            if short is not None:
                raise refusal(path, short)
            return header
        time.sleep(0.02)


def _read_header_once(path: Path) -> tuple[Header, str | None]:
    """(the header, why the file looks truncated or None); StoreError when it is not an SQLite file at all."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as bad:
        raise refusal(path, f"cannot read it ({bad.strerror or bad})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refusal(path, "not a regular file")
        data = os.read(fd, HEADER_BYTES)
    finally:
        os.close(fd)
    size = info.st_size
    if size == 0:
        raise refusal(path, "it is an empty file that llmplan did not write; remove it or choose another path")
    if not data.startswith(MAGIC[: len(data)]):
        raise refusal(path, "it is not an SQLite database; choose another path")
    if len(data) < HEADER_BYTES:
        raise refusal(path, f"it is truncated ({size} bytes, shorter than an SQLite header)")
    raw_page = int.from_bytes(data[16:18], "big")
    page_size = 65536 if raw_page == 1 else raw_page
    if page_size < 512 or page_size & (page_size - 1) or data[18] not in (1, 2) or data[19] not in (1, 2):
        raise refusal(path, "its SQLite header is damaged (page size or file format); choose another path")
    valid_count = data[24:28] == data[92:96]
    pages = int.from_bytes(data[28:32], "big") if valid_count and data[28:32] != bytes(4) else None
    header = Header(
        size=size,
        page_size=page_size,
        pages=pages,
        application_id=int.from_bytes(data[68:72], "big", signed=True),
        user_version=int.from_bytes(data[60:64], "big", signed=True),
    )
    short = None
    if size % page_size:
        short = f"it is truncated ({size} bytes, not a whole number of {page_size}-byte pages)"
    elif pages is not None and size < pages * page_size:
        short = f"it is truncated ({size} bytes; its header promises {pages} pages of {page_size} bytes)"
    return header, short


@contextlib.contextmanager
def immutable_connection(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection that cannot write, lock or create anything beside the file (`immutable=1`)."""
    uri = f"file:{quote(str(path.absolute()))}?mode=ro&immutable=1"
    conn = sqlite3.connect(uri, uri=True)
    try:
        yield conn
    finally:
        conn.close()


def create_whole(path: Path, build: Callable[[sqlite3.Connection], None]) -> None:
    """Make the database at `path` complete in a hidden file beside it, then link it into place.

    A hard link never replaces: if another process linked its own first, that one is kept (it is as
    complete as ours) and ours is dropped. Without hard links (some file systems) the file is renamed in,
    which replaces nothing when no other llmplan raced us.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.llmplan-new-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        conn = sqlite3.connect(str(temp), isolation_level=None)
        try:
            build(conn)
        finally:
            conn.close()  # the last connection: checkpoints, so the file holds everything, no -wal
        try:
            os.link(temp, path)
        except FileExistsError:
            pass  # another process made it first
        except OSError:
            if not os.path.lexists(path):
                os.rename(temp, path)
    finally:
        for leftover in (temp, *(temp.with_name(temp.name + s) for s in ("-wal", "-shm", "-journal"))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
