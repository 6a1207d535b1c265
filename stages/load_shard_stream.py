"""`load.shard_stream`: the checkpoint's shards as a stream through a bounded FIFO buffer, mmap-backed.

This stage reads no weights: it checks every shard's header against the config and sets up the stream
(which tensors, how many shards may be held at once). The stage that drains it (`load.convert`) pulls
tensors through it and converts each group as soon as it is complete, so host memory peaks near
(converted weights + N shards), never at (all fp32 shards + converted copy). The reading happens, and is
timed and counted (bytes, seconds, peak buffer), in the draining stage: its metrics carry the reader's.

A plan that keeps a GGUF's blocks has no shards: the stream is empty, and the stage says the weights are the
file's own blocks, mapped by `load.convert`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage
from llmplan.llm.formats import ReadResult, ShardStats, read_shards
from llmplan.llm.model import ModelConfig, expected_hf_names, layout_problems
from llmplan.llm.trust import FileProblem, IntegrityError, ShardManifest, read_json_limited, read_safetensors_header

from .slots import InferenceContext
from .types import HostWeights

CONVERTED_MARKER = "llmplan_converted.json"
_TORCH_STORAGE = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}


def check_headers(manifest: ShardManifest, cfg: ModelConfig) -> None:
    """Every safetensors header against the layout config.json implies, before a weight byte is used.

    Runs whatever the verify policy: a hash proves the file is the one that was published, not that
    it holds what this config describes (an I32 header on an F32 weight loads as garbage otherwise).
    """
    if manifest.format != "safetensors":
        return  # a pickle has no header: checked tensor by tensor as it arrives (checked_stream)
    for shard in manifest.shards:
        try:
            header = read_safetensors_header(shard.path)
        except IntegrityError as bad:
            raise StageFailure(str(bad)) from None
        declared = {name: (e["dtype"], tuple(e["shape"])) for name, e in header.tensors.items()}
        problems = layout_problems(declared, cfg)
        if problems:
            raise StageFailure(f"{shard.path}: {problems[0]}")


def checked_stream(
    on_tensor: Callable[[str, Tensor], None], cfg: ModelConfig, where: Path
) -> Callable[[str, Tensor], None]:
    """For `.bin` checkpoints: the same layout check, on each tensor before it is handed on."""

    def check(name: str, tensor: Tensor) -> None:
        storage = _TORCH_STORAGE.get(str(tensor.dtype), str(tensor.dtype).removeprefix("torch."))
        problems = layout_problems({name: (storage, tuple(tensor.shape))}, cfg)
        if problems:
            raise IntegrityError(f"{where}: {problems[0]}")
        on_tensor(name, tensor)

    return check


def read_converted_marker(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / CONVERTED_MARKER
    if not os.path.lexists(path):
        return None
    try:  # bounded, regular files only: a FIFO or /dev/zero in its place is refused, not read
        marker = read_json_limited(path, 1 << 20)
    except FileProblem as bad:
        raise StageFailure(str(bad)) from None
    if not isinstance(marker, dict) or marker.get("format") != "llmplan.converted/v1":
        raise StageFailure(f"{path}: not a llmplan.converted/v1 marker")
    return marker


class ReadParams(Params):
    buffer_shards: int = Field(1, ge=1, le=64, description="shards held in host memory at once (FIFO)")


class ShardStream(Stage):
    """Check shard headers; set up the bounded FIFO stream that load.convert reads and converts from."""

    name = "load.shard_stream"
    phase = Phase.LOAD
    Params = ReadParams
    reads = ("shard_manifest", "model_config")
    optional_reads = ("model_source",)
    writes = ("host_weights",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        manifest, cfg = ctx.shard_manifest, ctx.model_config
        assert manifest is not None and cfg is not None
        source = ctx.model_source
        if source is not None and source.weights_from_gguf and source.gguf_file is not None:
            from .model_source import keeps_blocks  # model.source's own rule (it imports this module's marker)

            if keeps_blocks(ctx.plan):
                nothing_to_stream(ctx, params, source.gguf_file)
            else:
                gguf_stream(ctx, source.gguf_file)
            return
        converted = read_converted_marker(manifest.model_dir)
        if converted is None:  # a converted checkpoint holds codes and scales, checked when rebuilt
            check_headers(manifest, cfg)
        # A checkpoint saved by load.convert holds the model's own (fused, quantized) tensors: take them all.
        wanted = set(manifest.tensor_to_shard) if converted is not None else expected_hf_names(cfg)
        metrics = ctx.metrics

        def stream(on_tensor: Callable[[str, Tensor], None]) -> ReadResult:
            try:
                with ctx.progress.task("read shards", manifest.total_bytes) as advance:
                    if converted is None and manifest.format != "safetensors":
                        on_tensor = checked_stream(on_tensor, cfg, manifest.model_dir)
                    result = read_shards(manifest, wanted, params.buffer_shards, on_tensor, advance)
            except IntegrityError as bad:
                raise StageFailure(str(bad)) from None
            record_read(metrics, result)
            if result.skipped:
                ctx.log.info(
                    "tensors_skipped", stage=metrics.current, count=len(result.skipped), names=result.skipped[:20]
                )
            return result

        def file_of(name: str) -> Path:
            shard = manifest.tensor_to_shard.get(name)
            return manifest.model_dir / shard if shard else manifest.shards[0].path

        ctx.host_weights = HostWeights(
            stream=stream,
            wanted=sorted(wanted),
            buffer_shards=params.buffer_shards,
            converted=converted,
            file_of=file_of,
        )
        ctx.metrics.set("tensors_wanted", len(wanted))
        ctx.metrics.set("buffer_shards", params.buffer_shards)

    def check(self, params: Any, deep: DeepCheck) -> None:
        deep.facts["buffer_shards"] = params.buffer_shards  # for load.convert's peak while converting


def record_read(metrics: Any, result: ReadResult, **more: Any) -> None:
    """The reader's numbers, under the stage that drains the stream (where the reading happened)."""
    metrics.by_stage.setdefault(metrics.current, {}).update(
        {
            "bytes_read": result.total_bytes,
            "read_s": result.seconds,
            "peak_buffer_bytes": result.peak_buffer_bytes,
            "peak_buffer_shards": result.peak_buffer_shards,
            "skipped": result.skipped,
            "shards": [vars(s) for s in result.shards],
            **more,
        }
    )


