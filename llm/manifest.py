"""`SHA256SUMS` manifests: streamed hashing, reading and writing in the `sha256sum` format."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

MANIFEST_NAME = "SHA256SUMS"
_CHUNK = 8 << 20
_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")

ProgressFn = Callable[[int], None]
"""Called with the number of bytes just hashed, so a caller can drive a progress bar."""


class ManifestError(ValueError):
    """A `SHA256SUMS` file that cannot be parsed."""


def sha256_file(path: str | Path, progress: ProgressFn | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def read_sha256sums(path: str | Path) -> dict[str, str]:
    """Relative file name -> lowercase hex digest. Raises ManifestError naming the line."""
    path = Path(path)
    entries: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise ManifestError(f"{path}:{number}: not a 'HASH  FILE' line")
        entries[match.group(2)] = match.group(1).lower()
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
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
