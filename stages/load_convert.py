"""`load.convert`: reassemble (fuse q/k/v and gate/up) and convert to fp32, fp16, bf16, int8 or int4; or, for a
GGUF (`stored`), keep the file's own blocks, mapped from the file instead of read from its fp32 import.

Tensors arrive one at a time from the shard reader; each fused group is converted as soon as its
parts are all in, and the parts are dropped, so the fp32 checkpoint is never held whole. Linear
weights take the plan's precision; embeddings and norms stay fp32 (a gather and a scale are cheap, and
their precision matters for every token) until `load.to_device` gives them the activation dtype.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from llmplan.engine.findings import StageFailure
from llmplan.engine.memory import mib
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage
from llmplan.llm.formats import check_checkpoint_target, write_checkpoint
from llmplan.llm.model import (
    FLOAT_DTYPES,
    ModelConfig,
    QuantDtype,
    concat_quantized,
    error_terms,
    expected_hf_names,
    from_tensors,
    fusion_table,
    internal_shapes,
    is_linear_weight,
    nbytes,
    quantize_weight,
    relative_from_terms,
    to_tensors,
    value_problem,
    value_range,
)
from llmplan.llm.trust import IntegrityError, read_safetensors_header
from llmplan.ownership import NotOurs

from .load_convert_cache import (
    CACHE_MAPPED,
    MEMORY,
    cache_use,
    converted_in_memory,
    keep_conversion,
    map_cached,
    predicted_road,
    record_errors,
)
from .load_peak import converting_peak, shard_tensor_bytes
from .load_shard_stream import CONVERTED_MARKER, read_converted_marker
from .slots import InferenceContext
from .types import ConvertedWeights

STORED = "stored"


class ConvertParams(Params):
    dtype: QuantDtype | Literal["stored"] = Field(
        "fp32",
        description="precision of the linear weights; stored: a GGUF's own blocks (Q4_K, Q6_K...), mapped from "
        "the file and multiplied as they are (CPU), no conversion",
    )
    group_size: int = Field(32, ge=8, le=1024, description="int4: weights per scale/zero group")
    activation_bits: Literal[8, 16] = Field(
        8,
        description="stored: the block kernels round each product's input per 32 columns to integers; 8: one "
        "int8 pass, as llama.cpp's Q8_0 rounds them (fastest prefill, KL ~1e-3 from the file's own values); 16: "
        "two int8 passes, the second over what the first left out (~15 bits: KL ~1e-7)",
    )
    head: Literal["same", "fp32", "bf16", "fp16", "int8"] = Field(
        "same", description="precision of the output head (the largest matmul of decode)"
    )
    cache: bool = Field(
        True,
        description="keep the conversion in the model cache ($LLMPLAN_CACHE/conversions), keyed by the shards' "
        "SHA-256, the config and these settings, and map it on later starts instead of converting again; false: "
        "convert in memory every start (`llmplan models` lists and removes entries)",
    )
    save_to: str | None = Field(
        None, description="also write the converted weights (with scales) as a checkpoint a later plan loads"
    )
    kernel: Literal["auto", "reference"] = Field(
        "auto",
        description="auto: the fastest weight-only kernel path for each linear layer, chosen at load (the "
        "run's linear_kernels metric names them); reference: plain matmuls",
    )
    bf16_inputs: bool = Field(
        False,
        description="the products of bf16 weights (a bf16 plan's linears, a bf16 head) take their input rounded "
        "to bf16, as torch's bf16 matmul and llama.cpp's BF16 do, and run on the CPU's BF16 dot products "
        "(AVX512_BF16; elsewhere x is rounded and the exact path runs); the residual stream, norms, attention "
        "and sums stay fp32. false: fp32 inputs, the exact product of the bf16 weights",
    )


def activation_dtype(precision: str, device_type: str = "cpu") -> torch.dtype:
    """The dtype of the residual stream, embeddings, norms and (by default) the KV cache.

    fp32 on the CPU at every precision: the native kernels widen fp16/bf16/int8/int4 weights to fp32 in
    registers, so the products are exact and the fused native step runs (a bf16 plan reads half of fp32's
    bytes per token). llama.cpp's BF16 instead rounds each product's input to bf16 (its BF16 dot products);
    `bf16_inputs` does that here too, for the products alone: the residual stream stays fp32. On a GPU an
    fp16/bf16 plan computes in its own dtype (tensor cores); int8/int4 are weight-only there too, in fp32.
    """
    if device_type != "cpu" and precision in ("fp16", "bf16"):
        return FLOAT_DTYPES[precision]
    return torch.float32


def weight_bytes(cfg: ModelConfig, precision: str, group_size: int, head: str = "same") -> int:
    """Bytes of the converted weights, for `validate --deep` (same rules as the conversion)."""
    return sum(tensor_bytes(cfg, precision, group_size, head).values())


def tensor_bytes(cfg: ModelConfig, precision: str, group_size: int, head: str = "same") -> dict[str, int]:
    """Each converted tensor's bytes (0 for the tied fp32 head: it is the embedding table itself)."""
    sizes = {}
    for name, shape in internal_shapes(cfg).items():
        count = 1
        for d in shape:
            count *= d
        kind = (head if head != "same" else precision) if name == "output.weight" else precision
        if name == "output.weight" and cfg.tie_word_embeddings and kind == "fp32":
            sizes[name] = 0  # converted_bytes counts the shared storage once
        elif not is_linear_weight(name) or kind == "fp32":
            sizes[name] = count * 4  # fp32 (norms and embeddings stay so until load.to_device)
        elif kind in ("fp16", "bf16"):
            sizes[name] = count * 2
        elif kind == "int8":
            sizes[name] = count + shape[0] * 4
        else:  # int4: half a byte per weight, fp16 scale and zero per group
            sizes[name] = count // 2 + (count // group_size) * 4
    return sizes


