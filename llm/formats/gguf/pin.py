"""The pin of a GGUF in its import: the file's SHA-256, path and size, and whether its blocks' values were checked.

Why: a plan that keeps the file's blocks (`load.convert` dtype stored) reads its weights from the GGUF itself at
every start, not from shards the import wrote, so the import must vouch for the GGUF: `gguf_source.json`, listed
in the import's SHA256SUMS like config.json, records what the first use hashed. A start checks the file it maps
against that SHA-256 (by file identity through the cache root's hash cache, hashing again only a changed file);
`blocks_checked` says `check_block_values` passed when the file was first hashed, so no start reads every block.

    {"format": "llmplan.gguf-pin/v1", "sha256": "…", "path": "/abs/model.gguf", "size": 98123456,
     "blocks_checked": true}
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...trust.files import FileProblem, describe_os_error, read_json_limited
from ...trust.hash_cache import HashCache, identity_of
from ...trust.manifest import open_regular_fd, sha256_fd

PIN_NAME = "gguf_source.json"
PIN_FORMAT = "llmplan.gguf-pin/v1"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class PinError(ValueError):
    """The pin is damaged, or the GGUF is not the file it pins; the one-line message names the file."""


@dataclass(frozen=True)
class Pin:
    sha256: str
    path: str
    size: int
    blocks_checked: bool


@dataclass(frozen=True)
class PinCheck:
    """What checking a GGUF against its pin took: its bytes hashed now (0: the hash cache knew the file)."""

    pin: Pin
    bytes_hashed: int


def write_pin(folder: Path, gguf_path: Path, digest: str, size: int, blocks_checked: bool) -> None:
    data = {
        "format": PIN_FORMAT,
        "sha256": digest,
        "path": str(Path(gguf_path).absolute()),
        "size": size,
        "blocks_checked": blocks_checked,
    }
    (folder / PIN_NAME).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def read_pin(model_dir: Path) -> Pin | None:
    """The import's pin; None when it has none (a folder that is no GGUF import); PinError when damaged."""
    path = Path(model_dir) / PIN_NAME
    if not os.path.lexists(path):
        return None
    try:
        data = read_json_limited(path, 1 << 16)
    except FileProblem as bad:
        raise PinError(str(bad)) from None
    ok = isinstance(data, dict) and data.get("format") == PIN_FORMAT
    if not ok or not isinstance(data.get("sha256"), str) or not _HEX64.match(data["sha256"]):
        raise PinError(f"{path}: not a {PIN_FORMAT} pin")
    if type(data.get("size")) is not int or not isinstance(data.get("path"), str):
        raise PinError(f"{path}: not a {PIN_FORMAT} pin")
    return Pin(data["sha256"], data["path"], data["size"], data.get("blocks_checked") is True)


def check_pinned(model_dir: Path, gguf_path: Path, rehash: bool = False) -> PinCheck:
    """The GGUF at `gguf_path` is the one the import of `model_dir` pins (size, then SHA-256); PinError else.

    The hash cache is the cache root's (the import's parent), where the import recorded the file's identity,
    so an unchanged file is not read; `rehash` hashes it whatever the cache says.
    """
    model_dir, gguf_path = Path(model_dir), Path(gguf_path)
    pin = read_pin(model_dir)
    if pin is None:
        raise PinError(f"{model_dir}: no {PIN_NAME}, so the GGUF its weights are read from is not pinned; refused")
    try:
        fd = open_regular_fd(gguf_path)
    except OSError as bad:
        raise PinError(str(bad) if bad.filename is None else describe_os_error(gguf_path, bad)) from None
    try:
        before = identity_of(os.fstat(fd))
        if before[0] != pin.size:
            raise PinError(_changed(gguf_path, f"{before[0]} bytes", f"{pin.size}", model_dir))
        cache = HashCache(model_dir.parent)
        name = str(gguf_path.absolute())
        digest = None if rehash else cache.lookup(name, before)
        hashed = 0
        if digest is None:
            try:
                digest = sha256_fd(fd)
            except OSError as bad:
                raise PinError(describe_os_error(gguf_path, bad)) from None
            hashed = before[0]
            if digest == pin.sha256 and identity_of(os.fstat(fd)) == before:
                cache.record(name, before, digest)
                cache.save()
    finally:
        os.close(fd)
    if digest != pin.sha256:
        raise PinError(_changed(gguf_path, f"SHA-256 {digest[:16]}…", f"{pin.sha256[:16]}…", model_dir))
    return PinCheck(pin, hashed)


def _changed(gguf_path: Path, found: str, pinned: str, model_dir: Path) -> str:
    return f"{gguf_path}: changed since it was first used ({found}, pinned {pinned} in {model_dir / PIN_NAME}); refused"
