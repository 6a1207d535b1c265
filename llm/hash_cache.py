"""Remember SHA-256 results by file identity, so an unchanged multi-GB shard is not re-hashed every load.

A file's identity is (size, mtime_ns, ctime_ns, inode, device). mtime alone proves nothing: any
program can set it back (`os.utime`, `touch -d`, rsync -t), so a shard rewritten in place with its
mtime restored looked unchanged. ctime cannot be set from user space: the kernel sets it to "now" on
every write, truncate, chmod or utime of the inode, so a changed file always gets a new ctime (only
changing the system clock or writing the raw block device gets around it). Replacing the file changes
the inode. Any difference and the hash is computed again; `rehash: true` in the verify stage and
`llmplan validate --deep` ignore the cache altogether and hash every byte.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CACHE_NAME = ".llmplan-hashes.json"


def identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class HashCache:
    def __init__(self, directory: Path) -> None:
        self.path = directory / CACHE_NAME
        self.entries: dict[str, dict[str, object]] = {}
        self.dirty = False
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(raw, dict):
                self.entries = {k: v for k, v in raw.items() if isinstance(v, dict)}
        except (OSError, ValueError):
            self.entries = {}  # absent or damaged: start over, never fail a load on it

    def get(self, file: Path) -> str | None:
        entry = self.entries.get(file.name)
        try:
            if entry and entry.get("identity") == identity(file):
                digest = entry.get("sha256")
                return digest if isinstance(digest, str) else None
        except OSError:
            return None
        return None

    def put(self, file: Path, sha256: str) -> None:
        self.entries[file.name] = {"identity": identity(file), "sha256": sha256}
        self.dirty = True

    def save(self) -> bool:
        """Write atomically; a read-only model directory just means no cache (False)."""
        if not self.dirty:
            return True
        temp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            temp.write_text(json.dumps(self.entries, indent=1), encoding="utf-8")
            os.replace(temp, self.path)
        except OSError:
            temp.unlink(missing_ok=True)
            return False
        self.dirty = False
        return True
