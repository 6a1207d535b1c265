"""`load.to_device`: build the model on the device around the converted weights, preallocate the KV cache.

Every weight's shape is checked against the config while the model is assembled; the memory of each
region (weights, KV cache, work buffers) is recorded so the report can draw it.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Literal

import torch
from pydantic import Field

from llmplan.engine import heap
from llmplan.engine.findings import StageFailure
from llmplan.engine.memory import file_backed_split
from llmplan.engine.memory_fit import KVSizing
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage
from llmplan.llm.formats.gguf import resident_parts
from llmplan.llm.generation import ModelRunner
from llmplan.llm.kv import DEFAULT_CHUNK, KVCache, planned_bytes
from llmplan.llm.model import Transformer, WeightError, kernel_paths, make_linear

from .load_convert import activation_dtype
from .observe import begin_observing
from .slots import InferenceContext
from .types import ConvertedWeights

CACHE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class KVCacheParams(Params):
    max_tokens: int = Field(2048, ge=8, le=1 << 20, description="tokens per sequence (prompt + generated)")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field("auto", description="auto = the activation dtype")
    policy: Literal["stop", "slide"] = Field("stop", description="when full: stop (cache_full) or slide")
    sink_tokens: int = Field(4, ge=0, le=1024, description="slide: first tokens always kept (attention sinks)")
    chunk: int = Field(
        DEFAULT_CHUNK,
        ge=1,
        le=1 << 20,
        description="sliding-window layers keep window + chunk tokens; prompts are prefilled chunk tokens a pass",
    )


class ToDeviceParams(Params):
    kv_cache: KVCacheParams = Field(default_factory=KVCacheParams)
    max_batch: int = Field(1, ge=1, le=4096, description="sequences decoded together (batch or beams)")


def kv_cache_bytes(cfg: Any, params: ToDeviceParams, act: torch.dtype) -> int:
    """What `run` allocates for the KV cache (llm/kv/cache.py `planned_bytes`: each layer by its kind)."""
    kv = params.kv_cache
    dtype = CACHE_DTYPES.get(kv.dtype, act)
    return planned_bytes(cfg, params.max_batch, kv.max_tokens, dtype, policy=kv.policy, chunk=kv.chunk)


def work_buffer_bytes(cfg: Any, max_tokens: int) -> int:
    """The model's own buffers besides weights and KV cache: the fp32 RoPE tables (cos and sin,
    [max_tokens, head_dim/2] each, and inv_freq [head_dim/2]), and the sliding layers' own cos and sin where
    they rotate by another base (Gemma 3) — what llm/model/transformer.py setup_rope builds.
    The one formula for both `validate --deep` and what `place` reports (checked against the real
    buffers in tests/trust/test_deep_checks.py)."""
    half = cfg.head_dim // 2
    tables = 2 if cfg.rope_local_theta is not None and any(cfg.layer_windows) else 1
    return 4 * (tables * 2 * max_tokens * half + half)


def kv_sizing(stage: str, cfg: Any, params: ToDeviceParams, act: torch.dtype) -> KVSizing:
    """How this stage's bytes (KV cache + work buffers) follow max_batch and max_tokens, for the fit search."""

    def bytes_for(max_batch: int, max_tokens: int) -> int:
        kv = params.kv_cache.model_copy(update={"max_tokens": max_tokens})
        other = params.model_copy(update={"max_batch": max_batch, "kv_cache": kv})
        return kv_cache_bytes(cfg, other, act) + work_buffer_bytes(cfg, max_tokens)

    limits = ToDeviceParams.model_fields["max_batch"].metadata, KVCacheParams.model_fields["max_tokens"].metadata
    return KVSizing(
        stage=stage,
        max_batch=params.max_batch,
        max_tokens=params.kv_cache.max_tokens,
        token_limit=min(cfg.max_position_embeddings, _bound(limits[1], "le")),
        batch_limit=_bound(limits[0], "le"),
        bytes_for=bytes_for,
        min_tokens=_bound(limits[1], "ge"),
        min_batch=_bound(limits[0], "ge"),
    )