def predicted_peak(
    manifest: Any, cfg: ModelConfig, sizes: dict[str, int], buffer_shards: int, gguf: Path | None = None
) -> int | None:
    """Bytes held at once while the shards stream through the conversion (stages/load_peak.py); a GGUF the
    conversion reads itself streams one dequantized fp32 tensor at a time, each a shard of its own."""
    if gguf is not None and not manifest.shards:
        from llmplan.llm.formats.gguf import dequantized_tensors
        from llmplan.llm.formats.gguf.importer import GGUFImportError

        try:
            tensors = [{t.name: t.nbytes} for t in dequantized_tensors(gguf)]
        except GGUFImportError:
            return None  # load.verify and the stream say what is wrong with the file
        return converting_peak(tensors, fusion_table(cfg), sizes, 1)
    try:
        converted = read_converted_marker(manifest.model_dir)
    except StageFailure:
        return None  # load.shard_stream reports a bad marker
    if converted is not None:  # a saved conversion: every tensor is kept as it is read
        shards = shard_tensor_bytes(manifest, set(manifest.tensor_to_shard))
        if shards is None:
            return None
        stored = {name: size for shard in shards for name, size in shard.items()}
        return converting_peak(shards, {name: [name] for name in stored}, stored, buffer_shards)
    shards = shard_tensor_bytes(manifest, expected_hf_names(cfg))
    return None if shards is None else converting_peak(shards, fusion_table(cfg), sizes, buffer_shards)


def group_size_problem(cfg: ModelConfig, group_size: int) -> str | None:
    """int4 groups must tile every linear weight's input dim; the one rule for `run` and `validate --deep`."""
    bad = sorted({s[1] for n, s in internal_shapes(cfg).items() if is_linear_weight(n) and s[1] % group_size})
    return f"group_size {group_size} does not divide the input dims {bad}" if bad else None


