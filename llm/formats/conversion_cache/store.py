"""Conversion cache entries under `$LLMPLAN_CACHE/conversions/<digest[:16]>-<label>/`: written once, atomically;
opened only after every check passes; listed and removed by name.

An entry is a checkpoint folder of llmplan's own making: safetensors shards of the converted (fused, quantized)
tensors, their index, a marker (`llmplan_conversion.json`: the key's record and digest, what the weights are)
and a SHA256SUMS over all of them. Opening one checks, in order, before a byte is used:

- it is a folder of this user that nobody else may write (an entry of another user is refused, never trusted);
- its marker is this format and this very key (another version's or another key's entry is refused);
- every file against SHA256SUMS (a flipped byte or a truncated shard is refused), through the hash cache:
  an unchanged file (size, mtime, ctime, inode, under the user's HMAC key) is not hashed again, so a warm start
  costs a stat per file, and a file written to since is hashed again whatever its mtime says;
- each shard's header (bounded, spans inside the file), and only then the mapping.

A refused entry is discarded (renamed aside, then deleted) and the conversion made again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from ...trust import HashCache, IntegrityError, build_manifest, verify
from ...trust.manifest import MANIFEST_NAME, read_sha256sums, write_sha256sums
from ..checkpoint_writer import fsync_dir, fsync_tree, own_storage, plan_shards
from .key import FORMAT, ConversionKey
from .listing import ENTRY_NAME, MARKER, EntryProblem, read_marker
from .mapping import MappedFile, map_safetensors

INDEX = "model.safetensors.index.json"
SHARD_BYTES = 256 << 20  # safetensors' writer copies a shard to bytes first: this bounds that copy
_LABEL_CHARS = re.compile(r"[^A-Za-z0-9._+-]+")


@dataclass
class CacheEntry:
    path: Path
    marker: dict[str, Any]
    tensors: dict[str, Tensor]
    """Views on the mapped shards."""
    files: list[MappedFile]
    hashed_bytes: int
    """Bytes hashed to open it (0 when the hash cache knew every file)."""
    sources: list[MappedFile] = field(default_factory=list)
    """The source shards mapped for the tensors the entry keeps in place."""

    @property
    def nbytes(self) -> int:
        """Bytes of the entry's own tensors (what it takes on disk, bar its small files)."""
        return sum(f.nbytes for f in self.files)

    @property
    def mapped_bytes(self) -> int:
        """All the weights' bytes it maps: its own tensors and those in place."""
        return self.nbytes + self.in_place_bytes

    @property
    def in_place_bytes(self) -> int:
        """Bytes of the tensors it maps where they lie, in the source shards."""
        names = set(self.marker.get("in_place") or {})
        return sum({t.data_ptr(): t.nbytes for name, t in self.tensors.items() if name in names}.values())

    @property
    def paths(self) -> list[Path]:
        return [f.path for f in (*self.files, *self.sources)]

    def close(self) -> None:
        """Drop this object's views (the pages go once the model holding its own views is gone too)."""
        self.tensors, self.files, self.sources = {}, [], []


def entry_name(key: ConversionKey, label: str) -> str:
    clean = _LABEL_CHARS.sub("_", label).strip("._") or "model"
    return f"{key.digest[:16]}-{clean[:120]}"


def find_entry(root: Path, key: ConversionKey) -> Path | None:
    """The entry of this key under root, if there is a folder of that name (checked when opened)."""
    try:
        names = os.listdir(root)
    except OSError:
        return None
    prefix = key.digest[:16] + "-"
    found = sorted(name for name in names if name.startswith(prefix) and ENTRY_NAME.match(name))
    return root / found[0] if found else None


def open_entry(path: Path, key: ConversionKey, sources: Path | None = None) -> CacheEntry:
    """The entry's tensors, mapped, once every check in the module's docstring has passed; EntryProblem if not.
    `sources`: the folder of the shards the key names, where the entry maps the tensors it holds in place."""
    _check_owner(path)
    marker = read_marker(path)
    if marker.get("format") != FORMAT:
        raise EntryProblem(f"{path}: written by another version ({marker.get('format')!r}, this one reads {FORMAT})")
    if marker.get("key") != key.digest or marker.get("record") != key.record():
        raise EntryProblem(f"{path}: its marker is for another conversion (key {str(marker.get('key'))[:16]}…)")
    try:
        manifest = build_manifest(path, None, (MARKER,))
        cache = HashCache(path)
        report = verify(manifest, "required", None, cache)
        files = [map_safetensors(shard.path) for shard in manifest.shards]
        tensors = {name: t for mapped in files for name, t in mapped.tensors.items()}
        in_place, held = _in_place(path, marker, key, sources)
    except IntegrityError as bad:
        raise EntryProblem(str(bad)) from None
    return CacheEntry(path, marker, tensors | in_place, files, report.bytes_hashed, held)


