"""Import a GGUF once into an HF-format directory: config, tokenizer, fp32 safetensors shards.

The GGUF is the distribution format; everything downstream (config.py, the tokenizer, the weight
loader) reads plain HF files. Importing is a one-off cost, cached under the GGUF's content hash and
this importer's format version:

    model_dir = import_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), Path.home() / ".cache/llmplan")

Tensors are dequantized with gguf-py (`gguf.quants.dequantize`, llama.cpp's own definitions of every
block type) into float32, one at a time and one shard in memory at a time; gguf_config.py maps names and
metadata per family and says which of llama.cpp's conventions to undo (Llama's q/k row permutation,
Gemma's `1 + w` norms); gguf_vocab.py rebuilds the tokenizer.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from llmplan.bounded_read import NotRegularFileError

from ...trust.files import describe_os_error
from ...trust.hash_cache import HashCache, identity_of
from ...trust.manifest import (
    MANIFEST_NAME,
    ManifestError,
    open_regular_fd,
    read_sha256sums,
    sha256_fd,
    sha256_file,
    write_sha256sums,
)
from ..import_dirs import TEMP_MARK, finish_import_dir, make_import_dir, remove_stale_imports
from .block_types import BLOCK_TYPES
from .file import GGUFFile, GGUFFileError, TensorInfo, open_gguf
from .hf_config import SUPPORTED_ARCHITECTURES, Planned, family_of, hf_config, plan_tensors
from .mapped import check_block_values, map_gguf
from .metadata import GGUFImportError, GGUFMetadata, fail
from .pin import PIN_NAME, write_pin
from .vocab import hf_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GGUFImportError",
    "Imported",
    "import_gguf",
    "import_gguf_as",
    "unpermute_rope_rows",
]

ProgressFn = Callable[[str, int, int], None]
"""Called as progress(stage, done, total); stages: "hash" (bytes), "tensors" (tensors written)."""

DEFAULT_SHARD_BYTES = 200 * 1000 * 1000
IMPORT_FORMAT = 3
"""Part of the import's directory name: bumped whenever what an import writes changes (2: every family of
architecture.py, SentencePiece vocabularies; 3: the GGUF's pin, shards only for a plan that converts), so an
import written by older code is never reused."""
SAFETENSORS_INDEX = "model.safetensors.index.json"
_TEMP_MARK = TEMP_MARK  # temp dirs are ".<name>.importing-<pid>-<nonce>": hidden, never a finished import
_fail = fail


def import_dir_name(digest: str, gguf_path: Path) -> str:
    """The cache directory of an import: the GGUF's content, this importer's format, the file's stem."""
    return f"{digest[:16]}-f{IMPORT_FORMAT}-{Path(gguf_path).stem}"


@dataclass(frozen=True)
class Imported:
    """An import: its folder, and what this call wrote there (nothing on a warm start)."""

    model_dir: Path
    created: bool
    """True when this call made the folder (the file's first use)."""
    shards_added: bool
    """True when this call wrote the fp32 shards (into a new folder, or one that held none)."""
    written_bytes: int
    """Bytes this call wrote into the folder."""
    digest: str


def import_gguf(
    gguf_path: Path,
    cache_root: Path,
    progress: ProgressFn | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    note: Callable[[str], None] | None = None,
) -> Path:
    """Import `gguf_path` into `cache_root/<sha256[:16]>-f<format>-<stem>` (once) and return that directory."""
    return import_gguf_as(gguf_path, cache_root, progress, shard_bytes, note).model_dir


