"""`load.convert`'s conversion cache: map this conversion's entry, or convert and keep the result for next time.

The roads to the weights, each said on the stage's line and in the metrics (`weights_road`):

    stored          a GGUF's own blocks, mapped from the file (dtype stored: load_convert.map_stored)
    cache-mapped    this conversion's cache entry, checked and mapped: no shard is read, nothing converted
    cached          converted now, written into the cache, then mapped from it (so this start's weights are
                    file-backed too, and the next start maps them)
    memory          converted in memory and not kept: the plan's `cache: false`, a cache that cannot be written,
                    or shards whose SHA-256 nobody checked (without them the entry could not be keyed safely)

The key (llm/formats/conversion_cache/key.py) covers the shards' SHA-256 as `load.verify` checked them, the
config, the conversion's settings and the code's version: a changed file or setting finds no entry.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmplan.engine import heap
from llmplan.engine.memory import mib
from llmplan.llm.formats.conversion_cache import (
    CacheEntry,
    ConversionKey,
    EntryProblem,
    conversions_root,
    discard_entry,
    find_entry,
    flatten,
    open_entry,
    unflatten,
    write_entry,
)
from llmplan.llm.model import ModelConfig, internal_shapes
from llmplan.llm.trust import FileProblem, read_bytes_limited

from .slots import InferenceContext
from .types import ConvertedWeights

CACHE_MAPPED, CACHED, MEMORY = "cache-mapped", "cached", "memory"


@dataclass(frozen=True)
class CacheUse:
    """Where this conversion's entry is (or will be) and under which key."""

    key: ConversionKey
    root: Path
    label: str
    sources: Path
    """The folder of the shards the key names (where in-place tensors are mapped from)."""


def conversion_key(
    manifest: Any, model_dir: Path, params: Any, kept_as: str, gguf: Path | None = None
) -> tuple[ConversionKey | None, str]:
    """The key of this conversion of these shards (or of the GGUF the import pins, when the weights come from
    the file itself), or None and why there is none."""
    if not params.cache:
        return None, "the plan's load.convert cache: false"
    if gguf is not None and (manifest is None or not manifest.shards):
        sources, why = _pinned(model_dir, gguf)
    else:
        sources, why = _verified_shards(manifest)
    if sources is None:
        return None, why
    try:
        config = hashlib.sha256(read_bytes_limited(model_dir / "config.json", 1 << 20)).hexdigest()
    except FileProblem as bad:
        return None, str(bad)
    settings = {"dtype": params.dtype, "group_size": params.group_size, "head": params.head, "kept_as": kept_as}
    return ConversionKey(sources, config, settings), ""


def _verified_shards(manifest: Any) -> tuple[tuple[tuple[str, str], ...] | None, str]:
    if manifest is None or not manifest.shards:
        return None, "no verified shard list to key it by"
    unknown = [shard.name for shard in manifest.shards if shard.sha256 is None]
    if unknown:
        return None, f"{unknown[0]} has no SHA-256 checked by load.verify, so no entry can be keyed to it"
    return tuple(sorted((s.name, str(s.sha256)) for s in manifest.shards)), ""


def _pinned(model_dir: Path, gguf: Path) -> tuple[tuple[tuple[str, str], ...] | None, str]:
    """The GGUF by the SHA-256 its import pins (load.verify checked the file against it at this start)."""
    from llmplan.llm.formats.gguf import PinError, read_pin

    try:
        pin = read_pin(model_dir)
    except PinError as bad:
        return None, str(bad)
    if pin is None:
        return None, f"{model_dir}: no pin of {gguf.name} to key it by"
    return ((gguf.name, pin.sha256),), ""