def _bound(metadata: list[Any], name: str) -> int:
    """A field's `ge`/`le` bound, as its pydantic Field declares it (the one statement of the limits)."""
    return next(int(getattr(m, name)) for m in metadata if hasattr(m, name))


def attention_problems(plan: Any, cfg: Any) -> list[tuple[str, str]]:
    """(field, message) for observe.attention layers/heads the model does not have (they would be ignored)."""
    attention = getattr(getattr(plan, "observe", None), "attention", None)
    if attention is None:
        return []
    problems = []
    bad_layers = [i for i in attention.layers if not -cfg.n_layers <= i < cfg.n_layers]
    if bad_layers:
        problems.append(("layers", f"layers {bad_layers} out of range: the model has {cfg.n_layers} layers"))
    bad_heads = [h for h in attention.heads if not 0 <= h < cfg.n_heads]
    if bad_heads:
        problems.append(("heads", f"heads {bad_heads} out of range: the model has {cfg.n_heads} heads"))
    return problems


def _build_model(ctx: InferenceContext, weights: ConvertedWeights, max_tokens: int) -> Transformer:
    """The model on the device from the converted weights, each linear in the precision load.convert gave it."""
    cfg = ctx.model_config
    assert cfg is not None
    factory = functools.partial(
        make_linear, kernel=weights.kernel, bf16_inputs=weights.bf16_inputs, activation_bits=weights.activation_bits
    )
    try:
        return Transformer.from_weights(
            cfg,
            weights.tensors,
            linear_factory=factory,
            device=ctx.device,
            dtype=activation_dtype(weights.dtype, torch.device(ctx.device).type),
            max_seq_len=max_tokens,
            keep_linear_dtype=True,  # each linear weight in the precision load.convert gave it
        )
    except WeightError as bad:
        raise StageFailure(f"weights do not fit the config: {bad}") from None


def _allocate_cache(model: Transformer, params: Any) -> KVCache:
    """The KV cache the params ask for (its dtype the model's unless named); StageFailure when it cannot be."""
    kv = params.kv_cache
    cache_dtype = CACHE_DTYPES.get(kv.dtype, model.dtype)
    try:
        return KVCache.for_model(
            model,
            params.max_batch,
            kv.max_tokens,
            dtype=cache_dtype,
            policy=kv.policy,
            sink_tokens=kv.sink_tokens,
            chunk=kv.chunk,
        )
    except (ValueError, torch.OutOfMemoryError) as bad:
        raise StageFailure(f"kv_cache: {bad}") from None


def _record_placement(
    ctx: InferenceContext, params: Any, weights: ConvertedWeights, model: Transformer, cache: KVCache
) -> None:
    """The metrics of what was placed: the regions allocated and predicted, the kernels, the cache's shape."""
    cfg, kv = ctx.model_config, params.kv_cache
    assert cfg is not None
    # Only the RoPE tables: model.buffers() also holds quantized weights' codes and scales, which
    # are counted under weights (summing all buffers reported 129.5 MiB of "work buffers").
    work = work_buffer_bytes(cfg, kv.max_tokens)
    ctx.metrics.set("regions", {"weights": weights.nbytes, "kv_cache": cache.nbytes, "work_buffers": work})
    # where the model's weights lie: in a mapped file's pages (a GGUF, a conversion cache entry, a source shard)
    # or in the process's own memory, by each tensor's address
    spans = {t.data_ptr(): t.nbytes for t in model.state_dict().values() if t.numel() and t.device.type == "cpu"}
    split = file_backed_split(spans.items())
    if split is not None:
        ctx.metrics.set("weights_backing", {"file_backed": split[0], "anonymous": split[1]})
    source = ctx.model_source
    if source is not None and source.gguf_file is not None:  # for the memory tables' line (gguf_footprint)
        ctx.metrics.set("resident_weights", resident_parts(weights.tensors) | {"gguf_file": str(source.gguf_file)})
    # What `validate --deep` predicts for the cache, for the report to put beside what was allocated.
    predicted_kv = kv_cache_bytes(cfg, params, activation_dtype(weights.dtype, torch.device(ctx.device).type))
    ctx.metrics.set("predicted_regions", {"kv_cache": predicted_kv, "work_buffers": work})
    ctx.metrics.set("device", str(model.device))
    # each linear module's kernel path, chosen by prepack() above: e.g. {"native-avx512-int8": 151}
    ctx.metrics.set("linear_kernels", kernel_paths(model))
    ctx.metrics.set("activation_dtype", str(model.dtype).removeprefix("torch."))
    ctx.metrics.set("kv_cache_shape", list(cache.shape))  # as if every layer were full
    ctx.metrics.set("kv_cache_layer_tokens", list(cache.store.rows))  # what each layer keeps
    # The loader's tensors are gone: from here on every step's tensors are reused from the heap.
    ctx.metrics.set("heap_for_decoding", heap.for_decoding())


