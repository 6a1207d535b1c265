"""The shard manifest of a checkpoint directory and its integrity checks.

`build_manifest` finds the shards (from an index or a single file), refuses index entries that point outside
the model directory, and collects each shard's known SHA-256. `verify` then checks every shard before any
tensor is read: cheap checks (existence, exact size, header) for all shards first, then the streamed hashes,
so a missing last shard fails in milliseconds instead of after hashing the others.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Literal

from .files import FileProblem, describe_os_error, read_json_limited
from .hash_cache import HashCache, identity_of
from .manifest import MANIFEST_NAME, ManifestError, read_sha256sums, sha256_fd

Format = Literal["safetensors", "torch"]
HashSource = Literal["SHA256SUMS", "first-use", "hf-cache-blob", "plan"]
Policy = Literal["required", "if_present", "off"]
ProgressFn = Callable[[int], None]

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SINGLE = "pytorch_model.bin"

# safetensors itself refuses headers above 100 MB; a bigger length means the first 8 bytes are garbage.
_MAX_HEADER = 100 << 20
_MAX_DIMS = 8
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


class IntegrityError(ValueError):
    """A checkpoint file is missing, damaged, unsafe or unverifiable; the one-line message names the file."""


@dataclass(frozen=True)
class ShardInfo:
    name: str
    """The file name as the index (or the single-file convention) gives it, relative to model_dir."""
    path: Path
    size: int | None
    """Expected file size in bytes, from the safetensors header at build time; None for torch files."""
    sha256: str | None
    hash_source: HashSource | None


@dataclass
class ShardManifest:
    model_dir: Path
    format: Format
    shards: list[ShardInfo]
    tensor_to_shard: dict[str, str]
    """Tensor name -> shard name. Empty for a single `pytorch_model.bin` (its names live in the pickle)."""
    index: Path | None = None
    listed: list[ShardInfo] = field(default_factory=list)
    """Every other file SHA256SUMS lists (config, tokenizer, index…): verified like the shards."""
    sums: Path | None = None
    """The SHA256SUMS file (the directory's, or a first-use record): then every file the load reads must be in it."""
    first_use: bool = False
    """`sums` is a first-use record kept in the cache (llm/trust/first_use.py), not the directory's own SHA256SUMS."""
    also_read: tuple[str, ...] = ()
    """Other files the load reads when present (config, tokenizer files): with `sums`, each must be listed."""

    @property
    def total_bytes(self) -> int:
        """Sum of the known expected sizes, e.g. for a progress bar's total."""
        return sum(shard.size or 0 for shard in self.shards)

    def shard(self, name: str) -> ShardInfo:
        for shard in self.shards:
            if shard.name == name:
                return shard
        raise KeyError(name)


@dataclass
class VerifyReport:
    files_checked: int = 0
    bytes_hashed: int = 0
    seconds: float = 0.0
    unhashed: list[str] = field(default_factory=list)
    """Shards that passed without a hash check (policy 'if_present' with no known hash, or 'off')."""
    cached: list[str] = field(default_factory=list)
    """Shards whose hash was taken from the hash cache (an authenticated entry for this very identity)."""
    cache_note: str | None = None
    """Why verified hashes could not be recorded (a read-only folder...), for the caller to show once."""


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    expected_size: int


def open_regular(path: Path) -> int:
    """A read-only descriptor of a regular file, or IntegrityError naming the file.

    Opened non-blocking so that a FIFO in the shard's place cannot hang the open, and checked with
    `fstat` on the descriptor, so what is checked is what is read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        raise IntegrityError(describe_os_error(path, error)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
        raise IntegrityError(f"{path}: {kind} where a file belongs; refused")
    os.set_blocking(fd, True)
    return fd


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Parse and check a safetensors header, and the file's size against it, without touching tensor data.

    Nothing in the header is trusted: its length against the file, its JSON (bounded, no duplicate names),
    every entry's dtype (known), shape (non-negative integers) and byte span (dtype x shape), and the spans
    together: they must tile the data exactly, from 0 to the end of the file, with no overlap and no gap.
    """
    fd = open_regular(path)
    actual = os.fstat(fd).st_size
    with open(fd, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise IntegrityError(f"{path}: truncated: {actual} bytes, expected at least 8")
        length = int.from_bytes(prefix, "little")
        if length > _MAX_HEADER:
            raise IntegrityError(f"{path}: corrupt safetensors header: implausible header length {length}")
        if 8 + length > actual:
            raise IntegrityError(f"{path}: truncated: {actual} bytes, expected at least {8 + length}")
        raw = handle.read(length)
    header = _parse_header(path, raw)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise IntegrityError(f"{path}: corrupt safetensors header: __metadata__ is not an object of strings")
    spans = []
    for name, entry in header.items():
        problem = _entry_problem(entry)
        if problem:
            raise IntegrityError(f"{path}: corrupt safetensors header: tensor {_shown(name)}: {problem}")
        spans.append((*entry["data_offsets"], name))
    end = _check_tiling(path, spans)
    expected = 8 + length + end
    if actual < expected:
        raise IntegrityError(f"{path}: truncated: {actual} bytes, expected {expected}")
    if actual > expected:
        raise IntegrityError(f"{path}: wrong size: {actual} bytes, expected {expected} (trailing data)")
    return SafetensorsHeader(tensors=header, metadata=metadata, expected_size=expected)


def _parse_header(path: Path, raw: bytes) -> dict[str, Any]:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:  # json.loads would keep the last silently; the Rust reader need not agree
                raise IntegrityError(f"{path}: corrupt safetensors header: {_shown(key)} appears twice")
            out[key] = value
        return out

    try:
        header = json.loads(raw, object_pairs_hook=unique)
    except IntegrityError:
        raise
    except UnicodeDecodeError:
        raise IntegrityError(f"{path}: corrupt safetensors header: not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise IntegrityError(
            f"{path}: corrupt safetensors header: not valid JSON ({exc.msg} at byte {exc.pos})"
        ) from None
    except RecursionError:
        raise IntegrityError(f"{path}: corrupt safetensors header: JSON nested too deeply") from None
    except ValueError:  # Python's own limit: an integer of more than 4300 digits
        raise IntegrityError(f"{path}: corrupt safetensors header: a number with too many digits") from None
    if not isinstance(header, dict):
        raise IntegrityError(f"{path}: corrupt safetensors header: not a JSON object")
    return header


def _check_tiling(path: Path, spans: list[tuple[int, int, str]]) -> int:
    """The byte spans cover [0, end) exactly once (what the format requires); returns `end`."""
    at, last = 0, ""
    for begin, finish, name in sorted(spans):
        if begin < at:
            raise IntegrityError(
                f"{path}: corrupt safetensors header: tensor {_shown(name)} overlaps tensor {_shown(last)} "
                f"(bytes {begin} to {min(at, finish)} belong to both)"
            )
        if begin > at:
            raise IntegrityError(
                f"{path}: corrupt safetensors header: tensor {_shown(name)} starts at byte {begin}, leaving "
                f"bytes {at} to {begin} unused"
            )
        at, last = finish, name
    return at


def _shown(name: Any) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return "entry is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        return "missing dtype"
    itemsize = _DTYPE_BYTES.get(dtype)
    if itemsize is None:
        return f"unknown dtype {_shown(dtype)} (known: {', '.join(_DTYPE_BYTES)})"
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        return f"bad shape {_shown(shape)} (up to {_MAX_DIMS} non-negative integers)"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        return f"bad data_offsets {_shown(offsets)}"
    numel = 1
    for dim in shape:
        numel *= dim
    if offsets[1] - offsets[0] != numel * itemsize:
        span = offsets[1] - offsets[0]
        return f"data_offsets span {span} bytes, {dtype}{shape} needs {numel * itemsize}"
    return None


# --------------------------------------------------------------------------------------------- build


def build_manifest(
    model_dir: str | Path,
    plan_hashes: dict[str, str] | None = None,
    also_read: tuple[str, ...] = (),
    first_use: Path | None = None,
    weights: bool = True,
) -> ShardManifest:
    """Find the shards of `model_dir` and every SHA-256 that is known for them (no file data is hashed).

    `weights` False: the load reads no shard here (a GGUF's blocks, pinned on their own, are the weights), so
    none is looked for and only the `also_read` files SHA256SUMS lists are checked.
    `also_read`: the other files the load reads when they are there; with a SHA256SUMS, verify() refuses
    any of them that it does not list (a file left out of the manifest is not checked at all otherwise).
    `first_use`: the first-use record (a SHA256SUMS kept in the cache) that stands in for the directory's
    own SHA256SUMS when it has none.
    """
    model_dir = Path(model_dir)
    root = _resolved_dir(model_dir)
    blobs = _hf_blobs_dir(root)

    no_shards: tuple[Format, Path | None, list[str], dict[str, str]] = ("safetensors", None, [], {})
    fmt, index, names, tensor_to_shard = _find_shards(model_dir, root, blobs) if weights else no_shards
    sums_path, recorded = _sums_path(model_dir, first_use)
    sums = _read_sums(sums_path)
    label: HashSource = "first-use" if recorded else "SHA256SUMS"
    plan = {
        _normalise_name(key): _normalise_hash(value, f"plan hash for {key!r}")
        for key, value in (plan_hashes or {}).items()
    }
    shards = []
    for name in names:
        path = model_dir / name
        size = None
        if fmt == "safetensors":
            try:
                header = read_safetensors_header(path)
                size = header.expected_size
                if index is None:
                    tensor_to_shard = dict.fromkeys(header.tensors, name)
            except (OSError, IntegrityError):
                pass  # left for verify(), which reports it with the right message
        sha, source = _known_hash(path, name, plan, sums, blobs, label)
        shards.append(ShardInfo(name=name, path=path, size=size, sha256=sha, hash_source=source))
    listed = _listed_files(model_dir, root, blobs, names, (plan, sums, sums_path, label))
    if not weights:  # shards an import may also hold, for plans that convert, are not this load's to check
        listed = [info for info in listed if info.name in also_read]
    return ShardManifest(
        model_dir=model_dir,
        format=fmt,
        shards=shards,
        tensor_to_shard=tensor_to_shard,
        index=index,
        listed=listed,
        sums=sums_path if os.path.lexists(sums_path) else None,
        first_use=recorded,
        also_read=also_read,
    )


def _resolved_dir(model_dir: Path) -> Path:
    """The model directory resolved; IntegrityError when it is not a directory or its symlinks loop."""
    if not model_dir.is_dir():
        raise IntegrityError(f"{model_dir}: not a directory")
    try:
        return model_dir.resolve()
    except (RuntimeError, OSError):
        raise IntegrityError(f"{model_dir}: symlink loop") from None


def _sums_path(model_dir: Path, first_use: Path | None) -> tuple[Path, bool]:
    """The SHA256SUMS to read: the directory's own, else the first-use record (then True) when one is given."""
    sums_path = model_dir / MANIFEST_NAME
    recorded = first_use is not None and not os.path.lexists(sums_path)
    if recorded:
        assert first_use is not None
        sums_path = first_use
    return sums_path, recorded


def _listed_files(
    model_dir: Path,
    root: Path,
    blobs: Path | None,
    shards: list[str],
    hashes: tuple[dict[str, str], dict[str, str], Path, HashSource],
) -> list[ShardInfo]:
    """The files that are not shards but have a hash (in SHA256SUMS or the plan), each checked to stay inside
    the directory. `hashes` is (the plan's, SHA256SUMS', the sums file, the label its hashes go by)."""
    plan, sums, sums_path, label = hashes
    listed = []
    for name in sorted(set(sums) | set(plan)):
        if name in shards:
            continue
        _check_entry(sums_path if name in sums else None, None, name, root, blobs)
        sha, source = _known_hash(model_dir / name, name, plan, sums, None, label)
        listed.append(ShardInfo(name=name, path=model_dir / name, size=None, sha256=sha, hash_source=source))
    return listed


def files_read_by_load(model_dir: str | Path, also_read: tuple[str, ...] = ()) -> list[str]:
    """The names (relative to `model_dir`) of every file a load reads: shards, index, and `also_read` present.

    Each is checked to stay inside the directory (or, in a Hub cache snapshot, inside its repository's
    `blobs/`), as the shards are: what a first-use record lists is what verify() will check.
    """
    manifest = build_manifest(model_dir, None, also_read)
    model_dir = manifest.model_dir
    root = model_dir.resolve()
    blobs = _hf_blobs_dir(root)
    names = [shard.name for shard in manifest.shards]
    extra = [manifest.index.name] if manifest.index is not None else []
    extra += [name for name in also_read if os.path.lexists(model_dir / name)]
    for name in extra:
        _check_entry(None, None, name, root, blobs)
    return [*names, *extra]


def _find_shards(
    model_dir: Path, root: Path, blobs: Path | None
) -> tuple[Format, Path | None, list[str], dict[str, str]]:
    """(format, index or None, shard names in order, tensor -> shard from the index)."""
    layouts: tuple[tuple[str, str, Format], ...] = (
        (SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "safetensors"),
        (TORCH_INDEX, TORCH_SINGLE, "torch"),
    )
    for index_name, single_name, fmt in layouts:
        index = model_dir / index_name
        if index.exists():
            tensor_to_shard = _read_index(index)
            checked: set[str] = set()
            for tensor, name in tensor_to_shard.items():
                if name not in checked:  # each file once, naming the first entry that uses it
                    _check_entry(index, tensor, name, root, blobs)
                    checked.add(name)
            return fmt, index, sorted(checked), tensor_to_shard
        if (model_dir / single_name).exists():
            _check_entry(None, None, single_name, root, blobs)
            return fmt, None, [single_name], {}
    raise IntegrityError(
        f"{model_dir}: no checkpoint found (looked for {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE}, "
        f"{TORCH_INDEX}, {TORCH_SINGLE})"
    )


def _read_index(index: Path) -> dict[str, str]:
    try:
        data = read_json_limited(index)
    except FileProblem as exc:
        raise IntegrityError(str(exc)) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise IntegrityError(f"{index}: no 'weight_map' object")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise IntegrityError(f"{index}: entry {tensor!r} -> {shard!r}: shard name is not a string")
    return weight_map


def _hf_blobs_dir(root: Path) -> Path | None:
    """`<repo cache>/blobs` when `root` lies in `<repo cache>/snapshots/<revision>/`, else None."""
    for ancestor in (root, *root.parents):
        if ancestor.parent.name == "snapshots":
            return ancestor.parent.parent / "blobs"
    return None


def _check_entry(index: Path | None, tensor: str | None, name: str, root: Path, blobs: Path | None) -> None:
    """Refuse a shard name that would read a file outside the model directory."""
    if index is None:
        where = f"{root / name}"
    elif tensor is None:
        where = f"{index}: entry {name!r}"
    else:
        where = f"{index}: entry {tensor!r} -> {name!r}"
    if not name or PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute() or ":" in name:
        raise IntegrityError(f"{where}: absolute path outside the model directory")
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        raise IntegrityError(f"{where}: '..' path escapes the model directory")
    try:
        resolved = (root / name).resolve()
    except (RuntimeError, OSError):  # Python reports a symlink loop as RuntimeError here
        raise IntegrityError(f"{where}: symlink loop") from None
    # HF hub caches store snapshot files as symlinks to ../../blobs/<hash> of the same repo cache.
    in_blobs = blobs is not None and resolved.parent == blobs
    if not resolved.is_relative_to(root) and not in_blobs:
        raise IntegrityError(f"{where}: symlink escapes the model directory (resolves to {resolved})")


def _read_sums(path: Path) -> dict[str, str]:
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        return {_normalise_name(name): digest for name, digest in read_sha256sums(path).items()}
    except ManifestError as exc:
        raise IntegrityError(str(exc)) from None


def _normalise_name(name: str) -> str:
    return name[2:] if name.startswith("./") else name


def _normalise_hash(value: str, what: str) -> str:
    digest = value.lower().removeprefix("sha256:")
    if not _SHA256.match(digest):
        raise IntegrityError(f"{what}: not a 64-hex SHA-256 ({value!r})")
    return digest


def _known_hash(
    path: Path,
    name: str,
    plan: dict[str, str],
    sums: dict[str, str],
    blobs: Path | None,
    sums_label: HashSource = "SHA256SUMS",
) -> tuple[str | None, HashSource | None]:
    """The shard's hash by precedence plan > SHA256SUMS (or first-use record) > HF blob name; sources that
    disagree are an error."""
    found: list[tuple[HashSource, str]] = []
    if name in plan:
        found.append(("plan", plan[name]))
    if name in sums:
        found.append((sums_label, sums[name]))
    if blobs is not None and path.is_symlink():
        target = path.resolve()
        if target.parent == blobs and _SHA256.match(target.name):  # git (non-LFS) blobs are 40-hex sha1
            found.append(("hf-cache-blob", target.name))
    if not found:
        return None, None
    source, digest = found[0]
    for other_source, other in found[1:]:
        if other != digest:
            raise IntegrityError(
                f"{path}: SHA-256 from {source} ({digest[:16]}…) disagrees with {other_source} ({other[:16]}…)"
            )
    return digest, source


# -------------------------------------------------------------------------------------------- verify


def verify(
    manifest: ShardManifest,
    policy: Policy = "if_present",
    progress: ProgressFn | None = None,
    hash_cache: HashCache | None = None,
) -> VerifyReport:
    """Check every shard; raise IntegrityError (one line, naming the file) on the first problem found.

    `off`: existence only. `if_present`: existence, exact size and header, and the SHA-256 where known.
    `required`: as `if_present`, and a shard without a known SHA-256 is an error.
    """
    if policy not in ("required", "if_present", "off"):
        raise ValueError(f"unknown verify policy {policy!r} (use 'required', 'if_present' or 'off')")
    start = time.perf_counter()
    report = VerifyReport()
    _check_all_but_hashes(manifest, policy)
    # Hashing last: it is the only slow check, and everything cheap has already passed. Small files first.
    if policy != "off" and manifest.sums is not None:
        _check_all_listed(manifest)
    files = ([*manifest.listed, *manifest.shards]) if policy != "off" else list(manifest.shards)
    for shard in files:
        report.files_checked += 1
        if policy == "off" or shard.sha256 is None:
            report.unhashed.append(shard.name)
            continue
        progress_of = progress if shard in manifest.shards else None
        actual, cached, size = _digest(shard, progress_of, hash_cache)
        if cached:
            report.cached.append(shard.name)
        else:
            report.bytes_hashed += size
        _check_hash(manifest, shard, shard.sha256, actual)
    if hash_cache is not None:
        hash_cache.save()
        report.cache_note = hash_cache.note
    report.seconds = time.perf_counter() - start
    return report


def _check_all_but_hashes(manifest: ShardManifest, policy: Policy) -> None:
    """The cheap checks, shards first: each file there and a regular file; unless policy 'off', each
    safetensors header against its size and the index, a known hash where 'required', every file the
    load reads listed when there is a SHA256SUMS."""
    listed = f" (listed in {manifest.index})" if manifest.index else ""
    by_shard: dict[str, list[str]] = {}
    for tensor, name in manifest.tensor_to_shard.items():
        by_shard.setdefault(name, []).append(tensor)
    for shard in manifest.shards:
        _check_present(shard, f"missing shard{listed}")
        if policy == "off":
            continue
        if manifest.format == "safetensors":
            _check_safetensors(manifest, shard, by_shard.get(shard.name, []))
        if shard.sha256 is None and policy == "required":
            raise IntegrityError(
                f"{shard.path}: no known SHA-256 and verify policy is 'required' "
                f"(add it to {MANIFEST_NAME} or the plan, or use policy 'if_present')"
            )
    # Every other file the manifest lists (config.json, tokenizer files, the index) is part of the
    # checkpoint too: a swapped tokenizer or an edited config changes answers as much as a shard does.
    if policy != "off":
        for other in manifest.listed:
            where = f"the first-use record {manifest.sums}" if manifest.first_use else MANIFEST_NAME
            _check_present(other, f"listed in {where} but missing")


def _check_hash(manifest: ShardManifest, shard: ShardInfo, expected: str, actual: str) -> None:
    """The file's SHA-256 is the `expected` one; a first-use record's mismatch says how to trust the change."""
    if actual != expected and shard.hash_source == "first-use":
        raise IntegrityError(
            f"{shard.path}: changed since the folder was first used (SHA-256 {actual[:16]}…, recorded "
            f"{expected[:16]}… in {manifest.sums}); refused (delete {_record_folder(manifest)} to trust "
            "the folder as it is now)"
        )
    if actual != expected:
        raise IntegrityError(f"{shard.path}: SHA-256 mismatch: expected {expected[:16]}…, got {actual[:16]}…")


def _check_present(info: ShardInfo, missing: str) -> None:
    """The file is there and is a regular file (no hang on a FIFO, a clear line for a directory or loop)."""
    try:
        mode = info.path.stat().st_mode
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            raise IntegrityError(f"{info.path}: {missing}") from None
        raise IntegrityError(describe_os_error(info.path, error)) from None
    if stat.S_ISDIR(mode):
        raise IntegrityError(f"{info.path}: a directory where a file belongs; refused")
    if not stat.S_ISREG(mode):
        raise IntegrityError(f"{info.path}: not a regular file (a FIFO, socket or device); refused")


def _digest(shard: ShardInfo, progress: ProgressFn | None, cache: HashCache | None) -> tuple[str, bool, int]:
    """(SHA-256, taken from the cache?, size) of the shard's bytes, read from one descriptor.

    The cache may answer only for the identity `fstat` gives on that descriptor; a digest is recorded
    only when it is the expected one and the identity did not change while the bytes were read.
    """
    fd = open_regular(shard.path)
    try:
        before = identity_of(os.fstat(fd))
        known = cache.lookup(shard.name, before) if cache is not None else None
        if known is not None:
            return known, True, before[0]
        try:
            actual = sha256_fd(fd, progress)
        except OSError as error:
            raise IntegrityError(describe_os_error(shard.path, error)) from None
        if cache is not None and actual == shard.sha256 and identity_of(os.fstat(fd)) == before:
            cache.record(shard.name, before, actual)
        return actual, False, before[0]
    finally:
        os.close(fd)


def _check_all_listed(manifest: ShardManifest) -> None:
    """With a SHA256SUMS present, every file the load reads has a hash: one left out is refused, not skipped."""
    hashed = {info.name for info in [*manifest.shards, *manifest.listed] if info.sha256 is not None}
    names = [info.name for info in manifest.shards]
    if manifest.index is not None:
        names.append(manifest.index.name)
    names += [name for name in manifest.also_read if os.path.lexists(manifest.model_dir / name)]
    for name in names:
        if name not in hashed and manifest.first_use:
            raise IntegrityError(
                f"{manifest.model_dir / name}: not there when the folder was first used (not in {manifest.sums}); "
                f"refused (delete {_record_folder(manifest)} to trust the folder as it is now)"
            )
        if name not in hashed:
            raise IntegrityError(
                f"{manifest.model_dir / name}: read by the load but not listed in {manifest.sums} "
                f"(add its line there, or remove the file)"
            )


def _record_folder(manifest: ShardManifest) -> Path | None:
    return manifest.sums.parent if manifest.sums is not None else None


def _check_safetensors(manifest: ShardManifest, shard: ShardInfo, indexed: list[str]) -> None:
    header = read_safetensors_header(shard.path)  # checks the file's size against the header too
    if manifest.index is not None:
        for tensor in indexed:
            if tensor not in header.tensors:
                raise IntegrityError(
                    f"{shard.path}: {manifest.index.name} lists tensor {tensor!r} but the shard does not contain it"
                )