def cache_use(ctx: InferenceContext, params: Any, kept_as: str) -> tuple[CacheUse | None, str]:
    """The entry this load may use, or None and why not (for the line saying it converted in memory)."""
    source = ctx.model_source
    if source is None:
        return None, "no model source"
    gguf = source.gguf_file if source.weights_from_gguf else None
    key, why = conversion_key(ctx.shard_manifest, source.model_dir, params, kept_as, gguf)
    if key is None:
        return None, why
    return CacheUse(key, conversions_root(), f"{source.name}-{params.dtype}", source.model_dir), ""


def predicted_road(manifest: Any, model_dir: Path | None, params: Any, kept_as: str, gguf: Path | None = None) -> str:
    """For `validate --deep`: the road a run would take now (an entry found is opened by the run, not here)."""
    key, _ = conversion_key(manifest, model_dir, params, kept_as, gguf) if model_dir is not None else (None, "")
    if key is None:
        return MEMORY
    return CACHE_MAPPED if find_entry(conversions_root(), key) is not None else CACHED


def map_cached(ctx: InferenceContext, params: Any, cfg: ModelConfig, use: CacheUse) -> bool:
    """This conversion's entry, mapped into ctx.weights; False (and a line when one was refused) otherwise."""
    path = find_entry(use.root, use.key)
    if path is None:
        return False
    began = time.perf_counter()
    try:
        entry, tensors = _opened(path, use, cfg)
    except (EntryProblem, KeyError, ValueError) as bad:
        gone = discard_entry(path)
        _say(ctx, f"conversion cache: {bad}; refused{', discarded' if gone else ''}: converting again")
        ctx.metrics.set("conversion_entry_refused", str(bad))
        return False
    errors = entry.marker.get("errors") or {}
    ctx.weights = _weights(params, tensors, entry, errors)
    ctx.host_weights = None  # no shard is read
    _record(ctx, params, entry, CACHE_MAPPED, errors)
    ctx.metrics.set("convert_s", time.perf_counter() - began)
    ctx.metrics.set("entry_bytes_hashed", entry.hashed_bytes)
    how = entry.marker.get("seconds")
    made = f"; converted {entry.marker.get('created', '?')} in {how:.1f} s" if isinstance(how, float) else ""
    _say(ctx, f"mapped from the conversion cache: {path.name} ({_sizes(entry)}, {params.dtype}{made})")
    return True


def keep_conversion(
    ctx: InferenceContext,
    params: Any,
    cfg: ModelConfig,
    use: CacheUse,
    errors: dict[str, float],
    seconds: float,
    in_place: dict[str, str],
) -> None:
    """Write the conversion ctx.weights holds into the cache, then map it in their place (the anonymous copy
    goes); a cache that cannot be written leaves the weights in memory and says so. A weight that is a source
    tensor unchanged (`in_place`: a bf16 linear under a bf16 plan) is not copied: the entry names it."""
    weights = ctx.weights
    assert weights is not None
    refs = _in_place_refs(ctx, weights.tensors, in_place)
    flat, aliases = flatten({name: w for name, w in weights.tensors.items() if name not in refs})
    about = {
        "model": use.label.removesuffix(f"-{params.dtype}"),
        "dtype": params.dtype,
        "aliases": aliases,
        "in_place": refs,
        "errors": errors,
        "seconds": round(seconds, 3),
    }
    began = time.perf_counter()
    try:
        path = write_entry(use.root, use.key, use.label, flat, about)
        entry, tensors = _opened(path, use, cfg)
    except (OSError, EntryProblem, KeyError, ValueError) as bad:
        converted_in_memory(ctx, f"the conversion cache cannot keep it ({_reason(bad)})")
        return
    ctx.weights = _weights(params, tensors, entry, errors)
    del flat, weights  # the last references to the converted copy: freed here, so the trim can give them back
    heap.trim()  # the converted copy's pages back to the system now: the mapping holds the weights from here
    _record(ctx, params, entry, CACHED, errors)
    ctx.metrics.set("entry_write_s", time.perf_counter() - began)
    _say(ctx, f"converted in {seconds:.1f} s, cached as {path.name} ({_sizes(entry)}): later starts map it")