def save_converted(weights: dict[str, Any], params: ConvertParams, source: Any) -> Path:
    """Write the converted weights (codes and scales) as a checkpoint with its own SHA256SUMS.

    The directory also gets the model's config and tokenizer files, so `model.source` with `path:` loads
    it directly; `llmplan_converted.json` tells the read and convert stages what it holds.
    """
    tensors: dict[str, Tensor] = {}
    for name, weight in weights.items():
        tensors.update(to_tensors(weight, name.removesuffix("weight")))
    extras: dict[str, bytes | str] = {
        CONVERTED_MARKER: json.dumps(
            {
                "format": "llmplan.converted/v1",
                "dtype": params.dtype,
                "group_size": params.group_size,
                "head": params.head,
                "source": getattr(source, "fingerprint", None),
            },
            indent=2,
        )
    }
    if source is not None:
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            path = source.model_dir / name
            if path.is_file():
                extras[name] = path.read_bytes()
    target = Path(params.save_to or "").expanduser()
    try:
        return write_checkpoint(tensors, target, 200 << 20, {"llmplan": "converted"}, extras, True)
    except NotOurs as bad:
        raise StageFailure(f"save_to {bad}") from None
    except OSError as bad:
        raise StageFailure(f"save_to {params.save_to}: cannot write the checkpoint ({bad.strerror or bad})") from None
    except ValueError as bad:
        raise StageFailure(f"save_to {params.save_to}: {bad}") from None


def _save_if_asked(ctx: InferenceContext, params: Any, weights: dict[str, Any]) -> None:
    """`save_to`: the converted weights written as a checkpoint, whichever road gave them."""
    if params.save_to:
        saved = save_converted(weights, params, ctx.model_source)
        ctx.metrics.set("saved_to", str(saved))
        ctx.log.info("converted_checkpoint_saved", path=str(saved))


def converted_bytes(weights: dict[str, Any]) -> int:
    """Bytes held, counting a tensor shared by two names (tied embeddings and head) once."""
    seen: set[int] = set()
    total = 0
    for weight in weights.values():
        if isinstance(weight, Tensor):
            if weight.data_ptr() in seen:
                continue
            seen.add(weight.data_ptr())
            total += weight.nbytes
        else:
            total += nbytes(weight)
    return total


def _where(ctx: InferenceContext) -> Any:
    """The file a tensor came from (the model directory when the reader cannot say), for messages."""
    host, source = ctx.host_weights, ctx.model_source
    if host is not None and host.file_of is not None:
        return host.file_of
    return lambda name: source.model_dir if source is not None else "checkpoint"


def _consumers(table: dict[str, list[str]]) -> tuple[dict[str, int], dict[str, list[str]]]:
    """For each source tensor: how many fused tensors need it, and which ones (in table order)."""
    users: dict[str, int] = {}
    waiting: dict[str, list[str]] = {}
    for internal, parts in table.items():
        for part in parts:
            users[part] = users.get(part, 0) + 1
            waiting.setdefault(part, []).append(internal)
    return users, waiting


def _precision_of(params: Any, internal: str) -> str:
    """A linear weight's precision: the plan's, or the head's own for the output head."""
    return params.head if internal == "output.weight" and params.head != "same" else params.dtype


def _kept_as(act: torch.dtype) -> str:
    """What embeddings and norms are stored in after the load: the activation dtype (fp16 or fp32 here)."""
    return "fp16" if act == torch.float16 else "fp32"


def _convert_group(params: Any, internal: str, parts: list[Tensor], errors: dict[str, float]) -> Any:
    """One fused tensor from its source parts, in its precision; a quantized one's error goes into `errors`."""
    precision = _precision_of(params, internal)
    if is_linear_weight(internal) and precision in ("int8", "int4"):
        # Rows quantize independently: quantize each part (q, k, v; gate, up) and join the codes,
        # not the fp32 parts (a 4x larger copy). The error terms of the parts add up.
        done = [quantize_weight(p.float(), precision, params.group_size) for p in parts]
        terms = [error_terms(p, q, row_step=8) for p, q in zip(parts, done, strict=True)]
        errors[internal] = relative_from_terms(sum(t[0] for t in terms), sum(t[1] for t in terms))
        return done[0] if len(done) == 1 else concat_quantized(done)  # type: ignore[arg-type]
    whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if not is_linear_weight(internal):
        return whole.to(torch.float32)
    if whole.dtype == FLOAT_DTYPES.get(precision):
        return whole  # already the plan's dtype: the very tensor read (mapped where it lies when cached)
    return quantize_weight(whole.float(), precision, params.group_size)


