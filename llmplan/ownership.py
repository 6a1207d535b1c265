"""Which paths llmplan may write: one that does not exist, or one llmplan wrote and can prove it. Nothing else.

The proof is a marker `.NAME.llmplan` beside NAME (a file, an append-only log, or a directory) that records the
identity of what it vouches for: the device and inode, and the size and SHA-256 of the content (of a log, of
the part llmplan wrote; of a directory, a digest over every entry's path, kind, size and mtime). The marker
is sealed with an HMAC under a key only this user's llmplan holds (`ownership.key`, see `key_home`, mode
0600), so a marker someone wrote by hand, one copied beside a copy, and one whose file was edited since all
prove nothing. Anything else is refused with one line naming the path (`NotOurs`), before any work starts.

Writes are atomic: a temp file `.NAME.llmplan-PID-RANDOM.tmp` in the same folder, flushed, checked once
more, vouched for by the marker (written the same way; it also vouches for what it replaces, so a kill at
any moment leaves a path llmplan can still prove), and renamed into place. A temp file whose process is gone
(a killed run) is removed by the next write of that NAME. It lives in the top-level package because the
engine (run directories, graphs), the stages (sinks), the library (checkpoints) and the commands (report,
bench) all write, and may not import one another.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

Kind = Literal["file", "log", "directory"]

MARKER_SUFFIX = ".llmplan"
TEMP_TAG = ".llmplan-"
KEY_NAME = "ownership.key"
_KEY_BYTES = 32
_MAX_MARKER_BYTES = 4096
_MAX_OWNED_BYTES = 1 << 30  # a file bigger than this is not read back to prove it is ours
_MAX_TREE_ENTRIES = 100_000  # a directory with more entries is not listed to prove it is ours
_SQLITE_MAGIC = b"SQLite format 3\x00"
_TREE_IGNORED = ".llmplan-hashes.json"  # the verify stage's hash cache (and its temp) inside a checkpoint it read
_TEMP_PID = re.compile(r"\.llmplan-(\d+)-[0-9a-f]+\.tmp$")
_SPECIAL = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class NotOurs(Exception):
    """A path llmplan may not write; the message is one line naming it and what to do."""


# --- the key --------------------------------------------------------------------------------------

_keys: dict[str, bytes | None] = {}
_keys_lock = threading.Lock()


def key_home() -> Path:
    """Where the sealing key lives: `$LLMPLAN_STATE_HOME`, else `$XDG_STATE_HOME/llmplan`, else
    `~/.local/state/llmplan`. Not in the model cache: outputs belong to the user, not to one cache, so pointing
    `LLMPLAN_CACHE` elsewhere (a test, a second disk) must not disown what llmplan wrote before."""
    explicit = os.environ.get("LLMPLAN_STATE_HOME")
    if explicit:
        return Path(explicit)
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "llmplan"


def _key() -> bytes | None:
    """This user's sealing key, made on first use; None when the cache can be neither read nor written."""
    path = key_home() / KEY_NAME
    with _keys_lock:
        if str(path) not in _keys:
            _keys[str(path)] = _read_key(path) or _make_key(path)
        return _keys[str(path)]


def _earlier_key() -> bytes | None:
    """The key llmplan 0.2 kept in the model cache (read, never made): what it sealed stays provably ours."""
    cache = os.environ.get("LLMPLAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmplan")
    return _read_key(Path(cache) / KEY_NAME)


def _read_key(path: Path) -> bytes | None:
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size != _KEY_BYTES:
            return None
        with open(path, "rb") as handle:
            key = handle.read(_KEY_BYTES + 1)
    except OSError:
        return None
    return key if len(key) == _KEY_BYTES else None