def _opened(path: Path, use: CacheUse, cfg: ModelConfig) -> tuple[CacheEntry, dict[str, Any]]:
    """The entry checked and mapped, and the weights by their internal names (ties as the very same object)."""
    entry = open_entry(path, use.key, use.sources)
    errors = entry.marker.get("errors") or {}
    if not isinstance(errors, dict) or not all(isinstance(v, int | float) for v in errors.values()):
        raise EntryProblem(f"{entry.path}: its marker's errors are not numbers")
    return entry, unflatten(entry.tensors, _aliases(entry), list(internal_shapes(cfg)))


def record_errors(ctx: InferenceContext, errors: dict[str, float]) -> None:
    """Each quantized tensor's relative error, and their max and mean, as metrics."""
    if errors:
        ctx.metrics.set("quant_error_max", max(errors.values()))
        ctx.metrics.set("quant_error_mean", sum(errors.values()) / len(errors))
        ctx.metrics.set("quant_error_by_tensor", errors)


def _in_place_refs(ctx: InferenceContext, weights: dict[str, Any], in_place: dict[str, str]) -> dict[str, Any]:
    """Where each unchanged weight lies: its safetensors shard and name (a .bin shard cannot be mapped)."""
    manifest = ctx.shard_manifest
    if manifest is None or manifest.format != "safetensors":
        return {}
    refs = {}
    for internal, source in in_place.items():
        shard, tensor = manifest.tensor_to_shard.get(source), weights[internal]
        if shard is not None:
            refs[internal] = {"shard": shard, "tensor": source, "dtype": str(tensor.dtype), "shape": list(tensor.shape)}
    return refs


def converted_in_memory(ctx: InferenceContext, why: str) -> None:
    ctx.metrics.set("weights_road", MEMORY)
    ctx.metrics.set("weights_road_why", why)
    _say(ctx, f"converted in memory, not cached: {why}")


def _weights(params: Any, tensors: dict[str, Any], entry: CacheEntry, errors: dict[str, float]) -> ConvertedWeights:
    return ConvertedWeights(
        tensors=tensors,
        dtype=params.dtype,
        nbytes=entry.mapped_bytes,
        errors=errors,
        kernel=params.kernel,
        bf16_inputs=params.bf16_inputs,
        mapping=entry,
    )


def _record(ctx: InferenceContext, params: Any, entry: CacheEntry, road: str, errors: dict[str, float]) -> None:
    ctx.metrics.set("weights_road", road)
    ctx.metrics.set("conversion_entry", str(entry.path))
    ctx.metrics.set("entry_bytes", entry.nbytes)
    ctx.metrics.set("in_place_bytes", entry.in_place_bytes)  # mapped from the source shards where they lie
    ctx.metrics.set("dtype", params.dtype)
    ctx.metrics.set("bytes_after", entry.mapped_bytes)
    ctx.metrics.set("file_backed_bytes", entry.mapped_bytes)
    ctx.metrics.set("mapped_files", [str(p) for p in entry.paths])  # output.release measures their pages
    if road == CACHE_MAPPED:  # the conversion's own error, as measured when it was made
        record_errors(ctx, errors)


def _sizes(entry: CacheEntry) -> str:
    where = f" + {mib(entry.in_place_bytes)} where they lie in the source" if entry.in_place_bytes else ""
    return f"{mib(entry.nbytes)}{where}"


def _aliases(entry: CacheEntry) -> dict[str, str]:
    aliases = entry.marker.get("aliases") or {}
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise EntryProblem(f"{entry.path}: its marker's aliases are not names")
    return aliases


def _reason(bad: BaseException) -> str:
    if isinstance(bad, OSError):
        where = f"{bad.filename}: " if bad.filename else ""
        return f"{where}{bad.strerror or bad}"
    return str(bad)


def _say(ctx: InferenceContext, line: str) -> None:
    if not ctx.json_mode:
        print(line, file=sys.stderr, flush=True)