_STORED_AS = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}


def kept_in_place(manifest: Any, cfg: ModelConfig, params: Any) -> set[str]:
    """The weights a conversion leaves as their source tensor (`_convert_group`'s rule, from the shards' headers):
    one part, and an fp32 norm or embedding, or a linear already in the plan's float dtype."""
    if manifest is None or manifest.format != "safetensors":
        return set()
    stored: dict[str, str] = {}
    for shard in manifest.shards:
        try:
            stored |= {name: e["dtype"] for name, e in read_safetensors_header(shard.path).tensors.items()}
        except IntegrityError:
            return set()
    kept = set()
    for internal, parts in fusion_table(cfg).items():
        want = _STORED_AS.get(_precision_of(params, internal)) if is_linear_weight(internal) else "F32"
        if len(parts) == 1 and want is not None and stored.get(parts[0]) == want:
            kept.add(internal)
    return kept


def _fp32_range(where: Callable[[str], Any], name: str, tensor: Tensor) -> tuple[float, float]:
    """The tensor's (min, max). Every tensor, whatever its precision path: one min/max pass, so weights that
    would give NaN are refused here, naming the tensor, and never reach the first token."""
    found = value_range(tensor)
    problem = value_problem(*found, "fp32")
    if problem:
        raise StageFailure(f"{where(name)}: tensor {name!r} {problem}")
    return found


def _check_complete(table: dict[str, list[str]], out: dict[str, Any]) -> None:
    """Every tensor of the fusion table was converted; else the first few missing are named."""
    missing = sorted(set(table) - set(out))
    if missing:
        raise StageFailure(f"conversion incomplete: no tensors for {', '.join(missing[:5])}")


def _convert_stream(
    ctx: InferenceContext, params: Any, cfg: ModelConfig, kept_as: str
) -> tuple[dict[str, Any], dict[str, float], int, dict[str, str]]:
    """Drain the shard stream, converting each fused group as soon as its parts are in and dropping the parts:
    (converted weights, each quantized tensor's error, bytes read, the weights that are a source tensor unchanged)."""
    host = ctx.host_weights
    assert host is not None
    table = fusion_table(cfg)
    where = _where(ctx)
    users, waiting = _consumers(table)
    pending: dict[str, Tensor] = {}
    ranges: dict[str, tuple[float, float]] = {}  # each HF tensor's (min, max), from its one check
    out: dict[str, Any] = {}
    errors: dict[str, float] = {}
    in_place: dict[str, str] = {}  # internal name -> the source tensor it is, unchanged
    bytes_in = 0

    def convert(internal: str, parts: list[Tensor]) -> Any:
        began = time.perf_counter_ns()
        try:
            check_values(internal)
            return _convert_group(params, internal, parts, errors)
        finally:  # a load sub-step in the run's trace.json
            ctx.trace.add(f"convert {internal}", "load", began, time.perf_counter_ns(), tensors=len(parts))

    def check_values(internal: str) -> None:
        precision = _precision_of(params, internal) if is_linear_weight(internal) else kept_as
        for part in table[internal]:
            problem = value_problem(*ranges[part], precision)
            if problem:
                raise StageFailure(f"{where(part)}: tensor {part!r} {problem}")

    def on_tensor(name: str, tensor: Tensor) -> None:
        nonlocal bytes_in
        bytes_in += tensor.nbytes
        ranges[name] = _fp32_range(where, name, tensor)
        pending[name] = tensor
        for internal in waiting.get(name, []):
            parts = table[internal]
            if internal not in out and all(p in pending for p in parts):
                out[internal] = convert(internal, [pending[p] for p in parts])
                if len(parts) == 1 and out[internal] is pending[parts[0]]:
                    in_place[internal] = parts[0]  # nothing converted: the source tensor as it lies
                for p in parts:
                    users[p] -= 1
                    if users[p] == 0:
                        del pending[p]  # the fp32 source is no longer needed

    host.stream(on_tensor)
    _check_complete(table, out)
    return out, errors, bytes_in, in_place