def _make_key(path: Path) -> bytes | None:
    """Written whole under a temp name and linked into place: two processes starting at once agree on one key."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{KEY_NAME}{TEMP_TAG}{os.getpid()}-{secrets.token_hex(4)}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(_KEY_BYTES))
                handle.flush()
                os.fsync(handle.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(temp, path)
        finally:
            temp.unlink(missing_ok=True)
    except OSError:
        return None
    return _read_key(path)


def _seal(record: dict[str, object], key: bytes) -> str:
    body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hmac.new(key, body, hashlib.sha256).hexdigest()


# --- what a marker vouches for --------------------------------------------------------------------


def marker_of(path: Path) -> Path:
    return path.with_name(f".{path.name}{MARKER_SUFFIX}")


def _identity(path: Path, kind: Kind, prefix: int | None = None) -> dict[str, object] | None:
    """What `path` is now, in the marker's terms; None if it cannot be read back (too large, vanished)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if kind == "directory":
        if not stat.S_ISDIR(info.st_mode):
            return None
        digest = _tree_digest(path)
        if digest is None:
            return None
        return {"kind": kind, "dev": info.st_dev, "ino": info.st_ino, "sha256": digest}
    if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_OWNED_BYTES:
        return None
    size = info.st_size if prefix is None else prefix
    if size > info.st_size:
        return None
    digest = _file_digest(path, size)
    if digest is None:
        return None
    return {"kind": kind, "dev": info.st_dev, "ino": info.st_ino, "size": size, "sha256": digest}


def _file_digest(path: Path, size: int) -> str | None:
    """SHA-256 of the first `size` bytes, read through a descriptor that never follows a link."""
    digest = hashlib.sha256()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        left = size
        while left:
            chunk = handle.read(min(left, 1 << 20))
            if not chunk:
                return None  # shorter than it was: not what the marker saw
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _tree_digest(root: Path) -> str | None:
    """A digest over every entry below `root`: relative path, kind, size and mtime (not the content: a
    checkpoint's weights are gigabytes, and an edit changes the mtime)."""
    rows = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            if dirpath == str(root) and name.startswith(_TREE_IGNORED):
                continue
            full = os.path.join(dirpath, name)
            try:
                info = os.lstat(full)
            except OSError:
                return None
            kind = "dir" if stat.S_ISDIR(info.st_mode) else "file" if stat.S_ISREG(info.st_mode) else "other"
            size = info.st_size if kind == "file" else 0
            rows.append(f"{os.path.relpath(full, root)}\0{kind}\0{size}\0{info.st_mtime_ns if kind == 'file' else 0}")
            if len(rows) > _MAX_TREE_ENTRIES:
                return None
        dirnames.sort()
    return hashlib.sha256("\n".join(sorted(rows)).encode("utf-8")).hexdigest()


def _read_marker(marker: Path) -> dict[str, object] | None:
    """The marker's record if it is a regular file llmplan sealed (for any content); None otherwise."""
    key = _key()
    try:
        info = os.lstat(marker)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_MARKER_BYTES:
            return None
        with open(marker, "rb") as handle:
            record = json.loads(handle.read(_MAX_MARKER_BYTES + 1).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("mac"), str):
        return None
    mac = record.pop("mac")
    if key is not None and hmac.compare_digest(mac, _seal(record, key)):
        return record
    earlier = _earlier_key()  # read only when the current key does not prove it: most markers never get here
    return record if earlier is not None and hmac.compare_digest(mac, _seal(record, earlier)) else None


def _matching(path: Path, kind: Kind) -> dict[str, object] | None:
    """The identity in the marker that matches what is at `path` now (None: nothing llmplan can prove).

    A marker vouches for what llmplan is about to rename into place and for what was there before, so a run
    killed between the marker and the rename leaves a path that is still provably llmplan's either way."""
    record = _read_marker(marker_of(path))
    if record is None or record.get("vouches_for") != path.name:
        return None
    for identity in (record.get("current"), record.get("previous")):
        if not isinstance(identity, dict) or identity.get("kind") != kind:
            continue
        prefix = identity.get("size") if kind == "log" else None
        if prefix is not None and not isinstance(prefix, int):
            continue
        now = _identity(path, kind, prefix)
        if now is not None and all(identity.get(k) == v for k, v in now.items()):
            return identity
    return None


def owned(path: Path, kind: Kind) -> bool:
    """Whether llmplan wrote `path` as it is now (the marker's record matches what is there)."""
    return _matching(Path(path), kind) is not None


