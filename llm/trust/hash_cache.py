"""Remember SHA-256 results by file identity, so an unchanged multi-GB shard is not re-hashed every load.

A file's identity is (size, mtime_ns, ctime_ns, inode, device), read with `fstat` from the very
descriptor that is hashed. mtime alone proves nothing: any program can set it back (`os.utime`,
`touch -d`, rsync -t). ctime cannot be set from user space: the kernel sets it to "now" on every write,
truncate, chmod or utime of the inode, so a changed file always gets a new ctime (only changing the
system clock or writing the raw block device gets around it). Replacing the file changes the inode.
Any difference and the hash is computed again; `rehash: true` in the verify stage and `llmplan
validate --deep` ignore the cache altogether and hash every byte.

The cache file lives beside the files it describes, where anyone who can write that folder can write
it too; so it vouches for nothing by itself. Every entry carries an HMAC-SHA256 of (identity, digest)
under a key that only this user can read (`$LLMPLAN_CACHE/hash-cache.key`, mode 0600, made on first
use): an entry that was not written by llmplan after hashing exactly those bytes fails the check and
is ignored, as is a cache file that is damaged, too large, or not a regular file. Without the key (a
read-only cache that never had one, a key that others can read) nothing is taken from the cache and
nothing is recorded: every file is hashed, and `note` says why, once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

from llmplan.bounded_read import read_limited
from llmplan.cache_home import cache_home

CACHE_NAME = ".llmplan-hashes.json"
KEY_NAME = "hash-cache.key"
FORMAT = "llmplan.hash-cache/v2"
_KEY_BYTES = 32
_CACHE_LIMIT = 4 << 20  # ~15,000 entries; a model directory has tens of files
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

Identity = list[int]


def identity_of(info: os.stat_result) -> Identity:
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev]


def identity(path: Path) -> Identity:
    return identity_of(path.stat())


def _read_key(path: Path) -> bytes:
    """The key file's bytes, if it is a regular file of this user that nobody else can read or write."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        private = stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077
        if not private or info.st_size != _KEY_BYTES:
            raise PermissionError(errno.EPERM, "not a private 32-byte key file of this user")
        data = os.read(fd, _KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != _KEY_BYTES:
        raise PermissionError(errno.EPERM, "not a private 32-byte key file of this user")
    return data


def _make_key(path: Path) -> None:
    """Create the key atomically: written whole under a temporary name, then linked into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        try:
            os.write(fd, secrets.token_bytes(_KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another process made one first: theirs is used
            os.link(temp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)


def load_key(home: Path | None = None) -> tuple[bytes | None, str | None]:
    """(this user's hash-cache key, None), or (None, why there is none), making the key on first use."""
    path = (home or cache_home()) / KEY_NAME
    for attempt in range(2):
        try:
            return _read_key(path), None
        except FileNotFoundError:
            if attempt:
                break
            try:
                _make_key(path)
            except OSError as bad:
                return None, f"{path.parent}: cannot write there ({bad.strerror or bad})"
        except OSError as bad:
            return None, f"{path}: unusable ({bad.strerror or bad})"
    return None, f"{path}: could not be created"


def _regular_or_absent(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return False


class HashCache:
    """Verified digests by name (a shard's name, or a GGUF's absolute path), each entry authenticated."""

    def __init__(self, directory: Path, key_home: Path | None = None) -> None:
        self.path = Path(directory) / CACHE_NAME
        self.entries: dict[str, dict[str, Any]] = {}
        self.dirty = False
        self.note: str | None = None
        """Why nothing could be recorded (read-only folder, no key...): one line for the caller to show."""
        self._key, self._no_key = load_key(key_home)
        self._replaceable = True  # False when the name is taken by a FIFO, a link, a folder: never replaced
        if self._key is not None:
            self.entries = self._load()

    def _load(self) -> dict[str, dict[str, Any]]:
        """The entries whose MAC checks out; anything damaged, foreign or oversized counts as no cache."""
        if not _regular_or_absent(self.path):
            self._replaceable = False
            return {}
        try:
            raw = json.loads(read_limited(self.path, _CACHE_LIMIT))
        except (OSError, ValueError, RecursionError):
            return {}
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("entries"), dict):
            return {}
        return {name: entry for name, entry in raw["entries"].items() if self._valid(entry)}

    def _mac(self, ident: Identity, digest: str) -> str:
        assert self._key is not None
        message = json.dumps([FORMAT, ident, digest], separators=(",", ":")).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def _valid(self, entry: Any) -> bool:
        if not isinstance(entry, dict):
            return False
        ident, digest, mac = entry.get("identity"), entry.get("sha256"), entry.get("mac")
        if not isinstance(ident, list) or len(ident) != 5:
            return False
        if not all(type(part) is int and part >= 0 for part in ident):
            return False
        if not isinstance(digest, str) or not _HEX64.match(digest) or not isinstance(mac, str):
            return False
        return hmac.compare_digest(mac, self._mac(ident, digest))

    def lookup(self, name: str, ident: Identity) -> str | None:
        """The digest recorded for exactly this identity, or None."""
        entry = self.entries.get(name)
        if entry is not None and entry["identity"] == ident:
            return str(entry["sha256"])
        return None

    def get(self, file: Path, name: str | None = None) -> str | None:
        try:
            return self.lookup(name or file.name, identity(file))
        except OSError:
            return None

    def record(self, name: str, ident: Identity, sha256: str) -> None:
        """Remember a digest computed from bytes whose identity was `ident` before and after hashing."""
        self.dirty = True  # without a key nothing is kept, but save() then says why, once
        if self._key is None or not _HEX64.match(sha256):
            return
        self.entries[name] = {"identity": list(ident), "sha256": sha256, "mac": self._mac(ident, sha256)}

    def put(self, file: Path, sha256: str, name: str | None = None) -> None:
        self.record(name or file.name, identity(file), sha256)

    def save(self) -> bool:
        """Write atomically. False (and `note` set) where it cannot be: the load goes on without the cache."""
        if not self.dirty:
            return True
        if self._key is None:
            self.note = f"{self._no_key}; file hashes are checked every run, not cached"
            return False
        if not self._replaceable:
            self.note = f"{self.path}: not a regular file, left alone; file hashes are not cached"
            return False
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        body = json.dumps({"format": FORMAT, "entries": self.entries}, indent=1)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(body)
            if not _regular_or_absent(self.path):  # taken meanwhile by something that is not ours
                raise IsADirectoryError(errno.EISDIR, "the cache file's name is taken by a non-file")
            os.replace(temp, self.path)
        except OSError as bad:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            reason = bad.strerror or bad
            self.note = f"{self.path.parent}: cannot record file hashes ({reason}); they are checked every run"
            return False
        self.dirty = False
        return True