class Convert(Stage):
    """Fuse q/k/v and gate/up, convert to the plan's precision; report bytes and quantization error."""

    name = "load.convert"
    phase = Phase.LOAD
    Params = ConvertParams
    reads = ("host_weights", "model_config")
    optional_reads = ("model_source", "shard_manifest")
    writes = ("weights",)

    def prepare(self, ctx: InferenceContext, params: Any) -> None:
        """`save_to` is refused before any weight is read unless it is free or a checkpoint llmplan saved."""
        if params.save_to:
            try:
                check_checkpoint_target(Path(params.save_to).expanduser())
            except NotOurs as bad:
                raise StageFailure(f"save_to {bad}") from None

    def run(self, ctx: InferenceContext, params: Any) -> None:
        cfg, host = ctx.model_config, ctx.host_weights
        assert cfg is not None and host is not None
        if params.dtype == STORED:
            map_stored(ctx, params, cfg)
            return
        if params.dtype == "int4" and (problem := group_size_problem(cfg, params.group_size)):
            raise StageFailure(problem)
        self._record_prediction(ctx, params, cfg)
        if host.converted is not None:
            self._record_peak(ctx, params, cfg, host.buffer_shards)
            self._load_converted(ctx, params, cfg, host)
            return
        # what embeddings and norms are stored in; fp16 and int4 hold +-65504
        kept_as = _kept_as(activation_dtype(params.dtype, torch.device(ctx.device or "cpu").type))
        use, why_not = cache_use(ctx, params, kept_as)
        if use is not None and map_cached(ctx, params, cfg, use):
            _save_if_asked(ctx, params, ctx.weights.tensors)  # type: ignore[union-attr]
            return
        self._record_peak(ctx, params, cfg, host.buffer_shards)
        start = time.perf_counter()
        out, errors, bytes_in, in_place = _convert_stream(ctx, params, cfg, kept_as)
        self._publish(ctx, params, out, errors, bytes_in, start)
        del out  # ctx.weights holds them: the conversion cache may swap them for its mapping
        if use is not None:
            keep_conversion(ctx, params, cfg, use, errors, time.perf_counter() - start, in_place)
        else:
            converted_in_memory(ctx, why_not)

    def _publish(
        self,
        ctx: InferenceContext,
        params: Any,
        out: dict[str, Any],
        errors: dict[str, float],
        bytes_in: int,
        start: float,
    ) -> None:
        """The converted weights into the context, saved where asked; their sizes, time and error as metrics."""
        total = converted_bytes(out)
        ctx.weights = ConvertedWeights(
            tensors=out,
            dtype=params.dtype,
            nbytes=total,
            errors=errors,
            kernel=params.kernel,
            bf16_inputs=params.bf16_inputs,
        )
        ctx.host_weights = None  # nothing more to read
        ctx.metrics.set("dtype", params.dtype)
        ctx.metrics.set("bytes_before", bytes_in)
        ctx.metrics.set("bytes_after", total)
        ctx.metrics.set("convert_s", time.perf_counter() - start)
        _save_if_asked(ctx, params, out)
        record_errors(ctx, errors)

    def _record_prediction(self, ctx: InferenceContext, params: Any, cfg: ModelConfig) -> None:
        """What `validate --deep` predicts for this load's weights, so the report can put it beside what happened."""
        sizes = tensor_bytes(cfg, params.dtype, params.group_size, params.head)
        ctx.metrics.set("predicted_bytes", sum(sizes.values()))

    def _record_peak(self, ctx: InferenceContext, params: Any, cfg: ModelConfig, buffer_shards: int) -> None:
        """The predicted peak while converting: only for a load that converts (a GGUF's header is read for it,
        vocabulary and all, which a start that maps its conversion need not pay)."""
        sizes = tensor_bytes(cfg, params.dtype, params.group_size, params.head)
        if ctx.shard_manifest is not None:
            source = ctx.model_source
            gguf = source.gguf_file if source is not None and source.weights_from_gguf else None
            peak = predicted_peak(ctx.shard_manifest, cfg, sizes, buffer_shards, gguf)
            if peak is not None:
                ctx.metrics.set("predicted_peak_bytes", peak)

    def _load_converted(self, ctx: InferenceContext, params: Any, cfg: ModelConfig, host: Any) -> None:
        """A checkpoint this stage saved earlier: rebuild its weights, no conversion work."""
        marker = host.converted
        if marker.get("dtype") != params.dtype or (
            params.dtype == "int4" and marker.get("group_size") != params.group_size
        ):
            raise StageFailure(
                f"the checkpoint was converted to {marker.get('dtype')} (group {marker.get('group_size')}); "
                f"this plan asks for {params.dtype} (group {params.group_size})"
            )
        tensors: dict[str, Tensor] = {}
        where = _where(ctx)

        def keep(name: str, tensor: Tensor) -> None:  # codes are integers; scales, zeros and weights are checked
            problem = value_problem(*value_range(tensor), "fp32")
            if problem:
                raise StageFailure(f"{where(name)}: tensor {name!r} {problem}")
            tensors[name] = tensor

        host.stream(keep)
        try:
            out = {name: from_tensors(tensors, name.removesuffix("weight")) for name in internal_shapes(cfg)}
        except (KeyError, ValueError) as bad:
            raise StageFailure(f"converted checkpoint: {bad}") from None
        total = converted_bytes(out)
        ctx.weights = ConvertedWeights(
            tensors=out, dtype=params.dtype, nbytes=total, kernel=params.kernel, bf16_inputs=params.bf16_inputs
        )
        ctx.host_weights = None
        ctx.metrics.set("dtype", params.dtype)
        ctx.metrics.set("bytes_before", total)
        ctx.metrics.set("bytes_after", total)
        ctx.metrics.set("preconverted", True)

    def check(self, params: Any, deep: DeepCheck) -> None:
        if params.save_to:
            try:
                check_checkpoint_target(Path(params.save_to).expanduser())
            except NotOurs as bad:
                deep.problem(str(bad), "save_to")
        cfg = deep.facts.get("model_config")
        if cfg is not None and params.dtype == STORED:
            stored_estimate(deep)
            return
        if cfg is None:
            return
        problem = group_size_problem(cfg, params.group_size) if params.dtype == "int4" else None
        if problem:
            deep.problem(problem, "group_size")
        sizes = tensor_bytes(cfg, params.dtype, params.group_size, params.head)
        deep.estimate("weights", sum(sizes.values()))
        # the device's own activation dtype: on a GPU an fp16/bf16 plan's KV cache is fp16/bf16, not fp32
        device = str(deep.facts.get("device") or "cpu")
        deep.facts["activation_dtype"] = act = activation_dtype(params.dtype, device.split(":")[0])
        manifest = deep.facts.get("manifest")
        gguf = deep.facts.get("gguf_file") if deep.facts.get("weights_from_gguf") else None
        road = predicted_road(manifest, deep.facts.get("model_dir"), params, _kept_as(act), gguf)
        deep.facts["weights_road"] = road
        if road != MEMORY:  # mapped from the entry: the page cache's pages, shared by every process that maps it
            deep.file_backed["weights"] = sum(sizes.values())
        if road == CACHE_MAPPED:
            return  # no conversion, so no peak while converting
        if road != MEMORY:  # less what it maps where it lies in the source
            kept = kept_in_place(manifest, cfg, params)
            deep.disk["a conversion cache entry"] = sum(v for k, v in sizes.items() if k not in kept)
        if manifest is not None:
            peak = predicted_peak(manifest, cfg, sizes, deep.facts.get("buffer_shards", 1), gguf)
            if peak is not None:
                held = deep.estimates.get("tokenizer", 0)  # loaded before the weights, held while they convert
                deep.peak("converting", peak + held)