def import_gguf_as(
    gguf_path: Path,
    cache_root: Path,
    progress: ProgressFn | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    note: Callable[[str], None] | None = None,
    *,
    weights: bool = True,
    check_digest: Callable[[str], None] | None = None,
) -> Imported:
    """Import `gguf_path` into `cache_root/<sha256[:16]>-f<format>-<stem>` (once) and say what was written.

    `weights` False (a plan that keeps the file's blocks): only what cannot be read in place, config,
    tokenizer and the pin of the GGUF (pin.py), its blocks' values checked once here; True: the fp32 shards
    too, added to a folder that has none. `check_digest(sha256)` may refuse the file before anything is
    written. A finished import is only read, so a read-only cache works once it holds the import; recording
    the GGUF's hash for the next warm start is an optimisation, skipped (and `note` told why) where it cannot be.
    """
    gguf_path, cache_root = Path(gguf_path), Path(cache_root)
    known = HashCache(cache_root)
    digest = _opened_digest(gguf_path, known, progress)
    if check_digest is not None:
        check_digest(digest)
    target = cache_root / import_dir_name(digest, gguf_path)
    # The rename below is the commit point, so an existing target is a finished import.
    if (target / MANIFEST_NAME).is_file():
        remove_stale_imports(cache_root)  # what a killed import left, even when another one finished since
        added = 0
        if weights and not has_shards(target):
            added = _add_shards(gguf_path, cache_root, target, progress, shard_bytes)
        _save_hashes(known, note)
        return Imported(target, False, added > 0, added, digest)
    if target.exists() or target.is_symlink():  # only something outside this module can leave it half-made
        raise GGUFImportError(f"{target}: exists but has no {MANIFEST_NAME}, so it is not a finished import")
    temp = _new_import_dir(gguf_path, cache_root, target)
    with _cleaned(temp, cache_root, gguf_path):
        _write_import(gguf_path, temp, progress, shard_bytes, weights, digest)
        written = sum(item.stat().st_size for item in temp.iterdir())
        _publish(temp, target, cache_root)
    _save_hashes(known, note)  # only once the import is done: an interrupted one leaves nothing behind
    return Imported(target, True, weights, written, digest)


def has_shards(model_dir: Path) -> bool:
    """The import's SHA256SUMS lists its fp32 shards' index (an import for a plan that keeps blocks has none)."""
    try:
        return SAFETENSORS_INDEX in read_sha256sums(model_dir / MANIFEST_NAME)
    except ManifestError:
        return False  # load.verify says what is wrong with it


@contextmanager
def _cleaned(temp: Path, cache_root: Path, gguf_path: Path) -> Iterator[None]:
    """Remove `temp` on any failure; an OSError becomes one line saying nothing was kept."""
    try:
        yield
    except OSError as bad:
        shutil.rmtree(temp, ignore_errors=True)
        raise GGUFImportError(
            f"{cache_root}: cannot write the import of {gguf_path.name} ({bad.strerror or bad}); nothing was kept"
        ) from None
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _publish(temp: Path, target: Path, cache_root: Path) -> None:
    """Rename the complete `temp` into place (the commit point), durable first."""
    finish_import_dir(temp)
    for item in [*temp.iterdir(), temp]:  # durable before the rename publishes it as finished
        _fsync(item)
    try:
        os.rename(temp, target)
    except OSError:
        # Another process finished the same import first; theirs is as good as ours.
        if not (target / MANIFEST_NAME).is_file():
            raise
        shutil.rmtree(temp, ignore_errors=True)
    else:
        _fsync(cache_root)


def _add_shards(gguf_path: Path, cache_root: Path, target: Path, progress: ProgressFn | None, shard_bytes: int) -> int:
    """Give a finished import without shards its fp32 shards; returns the bytes written.

    The shards are written in a temp folder beside it, moved in one by one (each rename atomic; shards no
    SHA256SUMS lists are read by no load), and the new SHA256SUMS, listing them, replaces the old one last:
    that is the commit point. Two processes doing this at once write the same bytes, so either's files serve.
    """
    temp = _new_import_dir(gguf_path, cache_root, target)
    with _cleaned(temp, cache_root, gguf_path):
        try:
            with open_gguf(gguf_path) as gguf_file:
                plan = _plan(gguf_file)
                names = _write_shards(gguf_file, plan, temp, progress, shard_bytes)
        except GGUFFileError as bad:
            raise GGUFImportError(f"{gguf_path}: not a readable GGUF file: {bad}") from None
        sums = read_sha256sums(target / MANIFEST_NAME)
        sums.update({name: sha256_file(temp / name) for name in names})
        written = sum((temp / name).stat().st_size for name in names)
        (temp / MANIFEST_NAME).write_text("".join(f"{sums[n]}  {n}\n" for n in sorted(sums)), encoding="utf-8")
        for name in [*names, MANIFEST_NAME]:
            _fsync(temp / name)
            os.replace(temp / name, target / name)
        _fsync(target)
        finish_import_dir(temp)
        os.rmdir(temp)
    return written


def _opened_digest(gguf_path: Path, known: HashCache, progress: ProgressFn | None) -> str:
    """The GGUF's SHA-256 (see _gguf_digest), opening it as a regular file; GGUFImportError when it is not one."""
    try:
        fd = open_regular_fd(gguf_path)
    except NotRegularFileError as bad:
        raise GGUFImportError(str(bad)) from None
    except OSError as bad:
        raise GGUFImportError(describe_os_error(gguf_path, bad)) from None
    try:
        return _gguf_digest(fd, gguf_path, known, progress)
    finally:
        os.close(fd)


