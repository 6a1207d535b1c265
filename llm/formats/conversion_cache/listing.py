"""Where the conversion cache's entries are, what each is, and removing one: no torch, so `llmplan models` lists
them at once.

An entry is `$LLMPLAN_CACHE/conversions/<key digest[:16]>-<label>/`; a name starting with a dot is an entry being
written or being discarded, never one to list or open.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmplan.cache_home import cache_home

from ...trust.files import FileProblem, read_json_limited

ENTRIES_DIR = "conversions"
ROOT_VARIABLE = "LLMPLAN_CONVERSION_CACHE"
MARKER = "llmplan_conversion.json"
ENTRY_NAME = re.compile(r"^(?P<digest>[0-9a-f]{16})-(?P<label>[A-Za-z0-9._+-]{1,120})$")


class EntryProblem(Exception):
    """Why an entry cannot be used: one line naming it."""


@dataclass(frozen=True)
class EntryInfo:
    name: str
    path: Path
    bytes: int
    model: str
    dtype: str
    created: str


def conversions_root() -> Path:
    """`$LLMPLAN_CONVERSION_CACHE` (another disk, a test's own folder), else `$LLMPLAN_CACHE/conversions`."""
    chosen = os.environ.get(ROOT_VARIABLE)
    return Path(chosen).expanduser() if chosen else cache_home() / ENTRIES_DIR


def read_marker(path: Path) -> dict[str, Any]:
    """The entry's marker (bounded, a regular file), EntryProblem when it is not a JSON object."""
    try:
        marker = read_json_limited(path / MARKER, 1 << 20)
    except FileProblem as bad:
        raise EntryProblem(str(bad)) from None
    if not isinstance(marker, dict):
        raise EntryProblem(f"{path / MARKER}: not a JSON object")
    return marker


def discard_entry(path: Path) -> bool:
    """Rename a refused entry aside (so no start finds it again) and delete it; False if it could not be moved, or
    is not a folder of this user (a file or a link in an entry's place is left as it is: not ours to delete)."""
    aside = path.with_name(f".discarded-{path.name}-{secrets.token_hex(4)}")
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            return False
        os.rename(path, aside)
    except OSError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def entry_bytes(path: Path) -> int:
    """Bytes on disk of an entry's files."""
    total = 0
    with contextlib.suppress(OSError):
        for item in path.iterdir():
            with contextlib.suppress(OSError):
                info = item.lstat()
                total += info.st_size if stat.S_ISREG(info.st_mode) else 0
    return total


def list_entries(root: Path) -> list[EntryInfo]:
    """Every finished entry under root (a temporary or discarded one starts with a dot), by name."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    found = []
    for name in names:
        path = root / name
        if not ENTRY_NAME.match(name) or not path.is_dir() or path.is_symlink():
            continue
        try:
            marker = read_marker(path)
        except EntryProblem:
            marker = {}
        model, dtype = str(marker.get("model", "?")), str(marker.get("dtype", "?"))
        found.append(EntryInfo(name, path, entry_bytes(path), model, dtype, str(marker.get("created", "?"))))
    return found