def map_stored(ctx: InferenceContext, params: Any, cfg: ModelConfig) -> None:
    """dtype stored: the GGUF the model came from, mapped; its blocks become the weights (no conversion)."""
    from llmplan.llm.formats.gguf import (
        GGUFFileError,
        PinError,
        check_block_values,
        copies,
        map_gguf,
        read_pin,
        stored_types,
        stored_weights,
    )
    from llmplan.llm.formats.gguf.importer import GGUFImportError

    source = ctx.model_source
    path = source.gguf_file if source is not None else None
    if path is None:
        raise StageFailure("dtype stored keeps a GGUF's own blocks, but this model's source is not a .gguf file")
    if params.save_to or params.head != "same":
        raise StageFailure("dtype stored runs the file's own blocks: no save_to, and the head stays as stored")
    if torch.device(ctx.device or "cpu").type != "cpu":
        raise StageFailure(f"dtype stored runs on the CPU's GGUF block kernels, not on {ctx.device}")
    start = time.perf_counter()
    try:
        mapped = map_gguf(path)
        pin = read_pin(source.model_dir) if source is not None else None
        if pin is None or not pin.blocks_checked:  # checked once, at the import; a file it could not map: now
            check_block_values(mapped)
        stored_cfg, weights = stored_weights(mapped)
    except (GGUFFileError, GGUFImportError, PinError) as bad:
        raise StageFailure(str(bad)) from None
    if stored_cfg != cfg:
        raise StageFailure(f"{path}: its metadata no longer gives the import's config.json; refused")
    types = stored_types(weights)
    vectors = sum(w.nbytes for w in weights.values() if isinstance(w, Tensor))
    total = sum(types.values()) + vectors
    # what the load holds: the mapping's pages (all of them touched, in time) and the rows copied out of it
    copied, released = copies(mapped.file)
    resident = mapped.nbytes + copied - released
    mapped.drop_arrays()  # the vocabulary as Python objects: the tokenizer has its own
    bits = params.activation_bits
    ctx.weights = ConvertedWeights(
        weights, STORED, resident, kernel=params.kernel, mapping=mapped, activation_bits=bits
    )
    ctx.metrics.set("activation_bits", params.activation_bits)
    ctx.metrics.set("copied_bytes", copied)
    ctx.metrics.set("file_backed_bytes", mapped.nbytes - released)
    ctx.metrics.set("mapped_files", [str(path)])  # output.release measures its pages
    ctx.host_weights = None  # the fp32 import is not read
    ctx.metrics.set("dtype", STORED)
    ctx.metrics.set("weights_road", STORED)
    ctx.metrics.set("bytes_before", mapped.nbytes)
    ctx.metrics.set("bytes_after", total)
    ctx.metrics.set("stored_types", types)
    ctx.metrics.set("convert_s", time.perf_counter() - start)
    if not ctx.json_mode:
        print(f"{path.name}: mapped, {mib(sum(types.values()))} of {'/'.join(types)}", file=sys.stderr, flush=True)


def stored_estimate(deep: DeepCheck) -> None:
    """dtype stored: the weights are the GGUF's tensors, mapped, and the fused rows copied out of the mapping
    (both from the file's header, as `map_stored` counts them)."""
    from llmplan.llm.formats.gguf import GGUFFileError, copies, open_gguf
    from llmplan.llm.formats.gguf.importer import GGUFImportError

    gguf = deep.facts.get("gguf_file")
    if gguf is None:
        deep.problem("dtype stored keeps a GGUF's own blocks, but this model's source is not a .gguf file", "dtype")
        return
    try:
        with open_gguf(gguf) as parsed:
            mapped = sum(info.nbytes for info in parsed.tensors.values())
            copied, released = copies(parsed)
    except (GGUFFileError, GGUFImportError) as bad:
        deep.problem(str(bad), "dtype")
        return
    deep.estimate("weights", mapped + copied - released)  # the mapping, the copies less the pages they give back
    deep.file_backed["weights"] = mapped - released  # the copies are this process's own memory
    deep.facts["weights_road"] = STORED
    deep.facts["activation_dtype"] = torch.float32