def _new_import_dir(gguf_path: Path, cache_root: Path, target: Path) -> Path:
    """The temp directory an import of `target` is written in, stale ones cleared first; GGUFImportError
    naming the settings to change when the cache root is not writable."""
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        remove_stale_imports(cache_root)
        return make_import_dir(target)
    except OSError as bad:
        raise GGUFImportError(
            f"{cache_root}: cannot import {gguf_path.name} there ({bad.strerror or bad}); "
            "set LLMPLAN_CACHE or model.source's cache_dir to a writable folder"
        ) from None


def _save_hashes(known: HashCache, note: Callable[[str], None] | None) -> None:
    if not known.save() and note is not None and known.note:
        note(known.note)


def _gguf_digest(fd: int, path: Path, known: HashCache, progress: ProgressFn | None) -> str:
    """The GGUF's SHA-256: from the cache root's hash cache for this very file identity, else hashed.

    A warm start finds the import by the file's identity instead of re-hashing it: 0.15 s for SmolLM2's
    98 MB, seconds for a multi-GB GGUF. Same trust as `load.verify`'s hash cache (authenticated entries).
    """
    name = str(path.absolute())
    before = identity_of(os.fstat(fd))
    digest = known.lookup(name, before)
    if digest is not None:
        return digest
    done = 0

    def on_hashed(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress("hash", done, before[0])

    try:
        digest = sha256_fd(fd, on_hashed)
    except OSError as bad:
        raise _fail(path, f"cannot read ({bad.strerror or bad})") from None
    if identity_of(os.fstat(fd)) == before:
        known.record(name, before, digest)
    return digest


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_import(
    gguf_path: Path, out: Path, progress: ProgressFn | None, shard_bytes: int, weights: bool, digest: str
) -> None:
    try:
        with open_gguf(gguf_path) as gguf_file:
            _write_from(gguf_file, out, progress, shard_bytes, weights)
            size = gguf_file.size
        checked = _blocks_checked(gguf_path, required=not weights)
    except GGUFFileError as bad:
        detail = str(bad).removeprefix(f"{gguf_path}: ")
        raise GGUFImportError(f"{gguf_path}: not a readable GGUF file: {detail}") from None
    write_pin(out, gguf_path, digest, size, checked)
    names = ["config.json", "tokenizer.json", "tokenizer_config.json", PIN_NAME]
    if weights:
        names += _listed_shards(out)
    # The manifest is written last: its presence marks a complete directory.
    write_sha256sums(out, names)


def _blocks_checked(gguf_path: Path, required: bool) -> bool:
    """Every block's fp16 scales finite (check_block_values), once, as the file is first hashed and imported.

    Required when the plan keeps the blocks: a damaged scale is refused here, naming the tensor and block.
    Beside the fp32 shards the dequantization already refused any NaN; the check then only records, for a
    later plan that keeps the blocks, that the file maps and its scales are finite (False where it does not
    map: a type with no block kernel, which that plan refuses anyway)."""
    try:
        with map_gguf(gguf_path) as mapped:
            check_block_values(mapped)
    except GGUFFileError as bad:
        if required:
            raise GGUFImportError(str(bad)) from None
        return False
    return True


def _listed_shards(out: Path) -> list[str]:
    return [*sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors"), SAFETENSORS_INDEX]


def _plan(gguf_file: GGUFFile) -> list[Planned]:
    meta = GGUFMetadata(gguf_file)
    family = family_of(meta)
    config = hf_config(meta, family, gguf_file.tensors)
    return plan_tensors(family, gguf_file.tensors, config, gguf_file.path)


def _write_from(gguf_file: GGUFFile, out: Path, progress: ProgressFn | None, shard_bytes: int, weights: bool) -> None:
    meta = GGUFMetadata(gguf_file)
    family = family_of(meta)
    tensors = gguf_file.tensors
    config = hf_config(meta, family, tensors)
    plan = plan_tensors(family, tensors, config, gguf_file.path)  # checked whether or not shards are written

    tokenizer_json, tokenizer_config = hf_tokenizer(meta)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    if weights:
        _write_shards(gguf_file, plan, out, progress, shard_bytes)


class StreamedTensor(NamedTuple):
    name: str
    """Its HF name."""
    nbytes: int
    """Its fp32 bytes."""
    stored: int
    """Its bytes in the file."""
    values: Callable[[], np.ndarray]
    """Dequantizes it into HF layout (while the file is open: inside the iteration)."""


def dequantized_tensors(gguf_path: Path) -> Iterator[StreamedTensor]:
    """The file's tensors as the import would write them, one at a time. The header is read and checked as the
    import checks it; nothing is written. GGUFImportError (one line naming the file) for a file that is not a
    readable GGUF."""
    try:
        with open_gguf(gguf_path) as gguf_file:
            for planned in _plan(gguf_file):
                stored = gguf_file.tensors[planned.gguf_name].nbytes
                values = functools.partial(_dequantized, gguf_file, planned)
                yield StreamedTensor(planned.hf_name, planned.nbytes, stored, values)
    except GGUFFileError as bad:
        detail = str(bad).removeprefix(f"{gguf_path}: ")
        raise GGUFImportError(f"{gguf_path}: not a readable GGUF file: {detail}") from None


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's q/k row permutation (per head: interleaved pairs -> two halves)."""
    rows = weight.shape[0]
    head_dim = rows // n_heads
    # GGUF row order within a head is (i, pair-member) for i < head_dim/2; HF wants (pair-member, i).
    return weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantized(gguf_file: GGUFFile, planned: Planned) -> np.ndarray:
    """The tensor as float32 in HF layout; NaN or infinity (a damaged block scale) is refused here, at import,
    not found at the first token."""
    from gguf import GGMLQuantizationType, quants

    tensor = gguf_file.tensors[planned.gguf_name]
    path = gguf_file.path
    try:
        data = gguf_file.read(tensor)
        values = _native_dequantized(tensor, data)
        if values is None:
            values = quants.dequantize(data, GGMLQuantizationType(tensor.ggml_type))
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(planned.hf_shape)
    except NotImplementedError:
        raise _fail(path, f"tensor {tensor.name}: type {tensor.type_name} is not supported") from None
    except ValueError as bad:
        raise _fail(path, f"tensor {tensor.name} is corrupt ({bad})") from None
    # max and min propagate NaN and show an infinity: two passes, no temporary the size of the tensor
    if not (np.isfinite(values.max()) and np.isfinite(values.min())):
        raise _fail(path, f"tensor {tensor.name} holds NaN or infinite values (damaged data); refused")
    if planned.unpermute_heads is not None:
        values = np.ascontiguousarray(unpermute_rope_rows(values, planned.unpermute_heads))
    if planned.norm_shift:
        values = values - np.float32(planned.norm_shift)  # the read may be a read-only view
    return values


def _native_dequantized(tensor: TensorInfo, data: np.ndarray) -> np.ndarray | None:
    """The quantized blocks as fp32 by the native kernels (equal to gguf-py's dequantize, tested per type), into
    the output directly: gguf-py's numpy temporaries are several times the tensor (the embedding table's are
    hundreds of MB) and it is slower; None where the kernels do not load or do not read this type."""
    if data.dtype != np.uint8 or BLOCK_TYPES.get(tensor.ggml_type) is None:
        return None
    import torch

    from ...kernels import native
    from ...model.weight_formats import GGUFWeight, dequantize_gguf

    if native.kernels() is None:
        return None
    rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
    with warnings.catch_warnings():  # the blocks are read, never written: a read-only buffer is fine
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(data.reshape(rows, -1))
    weight = GGUFWeight(blocks, tensor.ggml_type, (rows, int(tensor.shape[-1])), tensor.type_name)
    return dequantize_gguf(weight).numpy()


def _write_shards(
    gguf_file: GGUFFile,
    plan: list[Planned],
    out: Path,
    progress: ProgressFn | None,
    shard_bytes: int,
) -> list[str]:
    from safetensors.numpy import save_file

    # Assign shards up front (sizes are known from shapes), so file names can carry the shard count.
    shards: list[list[Planned]] = [[]]
    size = 0
    for p in plan:
        if shards[-1] and size + p.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    written = 0
    weight_map: dict[str, str] = {}
    for shard, name in zip(shards, names, strict=True):
        arrays = {}
        for p in shard:  # one shard in memory at a time
            arrays[p.hf_name] = _dequantized(gguf_file, p)
            weight_map[p.hf_name] = name
            written += 1
            if progress is not None:
                progress("tensors", written, len(plan))
        save_file(arrays, str(out / name), metadata={"format": "pt"})
        os.chmod(out / name, 0o644)  # safetensors creates 0600; the rest of the dir is world-readable
        del arrays
    index = {"metadata": {"total_size": sum(p.nbytes for p in plan)}, "weight_map": weight_map}
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    os.chmod(out / SAFETENSORS_INDEX, 0o644)
    return [*names, SAFETENSORS_INDEX]