def _in_place(
    path: Path, marker: dict[str, Any], key: ConversionKey, sources: Path | None
) -> tuple[dict[str, Tensor], list[MappedFile]]:
    """The tensors the entry keeps where they lie: views on the source shards the key names (their SHA-256
    checked by load.verify at this start), each of the dtype and shape the marker recorded."""
    refs = marker.get("in_place") or {}
    if not isinstance(refs, dict):
        raise EntryProblem(f"{path}: its marker's in_place is not an object")
    if refs and sources is None:
        raise EntryProblem(f"{path}: it maps tensors of its source in place, and no source folder was given")
    named = {name for name, _ in key.sources}
    mapped: dict[str, MappedFile] = {}
    out: dict[str, Tensor] = {}
    for internal, ref in refs.items():
        shard = ref.get("shard") if isinstance(ref, dict) else None
        if shard not in named:
            raise EntryProblem(f"{path}: in-place tensor {internal!r} names {shard!r}, not one of its sources")
        if shard not in mapped:
            mapped[shard] = map_safetensors(Path(str(sources)) / shard)
        tensor = mapped[shard].tensors.get(str(ref.get("tensor")))
        if tensor is None or [str(tensor.dtype), list(tensor.shape)] != [ref.get("dtype"), ref.get("shape")]:
            raise EntryProblem(f"{path}: in-place tensor {internal!r} is not in {shard} as recorded")
        out[internal] = tensor
    return out, list(mapped.values())


def _check_owner(path: Path) -> None:
    try:
        info = os.lstat(path)
    except OSError as bad:
        raise EntryProblem(f"{path}: cannot be read ({bad.strerror})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise EntryProblem(f"{path}: not a folder (a link or a file in an entry's place)")
    if info.st_uid != os.geteuid():
        raise EntryProblem(f"{path}: written by another user (uid {info.st_uid})")
    if info.st_mode & 0o022:
        raise EntryProblem(f"{path}: others may write it (mode {stat.S_IMODE(info.st_mode):o})")


def write_entry(root: Path, key: ConversionKey, label: str, flat: dict[str, Tensor], about: dict[str, Any]) -> Path:
    """Write the entry under a temporary name beside its place, flushed, then renamed into place: a crash leaves
    no half entry for a later start to find. Where another process got there first, its entry stands (and is
    checked when opened). OSError when root cannot be written (a read-only cache)."""
    final = root / entry_name(key, label)
    if os.path.lexists(root) and not root.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(root))
    root.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))  # mode 0700: this user's alone
    try:
        _write_files(temp, key, flat, about)
        fsync_tree(temp)  # contents on disk before the rename publishes them: no entry of empty files
        with contextlib.suppress(FileExistsError, OSError):
            os.rename(temp, final)
        if temp.exists():  # another start published the same key meanwhile
            shutil.rmtree(temp, ignore_errors=True)
            return final
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    fsync_dir(root)
    _remember_hashes(final)
    return final


def _write_files(folder: Path, key: ConversionKey, flat: dict[str, Tensor], about: dict[str, Any]) -> None:
    groups = plan_shards(flat, SHARD_BYTES) if flat else []
    names = [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    weight_map: dict[str, str] = {}
    for shard_name, group in zip(names, groups, strict=True):
        save_file(own_storage({n: flat[n] for n in group}), str(folder / shard_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, shard_name))
    total = sum(t.nbytes for t in flat.values())
    index = {"metadata": {"total_size": total, "llmplan": "conversion"}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    marker = {"format": FORMAT, "key": key.digest, "record": key.record(), "created": _now(), **about}
    (folder / MARKER).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
    write_sha256sums(folder, [*names, INDEX, MARKER])


def _remember_hashes(entry: Path) -> None:
    """The digests SHA256SUMS was just written from, in the entry's hash cache: the next start stats, not hashes."""
    with contextlib.suppress(OSError, ValueError):
        sums = read_sha256sums(entry / MANIFEST_NAME)
        cache = HashCache(entry)
        for name, digest in sums.items():
            cache.put(entry / name, digest)
        cache.save()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