class ToDevice(Stage):
    """Move weights to the device, preallocate the KV cache and work buffers, check every shape."""

    name = "load.to_device"
    phase = Phase.LOAD
    Params = ToDeviceParams
    reads = ("weights", "model_config", "environment")
    writes = ("model", "kv_cache", "model_runner")

    def run(self, ctx: InferenceContext, params: Any) -> None:
        cfg, weights = ctx.model_config, ctx.weights
        assert cfg is not None and weights is not None
        kv = params.kv_cache
        if kv.max_tokens > cfg.max_position_embeddings:
            raise StageFailure(
                f"kv_cache.max_tokens {kv.max_tokens} exceeds the model's context ({cfg.max_position_embeddings})"
            )
        began = time.perf_counter_ns()
        model = _build_model(ctx, weights, kv.max_tokens)
        built = time.perf_counter_ns()
        ctx.trace.add("build the model on the device", "load", began, built)
        cache = _allocate_cache(model, params)
        allocated = time.perf_counter_ns()
        ctx.trace.add("allocate the KV cache", "load", built, allocated, bytes=cache.nbytes)
        for module in model.modules():  # pack fast-kernel weights now, so the first token does not pay for it
            prepack = getattr(module, "prepack", None)
            if callable(prepack):
                prepack()
        ctx.trace.add("prepack weights for the kernels", "load", allocated, time.perf_counter_ns())
        # The backend (native pass or torch modules) is chosen here, once: after prepack, which picks kernels.
        runner = ModelRunner(model, cache)
        ctx.model, ctx.kv_cache, ctx.model_runner = model, cache, runner
        begin_observing(ctx, model, cache, runner)  # model.json always; hooks only when plan.observe asks
        ctx.weights = None  # the model owns the tensors now
        _record_placement(ctx, params, weights, model, cache)

    def check(self, params: Any, deep: DeepCheck) -> None:
        cfg = deep.facts.get("model_config")
        if cfg is None:
            return
        act = deep.facts.get("activation_dtype", torch.float32)
        deep.estimate("kv_cache", kv_cache_bytes(cfg, params, act))
        deep.estimate("work_buffers", work_buffer_bytes(cfg, params.kv_cache.max_tokens))
        if params.kv_cache.max_tokens > cfg.max_position_embeddings:
            deep.problem(
                f"max_tokens {params.kv_cache.max_tokens} exceeds the model's context ({cfg.max_position_embeddings})",
                "kv_cache.max_tokens",
            )
        deep.facts["max_batch"] = params.max_batch
        deep.facts["max_tokens"] = params.kv_cache.max_tokens
        deep.facts["kv_sizing"] = kv_sizing(deep.current, cfg, params, act)
        for bound in getattr(deep.plan, "stages", []):
            beams = getattr(bound.params, "num_beams", 1) if bound.spec.uses == "compute.generate" else 1
            if beams > params.max_batch:  # the rule compute.generate applies at run time
                deep.problem(
                    f"num_beams {beams} (stage {bound.id!r}) needs {beams} KV-cache rows; max_batch is "
                    f"{params.max_batch}",
                    "max_batch",
                )
        for field, message in attention_problems(getattr(deep.plan, "plan", None), cfg):
            deep.problem(f"observe.attention.{field}: {message}", "")