def gguf_stream(ctx: InferenceContext, gguf: Path) -> None:
    """A plan that converts from a GGUF (with the conversion cache: its import has no fp32 shards): the file's
    tensors dequantized one at a time, in HF names and layout as the import writes them, into the conversion.
    At most one fp32 tensor is held at once beside what the conversion keeps; nothing is written but the
    conversion's cache entry (and only when no entry was found: then this stream is never read)."""
    from llmplan.llm.formats.gguf import dequantized_tensors
    from llmplan.llm.formats.gguf.importer import GGUFImportError

    metrics = ctx.metrics

    def stream(on_tensor: Callable[[str, Tensor], None]) -> ReadResult:
        began, total, largest, count = time.perf_counter(), 0, 0, 0
        try:
            with ctx.progress.task(f"dequantize {gguf.name}", gguf.stat().st_size) as advance:
                for streamed in dequantized_tensors(gguf):
                    array = streamed.values()  # an F32 tensor is a view on the file's bytes: copied for torch
                    tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
                    total, largest, count = total + streamed.nbytes, max(largest, streamed.nbytes), count + 1
                    on_tensor(streamed.name, tensor)
                    advance(streamed.stored)
        except (GGUFImportError, OSError) as bad:
            raise StageFailure(str(bad)) from None
        seconds = time.perf_counter() - began
        result = ReadResult({}, [], [ShardStats(gguf.name, total, seconds, count)], largest, 1, seconds)
        record_read(metrics, result, dequantized_from=str(gguf))
        return result

    ctx.host_weights = HostWeights(stream=stream, wanted=[], buffer_shards=1, file_of=lambda name: gguf)
    ctx.metrics.set("streamed_from", str(gguf))
    if not ctx.json_mode:
        line = f"no shards to stream: load.convert maps its cached conversion of {gguf.name} or makes one from it"
        print(line, file=sys.stderr)


def nothing_to_stream(ctx: InferenceContext, params: Any, gguf: Path | None) -> None:
    """The plan keeps the GGUF's blocks: no shard is read; an empty stream, and a line saying so."""

    def stream(on_tensor: Callable[[str, Tensor], None]) -> ReadResult:
        raise StageFailure("no shards to stream: the plan keeps the GGUF's blocks (load.convert dtype stored)")

    ctx.host_weights = HostWeights(stream=stream, wanted=[], buffer_shards=params.buffer_shards)
    ctx.metrics.set("tensors_wanted", 0)
    ctx.metrics.set("streamed_from", str(gguf) if gguf is not None else None)
    if not ctx.json_mode:
        name = gguf.name if gguf is not None else "the GGUF"
        print(f"no shards to stream: the weights are {name}'s blocks, mapped", file=sys.stderr, flush=True)
