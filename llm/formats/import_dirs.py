"""The temporary directories an import is written into, and removing the ones a killed process left behind.

An import is written into `.<target>.importing-<pid>-<nonce>` beside its target and renamed into place
when complete. A process killed midway (SIGKILL, power cut) cannot remove its directory, so the next
import removes it, but only when it is provably stale and provably ours:
  * the name has exactly that shape, and it is a real directory (not a link) owned by this user;
  * it holds an owner record, written first, whose pid and nonce are the ones in the name, from this host
    and this boot, naming a process that is no longer running (a live pid whose start time differs is a
    reused pid: that process is not the owner);
  * it holds only regular files with the names an import writes.
Anything else, however much it looks like a leftover, is left exactly as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import stat
from pathlib import Path
from typing import Any

from llmplan.bounded_read import read_limited

TEMP_MARK = ".importing-"
OWNER_NAME = ".llmplan-import-owner.json"
OWNER_FORMAT = "llmplan.import-owner/v1"
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.importing-(?P<pid>\d{1,10})-(?P<nonce>[0-9a-f]{8})$")
_IMPORT_FILE = re.compile(
    r"^(config\.json|tokenizer\.json|tokenizer_config\.json|model\.safetensors\.index\.json|SHA256SUMS|gguf_source\.json"
    r"|SHA256SUMS\.tmp|model-\d{5}-of-\d{5}\.safetensors)$"
)
_MAX_FILES = 100_000  # an import writes a handful of files; more is not one of ours


def _boot_id() -> str | None:
    with contextlib.suppress(OSError, ValueError):
        return read_limited("/proc/sys/kernel/random/boot_id", 64).decode("ascii").strip()
    return None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), where /proc has it."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        raw = read_limited(f"/proc/{pid}/stat", 4096).decode("ascii", "replace")
        return int(raw[raw.rindex(")") + 2 :].split()[19])  # after "pid (comm) ": state is field 3
    return None


def _owner_record(nonce: str) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "format": OWNER_FORMAT,
        "pid": pid,
        "nonce": nonce,
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "start_time": _start_time(pid),
    }


def make_import_dir(target: Path) -> Path:
    """Create `.<target>.importing-<pid>-<nonce>` beside `target`, its owner record written before anything else."""
    nonce = secrets.token_hex(4)
    temp = target.with_name(f".{target.name}{TEMP_MARK}{os.getpid()}-{nonce}")
    temp.mkdir()
    try:
        (temp / OWNER_NAME).write_text(json.dumps(_owner_record(nonce)) + "\n", encoding="utf-8")
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(temp)
        raise
    return temp


def finish_import_dir(temp: Path) -> None:
    """Drop the owner record once the directory is complete, just before it is renamed into place."""
    os.unlink(temp / OWNER_NAME)


def _running(owner: dict[str, Any]) -> bool:
    pid = owner["pid"]
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass  # a process of another user has that pid: decided by its start time below
    started = _start_time(pid)
    return started is None or owner.get("start_time") is None or started == owner["start_time"]


def _read_owner(path: Path) -> dict[str, Any] | None:
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        owner = json.loads(read_limited(path, 4096))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(owner, dict) or owner.get("format") != OWNER_FORMAT:
        return None
    if type(owner.get("pid")) is not int or not isinstance(owner.get("nonce"), str):
        return None
    return owner


def stale_owner(path: Path) -> bool:
    """True when `path` is provably an import directory of ours whose process is gone (see the module doc)."""
    match = _TEMP_NAME.match(path.name)
    if match is None:
        return False
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        return False
    owner = _read_owner(path / OWNER_NAME)
    if owner is None or owner["pid"] != int(match["pid"]) or owner["nonce"] != match["nonce"]:
        return False
    if owner.get("host") != socket.gethostname():
        return False  # another machine sharing the folder: its processes cannot be seen from here
    boot = _boot_id()
    if boot is not None and owner.get("boot_id") not in (None, boot):
        return True  # written before the last reboot: no process of that boot runs now
    return not _running(owner)


def _import_files(path: Path) -> list[Path] | None:
    """The directory's files, if every entry is a regular file an import writes; else None."""
    files: list[Path] = []
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if len(files) >= _MAX_FILES or not entry.is_file(follow_symlinks=False):
                    return None
                if entry.name != OWNER_NAME and not _IMPORT_FILE.match(entry.name):
                    return None
                files.append(Path(entry.path))
    except OSError:
        return None
    return files


def remove_stale_imports(folder: Path) -> list[Path]:
    """Remove the import directories in `folder` left by processes that died; returns those removed."""
    removed: list[Path] = []
    try:
        with os.scandir(folder) as entries:
            candidates = [Path(e.path) for e in entries if TEMP_MARK in e.name and e.name.startswith(".")]
    except OSError:
        return removed  # no folder yet (or unreadable): nothing to clean
    for path in sorted(candidates):
        if not stale_owner(path):
            continue
        files = _import_files(path)
        if files is None:
            continue
        try:
            # The owner record goes last: interrupted here, the directory is still recognisably ours.
            for file in sorted(files, key=lambda f: f.name == OWNER_NAME):
                os.unlink(file)
            os.rmdir(path)
        except OSError:
            continue  # raced with something else, or not ours to remove after all: leave what is left
        removed.append(path)
    return removed
