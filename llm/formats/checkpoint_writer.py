"""Write tensors as a sharded safetensors checkpoint with an HF-style index and a `SHA256SUMS`, atomically.

Everything is written into a temporary directory beside `out_dir` and renamed into place at the end, so a
crash or exception midway leaves no half-written checkpoint at `out_dir` for a later run to trust. Only a
new path or a checkpoint directory llmplan wrote (and can prove it: llmplan/ownership.py) is written; a
folder or file of the user's there is refused (NotOurs) before a byte is written, and left as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from safetensors.torch import save_file
from torch import Tensor

from llmplan.ownership import check_writable, identity_of, vouch

from ..trust.checkpoint import SAFETENSORS_INDEX
from ..trust.manifest import MANIFEST_NAME, write_sha256sums

DEFAULT_MAX_SHARD_BYTES = 2 << 30


def plan_shards(tensors: dict[str, Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split in insertion order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0 (got {max_shard_bytes})")
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, tensor in tensors.items():
        if current and size + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += tensor.nbytes
    if current:
        shards.append(current)
    return shards


def write_checkpoint(
    tensors: dict[str, Tensor],
    out_dir: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    metadata: dict[str, str] | None = None,
    extra_files: dict[str, bytes | str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `model-0000i-of-0000n.safetensors`, the index, `extra_files` and a `SHA256SUMS` over them all.

    `metadata` goes into every shard header (with `format: pt`, which HF loaders expect) and the index.
    An existing `out_dir` is an error unless `overwrite`, which swaps it only once the new one is complete, and
    only if llmplan wrote it (NotOurs otherwise: a directory or file of the user's is never replaced).
    """
    out_dir = Path(out_dir)
    if not tensors:
        raise ValueError("write_checkpoint: no tensors to write")
    if os.path.lexists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists (pass overwrite=True to replace it)")
    check_checkpoint_target(out_dir)
    header_meta = {"format": "pt", **(metadata or {})}
    for key, value in header_meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str -> str (got {key!r}: {type(value).__name__})")
    groups = plan_shards(tensors, max_shard_bytes)
    names = [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    extras = dict(extra_files or {})
    reserved = {*names, SAFETENSORS_INDEX, MANIFEST_NAME}
    for name in extras:
        _check_extra_name(name, reserved)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for shard_name, group in zip(names, groups, strict=True):
            shard = own_storage({name: tensors[name] for name in group})
            save_file(shard, str(temp / shard_name), metadata=header_meta)
            total += sum(t.nbytes for t in shard.values())
            weight_map.update(dict.fromkeys(group, shard_name))
        index = {"metadata": {**(metadata or {}), "total_size": total}, "weight_map": weight_map}
        (temp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        _write_extras(temp, extras)
        write_sha256sums(temp, [*names, SAFETENSORS_INDEX, *extras])
        fsync_tree(temp)
        check_checkpoint_target(out_dir)  # again: the path may have been taken while we wrote
        # The marker first (the rename keeps the directory's inode and its files' mtimes), so the next save to
        # this path may replace it even if this process is killed between the two.
        vouch(out_dir, "directory", identity_of(temp, "directory"))
        _move_into_place(temp, out_dir)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out_dir


def _write_extras(folder: Path, extras: dict[str, bytes | str]) -> None:
    """The extra files (config, tokenizer, ...) under `folder`, text as UTF-8."""
    for name, content in extras.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            target.write_text(content, encoding="utf-8")
        else:
            target.write_bytes(content)


def check_checkpoint_target(out_dir: Path) -> None:
    """NotOurs unless `out_dir` is free or a checkpoint directory llmplan saved, unchanged since."""
    check_writable(Path(out_dir), "directory")


def own_storage(group: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous tensors with a storage each: save_file refuses tensors sharing memory (tied weights)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in group.items():
        tensor = tensor.detach().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen and tensor.nbytes:
            tensor = tensor.clone()
        seen.add(pointer)
        out[name] = tensor
    return out


def _check_extra_name(name: str, reserved: set[str]) -> None:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or "\\" in name:
        raise ValueError(f"extra file name {name!r} must be a plain relative path inside the checkpoint")
    if name in reserved:
        raise ValueError(f"extra file name {name!r} collides with a file write_checkpoint writes itself")


def fsync_tree(root: Path) -> None:
    """Flush file contents before the rename makes them visible, so a power cut cannot publish empty files."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; durability there is best effort
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(temp: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(temp, out_dir)
    else:  # overwrite: park the old one, publish the new one, then delete the old one
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rename(out_dir, old / out_dir.name)
        try:
            os.rename(temp, out_dir)
        except BaseException:
            os.rename(old / out_dir.name, out_dir)
            old.rmdir()
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(out_dir.parent)
