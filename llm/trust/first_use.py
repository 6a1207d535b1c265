"""Trust on first use: the SHA-256 of every file a model directory's load reads, recorded the first time.

A folder a user downloaded or saved (`save_pretrained`, a Hub snapshot) rarely has a SHA256SUMS, so
there is nothing to check its files against. The first use hashes them and keeps the hashes; every later
load checks the files against that record exactly as against a SHA256SUMS, so a changed, added or
removed file is refused. What the first use saw is trusted as it was: the record guards against later
changes, not against a folder that was already wrong.

The record is kept in llmplan's own cache, never in the user's folder:

    $LLMPLAN_CACHE/trusted/<sha256 of the folder's resolved path, 32 hex>-<folder name>/
        SHA256SUMS              the hashes, `sha256sum -c` format, names relative to the folder
        folder                  the folder's resolved path (which folder this record is about)
        .llmplan-hashes.json    the hash cache (llm/trust/hash_cache.py), so an unchanged file is not re-hashed

SHA256SUMS is written last and atomically: it is the commit point, so a record without one is no record.
Deleting the record directory makes the next use a first use again (how a user accepts a change).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .files import FileProblem, describe_os_error, read_text_limited
from .hash_cache import HashCache, identity_of
from .manifest import MANIFEST_NAME, ManifestError, open_regular_fd, read_sha256sums, sha256_fd

RECORDS_DIR = "trusted"
FOLDER_FILE = "folder"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")

ProgressFn = Callable[[int], None]
"""Called with the number of bytes just hashed."""


class FirstUseError(ValueError):
    """The record cannot be made or read; the one-line message names the file."""


@dataclass(frozen=True)
class FirstUse:
    record: Path
    """The record's SHA256SUMS (to check the folder against, as `build_manifest(sums_file=...)`)."""
    created: bool
    """True when this call hashed the folder and wrote the record (the first use)."""
    files: int
    nbytes: int


def record_dir(model_dir: Path, home: Path) -> Path:
    """Where the record of `model_dir` lives under `home` (one per resolved folder path)."""
    resolved = model_dir.resolve()
    key = hashlib.sha256(os.fsencode(resolved)).hexdigest()[:32]
    label = _UNSAFE.sub("_", resolved.name)[:64] or "model"
    return home / RECORDS_DIR / f"{key}-{label}"


def trust_on_first_use(model_dir: Path, names: list[str], home: Path, progress: ProgressFn | None = None) -> FirstUse:
    """The record of `model_dir`: read when there is one, else made by hashing `names` (files inside it)."""
    folder = record_dir(model_dir, home)
    sums = folder / MANIFEST_NAME
    resolved = str(model_dir.resolve())
    if os.path.lexists(sums):
        try:
            about = read_text_limited(folder / FOLDER_FILE, 1 << 16).strip()
        except FileProblem as bad:
            raise FirstUseError(f"{bad}; the first-use record {folder} is damaged (delete it to start again)") from None
        if about != resolved:
            raise FirstUseError(f"{folder / FOLDER_FILE}: a record of {about!r}, not of {resolved!r}; refused")
        return FirstUse(sums, False, 0, 0)
    cache = HashCache(folder, key_home=home)
    lines, total = [], 0
    for name in sorted(set(names)):
        digest, size = _hash(model_dir / name, cache, name, progress)
        lines.append(f"{digest}  {name}\n")
        total += size
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / FOLDER_FILE, resolved + "\n")
        cache.save()  # before the commit point: the record's first check then needs no second hashing
        _write_atomic(sums, "".join(lines))
    except OSError as bad:
        raise FirstUseError(
            f"{folder}: cannot record the hashes of {model_dir} there ({bad.strerror or bad}); "
            "set LLMPLAN_CACHE to a writable folder"
        ) from None
    return FirstUse(sums, True, len(lines), total)


def trust_file_on_first_use(path: Path, digest: str, home: Path, create: bool = True) -> FirstUse | None:
    """A single file (a GGUF given by `--model FILE`), whose SHA-256 the caller computed: recorded on first use
    like a folder's files, then compared: a different digest is refused in one line, naming how to accept it.
    `create` False only compares (None where there is no record yet): the caller records once the file is
    found good (an import that refuses the file must not pin it)."""
    folder = record_dir(path, home)
    sums = folder / MANIFEST_NAME
    resolved = str(path.resolve())
    if not os.path.lexists(sums):
        if not create:
            return None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _write_atomic(folder / FOLDER_FILE, resolved + "\n")
            _write_atomic(sums, f"{digest}  {path.name}\n")
        except OSError as bad:
            raise FirstUseError(
                f"{folder}: cannot record the hash of {path} there ({bad.strerror or bad}); "
                "set LLMPLAN_CACHE to a writable folder"
            ) from None
        return FirstUse(sums, True, 1, path.stat().st_size)
    try:
        about = read_text_limited(folder / FOLDER_FILE, 1 << 16).strip()
        recorded = read_sha256sums(sums).get(path.name)
    except (FileProblem, ManifestError) as bad:
        raise FirstUseError(f"{bad}; the first-use record {folder} is damaged (delete it to start again)") from None
    if about != resolved or recorded is None:
        raise FirstUseError(f"{folder}: not a record of {resolved!r}; refused (delete it to start again)")
    if recorded != digest:
        raise FirstUseError(
            f"{path}: changed since it was first used (SHA-256 {digest[:16]}…, recorded {recorded[:16]}… in "
            f"{sums}); refused (delete {folder} to trust the file as it is now)"
        )
    return FirstUse(sums, False, 0, 0)


def _hash(path: Path, cache: HashCache, name: str, progress: ProgressFn | None) -> tuple[str, int]:
    """(SHA-256, size) of one file, remembered in the record's hash cache for the identity that was hashed."""
    try:
        fd = open_regular_fd(path)
    except OSError as bad:
        raise FirstUseError(str(bad) if bad.filename is None else describe_os_error(path, bad)) from None
    try:
        before = identity_of(os.fstat(fd))
        try:
            digest = sha256_fd(fd, progress)
        except OSError as bad:
            raise FirstUseError(describe_os_error(path, bad)) from None
        if identity_of(os.fstat(fd)) != before:
            raise FirstUseError(f"{path}: changed while it was hashed on first use; try again")
        cache.record(name, before, digest)
        return digest, before[0]
    finally:
        os.close(fd)


def _write_atomic(target: Path, text: str) -> None:
    temp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "x", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