def identity_of(path: Path, kind: Kind) -> dict[str, object] | None:
    """What a marker would record for `path` now (for `vouch` before a rename: the rename keeps it)."""
    return _identity(Path(path), kind)


def vouch(path: Path, kind: Kind, identity: dict[str, object] | None) -> None:
    """Write the marker vouching for `identity` (what is, or is about to be renamed, at `path`), and for what
    is at `path` now if llmplan wrote it."""
    path = Path(path)
    key = _key()
    if key is None or identity is None:
        return  # nothing can be proved: the next run will find the path taken and say so
    previous = _matching(path, kind)
    record = {"written_by": "llmplan", "vouches_for": path.name, "current": identity, "previous": previous}
    text = json.dumps({**record, "mac": _seal(record, key)}) + "\n"
    marker = marker_of(path)
    _check_marker_slot(marker)
    temp, fd = _open_temp(marker)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, marker)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def claim(path: Path, kind: Kind) -> None:
    """Write the marker vouching for `path` as it is now (a log: for all it holds now)."""
    vouch(Path(path), kind, _identity(Path(path), kind))


# --- the checks -----------------------------------------------------------------------------------


def check_writable(path: Path, kind: Kind = "file", what: str = "") -> None:
    """Raise NotOurs unless `path` is absent or something llmplan wrote and can prove it (module doc)."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        _check_marker_slot(marker_of(path), what)
        return
    except OSError as bad:
        raise NotOurs(f"{label}: cannot check it ({bad.strerror or bad})") from None
    mode = info.st_mode
    if stat.S_ISLNK(mode):
        raise NotOurs(f"{label}: is a symbolic link; llmplan writes only files it owns; choose another path")
    if kind == "directory":
        if not stat.S_ISDIR(mode):
            raise NotOurs(f"{label}: exists and is not a directory; move it away or choose another path")
    elif stat.S_ISDIR(mode):
        raise NotOurs(f"{label}: is a directory, not a file; choose another path")
    elif not stat.S_ISREG(mode):
        special = _SPECIAL.get(stat.S_IFMT(mode), "not a regular file")
        raise NotOurs(f"{label}: is {special}; llmplan writes only regular files it owns; choose another path")
    if not owned(path, kind):
        if kind != "directory" and _is_sqlite(path):
            raise NotOurs(f"{label}: is an SQLite database llmplan did not write; choose another path")
        noun = "directory" if kind == "directory" else "file"
        raise NotOurs(
            f"{label}: exists and is not a {noun} llmplan wrote (or was changed since); move it away or choose "
            "another path"
        )


def _check_marker_slot(marker: Path, what: str = "") -> None:
    """The marker's own path must be free or hold a marker llmplan sealed: never someone's file."""
    try:
        os.lstat(marker)
    except FileNotFoundError:
        return
    except OSError as bad:
        raise NotOurs(f"{marker}: cannot check it ({bad.strerror or bad})") from None
    if _read_marker(marker) is None:
        label = f"{what} {marker}" if what else str(marker)
        raise NotOurs(f"{label}: exists and is not a marker llmplan wrote; move it away or choose another path")


def check_directory_ours(folder: Path, what: str = "") -> None:
    """An existing folder llmplan writes into (a run directory, a report) holds nothing but llmplan's files:
    every entry is a file or folder llmplan can prove it wrote, a marker it sealed, or a write's temp file."""
    folder = Path(folder)
    label = f"{what} {folder}" if what else str(folder)
    try:
        info = os.stat(folder)  # the folder named may be a link to one: what counts is what is inside
    except FileNotFoundError:
        return
    except OSError as bad:
        raise NotOurs(f"{label}: cannot check it ({bad.strerror or bad})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise NotOurs(f"{label}: exists and is not a directory; choose another path")
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as bad:
        raise NotOurs(f"{label}: cannot list it ({bad.strerror or bad})") from None
    for entry in entries[:_MAX_TREE_ENTRIES]:
        path = Path(entry.path)
        if entry.name.startswith(".") and _TEMP_PID.search(entry.name):
            continue  # a temp file of an llmplan write (a dead run's, removed by the next write of its NAME)
        if entry.name.startswith(".") and entry.name.endswith(MARKER_SUFFIX):
            if _read_marker(path) is not None:
                continue
            raise NotOurs(
                f"{label}: holds {path.name}, which llmplan did not write; choose a new or empty directory"
            )
        if entry.is_dir(follow_symlinks=False):
            check_directory_ours(path, what)
        elif not (entry.is_file(follow_symlinks=False) and (owned(path, "file") or owned(path, "log"))):
            raise NotOurs(
                f"{label}: holds {path.name}, which llmplan did not write; choose a new or empty directory"
            )
    if len(entries) > _MAX_TREE_ENTRIES:
        raise NotOurs(f"{label}: holds too many entries to check; choose a new or empty directory")


def _is_sqlite(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(len(_SQLITE_MAGIC)) == _SQLITE_MAGIC
    except OSError:
        return False


# --- writing --------------------------------------------------------------------------------------

_path_locks: dict[str, threading.Lock] = {}
_path_locks_lock = threading.Lock()


def _lock_for(path: Path) -> threading.Lock:
    """One writer at a time per path in this process (a server's requests write one generations.json):
    check, rename and marker go together, or the second writer would find the first's file unvouched."""
    with _path_locks_lock:
        return _path_locks.setdefault(os.path.abspath(path), threading.Lock())


def _open_temp(path: Path) -> tuple[Path, int]:
    temp = path.with_name(f".{path.name}{TEMP_TAG}{os.getpid()}-{secrets.token_hex(4)}.tmp")
    # 0o666 through the umask, like any new file; O_EXCL: never follow or reuse a planted name.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    return temp, fd


def write_file(path: Path, content: str | bytes | Iterable[str] | Iterable[bytes], what: str = "") -> Path:
    """Write `content` to `path` atomically if `path` is free or llmplan's (NotOurs otherwise), and claim it.

    An OSError (disk full, no permission) is raised as it came, with the temp file removed.
    """
    path = Path(path)
    chunks: Iterable[str | bytes] = [content] if isinstance(content, str | bytes) else content
    with _lock_for(path):
        remove_stale_temps(path)
        check_writable(path, "file", what)
        temp, fd = _open_temp(path)
        try:
            digest, size = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as handle:
                for chunk in chunks:
                    data = chunk.encode("utf-8") if isinstance(chunk, str) else chunk
                    handle.write(data)
                    digest.update(data)
                    size += len(data)
                handle.flush()
                os.fsync(handle.fileno())
                info = os.fstat(handle.fileno())
            check_writable(path, "file", what)  # the target may have changed while we wrote
            identity = {
                "kind": "file",
                "dev": info.st_dev,
                "ino": info.st_ino,
                "size": size,
                "sha256": digest.hexdigest(),
            }
            vouch(path, "file", identity)  # before the rename (which keeps the inode): no unvouched moment
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    return path


def remove_owned(path: Path, kind: Kind = "file") -> bool:
    """Remove a file llmplan can prove it wrote (and its marker); anything else stays. Whether it went."""
    path = Path(path)
    with _lock_for(path):
        if not owned(path, kind):
            return False
        path.unlink()
        marker_of(path).unlink(missing_ok=True)
    return True


def remove_stale_temps(path: Path) -> None:
    """Remove `.NAME.llmplan-PID-*.tmp` files (and the marker's) left by a run whose process is gone."""
    path = Path(path)
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return  # no folder yet: nothing left over
    prefixes = tuple(f".{name}{TEMP_TAG}" for name in (path.name, marker_of(path).name))
    for entry in entries:
        if entry.name.startswith(prefixes) and _is_dead_temp(entry.name) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):  # not ours to remove after all: leave it
                os.unlink(entry.path)


def _is_dead_temp(name: str) -> bool:
    match = _TEMP_PID.search(name)
    return bool(match) and name.startswith(".") and not _alive(int(match.group(1)))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
