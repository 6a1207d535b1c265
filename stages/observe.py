"""Looking inside a loaded model: its structure, per-layer timings and attention weights, on request.

`model_summary` describes the model as it was built (shapes, dtypes, linear kinds); it costs nothing
at run time. The rest is opt-in through the plan's `observe:` block: `install_observers` returns
None and installs nothing when nothing is asked, so an unobserved run is the plain model.

* layer timings: a LayerClock on the model runner (llm/model/layer_clock.py), no hooks: the fused native pass
  and the torch modules both mark each layer's attention and MLP, so the run keeps the path it would
  take unobserved; the record holds the median and spread per layer over every pass, prefill and decode
  apart, and which path ran them. Every pass also goes into the run's trace.json.
* attention: the fused native pass cannot return attention weights (and SDPA returns none), so they are
  computed after the generation, outside its timing: one causal pass on the torch modules over the first
  request's prompt and answer recomputes softmax(q k^T / sqrt(d)) for the chosen layers and heads from each
  layer's input, its wqkv and the model's RoPE tables (`Observer.capture`). Observing changes neither the path
  the generation takes nor its speed (it did: hooks needed the torch modules, 15.7 tok/s against 40).

The run directory gets model.json, generations.json, and layer_timings.json / attention.json when asked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from llmplan.engine.findings import StageFailure
from llmplan.engine.runner import write_json
from llmplan.llm.model import LAYER_MODULES, LayerClock

if TYPE_CHECKING:
    from llmplan.llm.generation import ModelRunner, StepRecord
    from llmplan.llm.kv import KVCache
    from llmplan.llm.model import Transformer
    from llmplan.llm.text import Tokenizer

    from .slots import InferenceContext
    from .types import Result

OBSERVER_KEY = "ext.observer"
MODEL_FILE, GENERATIONS_FILE = "model.json", "generations.json"
TIMINGS_FILE, ATTENTION_FILE = "layer_timings.json", "attention.json"
STEPS_FILE = "steps.json"
MAX_DECODE_ROWS = 64  # decode steps whose attention is recomputed for the report


# --- structure ---------------------------------------------------------------------------------------


def _dtype(value: torch.dtype) -> str:
    return str(value).removeprefix("torch.")


def _weight_format(module: nn.Module) -> str:
    """fp32 / bf16 / fp16 for float weights, int8 / int4 for the quantized linears (by class name)."""
    name = type(module).__name__
    if name.startswith("Int8"):
        return "int8"
    if name.startswith("Int4"):
        return "int4"
    type_name = getattr(module, "type_name", None)  # a GGUF's own blocks (dtype stored): Q4_K, Q6_K...
    if isinstance(type_name, str):
        return type_name
    parts = getattr(module, "parts", None)
    if isinstance(parts, nn.ModuleList):  # fused GGUF parts of different block types
        return "/".join(dict.fromkeys(_weight_format(part) for part in parts))
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    weight = next((t for t in tensors if t.is_floating_point()), None)
    return (
        {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(_dtype(weight.dtype), "?")
        if weight is not None
        else "?"
    )


def describe_module(module: nn.Module) -> dict[str, Any]:
    """Kind, weight format, and every own parameter/persistent buffer with its shape and dtype."""
    tensors: dict[str, dict[str, Any]] = {}
    for name, param in module.named_parameters(recurse=False):
        tensors[name] = {"shape": list(param.shape), "dtype": _dtype(param.dtype), "bytes": param.nbytes}
    for name, buf in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            tensors[name] = {"shape": list(buf.shape), "dtype": _dtype(buf.dtype), "bytes": buf.nbytes}
    info: dict[str, Any] = {"kind": type(module).__name__, "format": _weight_format(module), "tensors": tensors}
    for attr in ("in_features", "out_features"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            info[attr] = value
    if "in_features" not in info and "weight" in tensors and len(tensors["weight"]["shape"]) == 2:
        info["out_features"], info["in_features"] = tensors["weight"]["shape"]
    return info


def architecture_summary(cfg: Any) -> dict[str, Any]:
    """Where the family departs from Llama (llm/model/architecture.py and the config), for the model graph."""
    arch = cfg.arch
    return {
        "mlp": "GeGLU" if arch.activation == "gelu_tanh" else "SwiGLU",
        "qkv_bias": arch.qkv_bias,
        "qk_norm": arch.qk_norm,
        "sandwich_norms": arch.sandwich_norms,
        "embed_scale": arch.embed_scale,
        "layer_windows": list(cfg.layer_windows),
        "attn_scale": cfg.attn_scale,
        "attn_softcap": cfg.attn_softcap,
        "final_softcap": cfg.final_softcap,
        "rope_local_theta": cfg.rope_local_theta,
    }


def model_summary(model: Transformer, kv_cache: KVCache | None = None) -> dict[str, Any]:
    """What the loaded model is: config numbers, layer 0's modules in detail, every layer's linear kinds.

    Everything is read from the modules themselves (not the config file), so a quantized or
    mis-shaped layer shows up as it is.
    """
    cfg = model.cfg
    first = model.layers[0]
    layer0 = {rel: describe_module(first.get_submodule(rel)) for rel in LAYER_MODULES}
    kinds = [
        {
            rel: f"{type(block.get_submodule(rel)).__name__}/{_weight_format(block.get_submodule(rel))}"
            for rel in LAYER_MODULES
        }
        for block in model.layers
    ]
    # a GGUF block table (GGUFEmbedding, dtype stored) has `blocks`, and a tied head shares them
    embed = getattr(model.tok_embeddings, "weight", None)
    if embed is None:
        embed = model.tok_embeddings.blocks
    output_weight = getattr(model.output, "weight", getattr(model.output, "blocks", None))
    summary: dict[str, Any] = {
        "n_layers": len(model.layers),
        "dim": cfg.dim,
        "n_heads": model.layers[0].attention.n_heads,
        "n_kv_heads": model.layers[0].attention.n_kv_heads,
        "head_dim": model.layers[0].attention.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": int(model.tok_embeddings.num_embeddings),
        "max_seq_len": model.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "norm_eps": cfg.norm_eps,
        "activation_dtype": _dtype(model.dtype),
        "device": str(model.device),
        "tied_embeddings": output_weight is not None and output_weight.data_ptr() == embed.data_ptr(),
        "model_type": cfg.model_type,
        "architecture": architecture_summary(cfg),
        "modules": {
            "tok_embeddings": describe_module(model.tok_embeddings),
            **{f"layers.0.{rel}": info for rel, info in layer0.items()},
            "norm": describe_module(model.norm),
            "output": describe_module(model.output),
        },
        "layer_kinds": kinds,
        "layers_identical": all(k == kinds[0] for k in kinds),
        "parameter_bytes": sum(p.nbytes for p in model.parameters())
        + sum(b.nbytes for n, b in model.named_buffers() if not n.startswith("rope_")),
    }
    if kv_cache is not None:
        summary["kv_cache"] = {
            "shape": list(kv_cache.shape),  # as if every layer were full; `layer_tokens`: what each keeps
            "layer_tokens": list(kv_cache.store.rows),
            "axes": ["layer", "batch", "kv_head", "token", "head_dim"],
            "dtype": _dtype(kv_cache.k.dtype),
            "bytes": kv_cache.nbytes,
            "policy": kv_cache.policy,
        }
    return summary


# --- observers ---------------------------------------------------------------------------------------


def _resolve(indexes: list[int], size: int) -> tuple[list[int], list[int]]:
    """Python-style indexes (-1 = last) into range(size): (kept, out of range), duplicates dropped."""
    kept: list[int] = []
    bad: list[int] = []
    for i in indexes:
        j = i + size if i < 0 else i
        if 0 <= j < size:
            if j not in kept:
                kept.append(j)
        else:
            bad.append(i)
    return kept, bad


class Observer:
    """What one model records: per-layer timings (a LayerClock, no hooks) and attention (a pass after the
    run, `capture`); `save` writes it, `remove` takes the clock off the runner again."""

    def __init__(
        self, model: Transformer, layer_timings: bool, attention: Any | None, runner: ModelRunner | None = None
    ) -> None:
        self.model, self.runner = model, runner
        n = len(model.layers)
        self.n_layers = n
        self.sync = model.device.type == "cuda"  # kernels are asynchronous: time them only once done
        self.clock: LayerClock | None = None
        if layer_timings:
            # Read by the fused native pass and the torch modules alike: the run keeps the path it would take.
            self.clock = LayerClock(n)
            if runner is not None:
                runner.clock = self.clock
        self.attention: dict[str, Any] | None = None
        if attention is not None:
            n_heads = model.layers[0].attention.n_heads
            layers, bad_layers = _resolve(list(attention.layers), n)
            heads, bad_heads = _resolve(list(attention.heads), n_heads)
            self.attention = {
                "layers": layers,
                "heads": heads,
                "max_tokens": int(attention.max_tokens),
                "ignored": {"layers": bad_layers, "heads": bad_heads},
                "maps": {},  # (layer, head) -> [[...]], filled by `capture` after the run
                "ids": None,
            }

    # attention

    def capture(self, prompt: list[int], generated: list[int]) -> None:
        """Attention of one request, recomputed after the run and outside its timed generation (the run keeps the
        path it takes unobserved): one causal pass on the torch modules over the prompt and the answer, no cache
        and no hooks (`Transformer.hidden`, each chosen layer's input read as it goes). It gives the prompt's map
        (its first `max_tokens` tokens: their rows see only those) and each decode step's row exactly as that
        step saw its keys: rows are the queries that picked generated token 0 (the prompt's last), 1, 2, …"""
        state, model = self.attention, self.model
        if state is None or model is None or not prompt:
            return
        picked = generated[:MAX_DECODE_ROWS]
        ids = prompt + picked[:-1]  # the last picked token is never an input
        wanted, heads = set(state["layers"]), state["heads"]
        probs: dict[tuple[int, int], Tensor] = {}

        def read_layer(i: int, x: Tensor) -> None:
            if i in wanted:
                block = model.layers[i]
                for head, weights in self._weights(block.attention, block.attention_norm(x), heads).items():
                    probs[(i, head)] = weights

        with torch.inference_mode():
            model.hidden(torch.tensor([ids], device=model.device), on_layer=read_layer)
        kept = min(len(prompt), state["max_tokens"])
        state["maps"] = {key: w[:kept, :kept].cpu().tolist() for key, w in probs.items()}
        state["ids"] = prompt[:kept]
        if picked:
            rows_from = len(prompt) - 1
            maps = {key: w[rows_from:].cpu().tolist() for key, w in probs.items()}
            state["decode"] = {"prompt_ids": prompt, "picked_ids": picked, "maps": maps}

    def _weights(self, attn: nn.Module, x: Tensor, heads: list[int]) -> dict[int, Tensor]:
        """softmax(q kᵀ scale) for row 0 of `x` (all of it valid, from position 0), as the layer computes it
        (its biases, q/k norms, RoPE tables, window, soft-cap: `Attention.probabilities`)."""
        probs = attn.probabilities(x[:1], *self.model.rope_for(attn))
        return {head: probs[head] for head in heads}

    # results

    def remove(self) -> None:
        if self.clock is not None and self.runner is not None and self.runner.clock is self.clock:
            self.runner.clock = None

    def release(self) -> None:
        """The clock off and the model let go: this object would keep it alive."""
        self.remove()
        self.model = None  # type: ignore[assignment]
        self.runner = None

    def timings_record(self, load_average: list[float] | None = None) -> dict[str, Any] | None:
        if self.clock is None:
            return None
        return timings_summary(self.clock, str(self.model.device) if self.model is not None else "?", self.sync) | {
            "load_average": load_average
        }

    def attention_record(self, tokenizer: Tokenizer | None = None) -> dict[str, Any] | None:
        state = self.attention
        if state is None:
            return None
        ids = state["ids"] or []
        pieces = [tokenizer.decode([i]) for i in ids] if tokenizer is not None else None
        return {
            "layers": state["layers"],
            "heads": state["heads"],
            "max_tokens": state["max_tokens"],
            "ignored": state["ignored"],
            # how the weights were taken: the page says so (the generation's timings are not of this pass)
            "taken": "after the run, one pass over prompt and answer on the torch modules, outside the timings",
            "token_ids": ids,
            "tokens": [tokenizer.id_to_token(i) for i in ids] if tokenizer is not None else None,
            "pieces": pieces,
            "maps": [
                {"layer": layer, "head": head, "weights": w} for (layer, head), w in sorted(state["maps"].items())
            ],
            "decode": self._decode_record(tokenizer),
        }

    def _decode_record(self, tokenizer: Tokenizer | None) -> dict[str, Any] | None:
        decode = (self.attention or {}).get("decode")
        if not decode:
            return None
        ids = decode["prompt_ids"] + decode["picked_ids"][:-1]

        def named(values: list[int]) -> dict[str, Any]:
            return {
                "token_ids": values,
                "tokens": [tokenizer.id_to_token(i) for i in values] if tokenizer is not None else None,
                "pieces": [tokenizer.decode([i]) for i in values] if tokenizer is not None else None,
            }

        return {
            "prompt_tokens": len(decode["prompt_ids"]),
            "columns": named(ids),
            "rows": named(decode["picked_ids"]),  # row i: the query that picked this token
            "maps": [
                {"layer": layer, "head": head, "weights": w} for (layer, head), w in sorted(decode["maps"].items())
            ],
        }

    def save(self, run_dir: Path, tokenizer: Tokenizer | None = None) -> list[Path]:
        """Write layer_timings.json / attention.json (only what was asked); return the paths written."""
        written = []
        timings = self.timings_record(_load_average())
        for name, record in ((TIMINGS_FILE, timings), (ATTENTION_FILE, self.attention_record(tokenizer))):
            if record is not None:
                written.append(_write_json(Path(run_dir) / name, record))
        return written


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"median": 0.0, "p10": 0.0, "p90": 0.0, "min": 0.0, "max": 0.0}

    def q(f: float) -> float:
        return ordered[min(len(ordered) - 1, round(f * (len(ordered) - 1)))]

    return {"median": q(0.5), "p10": q(0.1), "p90": q(0.9), "min": ordered[0], "max": ordered[-1]}


def timings_summary(clock: LayerClock, device: str, synchronized: bool) -> dict[str, Any]:
    """Per phase: the sums the page had before (attention_s, mlp_s per layer), and per layer the median and
    spread (p10-p90, min, max) over every pass in ms, plus which path (fused native / torch) ran the passes."""
    n = clock.n_layers
    record: dict[str, Any] = {"n_layers": n, "device": device, "synchronized": synchronized, "dropped": clock.dropped}
    for phase in ("prefill", "decode"):
        passes = [p for p in clock.passes if p.phase == phase]
        attention = [[(p.marks[1 + 2 * i] - p.marks[2 * i]) / 1e6 for p in passes] for i in range(n)]
        mlp = [[(p.marks[2 + 2 * i] - p.marks[1 + 2 * i]) / 1e6 for p in passes] for i in range(n)]
        forward = [(p.marks[-1] - p.marks[0]) / 1e6 for p in passes]
        other = [(p.marks[-1] - p.marks[-2] + p.marks[1] - p.marks[0]) / 1e6 for p in passes]  # embed/norm/head
        paths: dict[str, int] = {}
        for p in passes:
            paths[p.path] = paths.get(p.path, 0) + 1
        record[phase] = {
            "passes": len(passes),
            "tokens": sum(p.rows * p.tokens for p in passes),
            "paths": paths,
            "forward_s": sum(forward) / 1000,
            "attention_s": [sum(a) / 1000 for a in attention],
            "mlp_s": [sum(m) / 1000 for m in mlp],
            "attention_ms": [_quantiles(a) for a in attention],
            "mlp_ms": [_quantiles(m) for m in mlp],
            "forward_ms": _quantiles(forward),
            "outside_layers_ms": _quantiles(other),
        }
    return record


def trace_layers(ctx: InferenceContext, clock: LayerClock) -> None:
    """Every observed pass into the run's trace: the pass, and each layer's attention and MLP inside it."""
    n = clock.n_layers
    for number, p in enumerate(clock.passes):
        m = p.marks
        ctx.trace.add(f"{p.phase} pass ({p.path})", "pass", m[0], m[-1], number=number, rows=p.rows, tokens=p.tokens)
        for i in range(n):
            ctx.trace.add(f"layer {i}", "layer", m[2 * i], m[2 + 2 * i])
            ctx.trace.add("attention", "layer", m[2 * i], m[1 + 2 * i], layer=i)
            ctx.trace.add("mlp", "layer", m[1 + 2 * i], m[2 + 2 * i], layer=i)


def check_attention_choice(ctx: InferenceContext, model: Transformer) -> None:
    """Layers and heads the plan asks to capture must exist in this model: one line naming file:line:field."""
    settings = getattr(ctx.plan.plan.observe, "attention", None) if ctx.plan is not None else None
    if settings is None:
        return
    n_layers, n_heads = len(model.layers), model.layers[0].attention.n_heads
    problems = []
    for i, layer in enumerate(settings.layers):
        if not -n_layers <= layer < n_layers:
            problems.append(
                (
                    ("observe", "attention", "layers", i),
                    f"layer {layer} does not exist: the model has "
                    f"{n_layers} layers (0..{n_layers - 1}, or -{n_layers}..-1 from the end)",
                )
            )
    for i, head in enumerate(settings.heads):
        if head >= n_heads:
            problems.append(
                (
                    ("observe", "attention", "heads", i),
                    f"head {head} does not exist: the model has {n_heads} query heads (0..{n_heads - 1})",
                )
            )
    if problems:
        source = ctx.plan.source
        raise StageFailure("; ".join(str(source.finding(path, message)) for path, message in problems))


def install_observers(model: Transformer, observe_settings: Any, runner: ModelRunner | None = None) -> Observer | None:
    """An observer for what `observe_settings` (the plan's `observe:` block) asks; None otherwise.
    `runner`: the model runner whose passes are timed (on whichever backend it runs)."""
    timings = bool(getattr(observe_settings, "layer_timings", False))
    attention = getattr(observe_settings, "attention", None)
    if not timings and attention is None:
        return None
    return Observer(model, timings, attention, runner)


# --- what a run records ------------------------------------------------------------------------------


def _write_json(path: Path, data: Any) -> Path:
    return write_json(path, data, indent=None)


def _alternative(tokenizer: Tokenizer | None, token: int, logprob: float) -> list[Any]:
    """[id, logprob, its text, its spelling]: the spelling (a byte-level token's bytes) lets the report read
    an alternative that is part of a character after the bytes before it."""
    if tokenizer is None:
        return [token, logprob, str(token), None]
    return [token, logprob, tokenizer.decode([token]), tokenizer.id_to_token(token)]


def generation_records(
    results: list[Result],
    tokenizer: Tokenizer | None = None,
    prompts: dict[str, str] | None = None,
    origin: float = 0.0,
) -> list[dict[str, Any]]:
    """One record per request: its prompt, generated ids (and their text pieces), logprobs and the best
    alternatives at each step, when each token came (seconds since `origin`), the finish reason."""
    records = []
    for result in results:
        pieces = [tokenizer.decode([t]) for t in result.tokens] if tokenizer is not None else None
        steps = result.alternatives or []
        alternatives = [[_alternative(tokenizer, int(i), float(lp)) for i, lp in top] for top in steps]
        records.append(
            {
                "request_id": result.request_id,
                "prompt": (prompts or {}).get(result.request_id),
                "prompt_tokens": result.prompt_tokens,
                "text": _text(tokenizer, result.tokens) if tokenizer is not None else None,
                "tokens": list(result.tokens),
                "pieces": pieces,
                "token_strings": [tokenizer.id_to_token(t) for t in result.tokens] if tokenizer is not None else None,
                "logprobs": list(result.logprobs),
                "alternatives": alternatives,
                "step_times": [t - origin for t in result.token_times],
                "finish_reason": result.finish_reason,
                "finish_detail": result.finish_detail,
                "from_cache": result.from_cache,
                "temperature": result.params.get("temperature"),
                "num_beams": result.params.get("num_beams", 1),
                "timings": dict(result.timings),
                # speculative decoding: (generated before, guessed, accepted) per verify pass (the report's picture)
                "speculation": [list(step) for step in result.generation.speculation],
                # a format: the constraint, and per step how many tokens its mask allowed (the report's picture)
                "format": result.format_record,
                "mask_allowed": result.mask_allowed,
            }
        )
    return records


def record_steps(ctx: InferenceContext, timeline: list[StepRecord]) -> None:
    """The scheduler's steps into the run's trace and steps.json (the report's decode-speed picture)."""
    trace, steps = ctx.trace, []
    for number, step in enumerate(timeline):
        trace.add_seconds(f"step {number}", "step", step.start, step.end, number=number)
        entry: dict[str, Any] = {"start": step.start - ctx.started, "end": step.end - ctx.started}
        if step.decode is not None:
            began, ended, rows = step.decode
            trace.add_seconds(f"decode ({rows} rows)", "decode", began, ended, rows=rows)
            entry["decode"] = {"start": began - ctx.started, "end": ended - ctx.started, "rows": rows}
        chunks = []
        for began, ended, tag, n in step.prefill:
            trace.add_seconds(f"prefill {tag} ({n} tokens)", "prefill", began, ended, request=str(tag), tokens=n)
            chunks.append({"start": began - ctx.started, "end": ended - ctx.started, "request": str(tag), "tokens": n})
        entry["prefill"] = chunks
        steps.append(entry)
    if ctx.run_dir is not None:
        _write_json(Path(ctx.run_dir) / STEPS_FILE, {"clock": "seconds since the run started", "steps": steps})


def begin_observing(
    ctx: InferenceContext, model: Transformer, kv_cache: KVCache | None, runner: ModelRunner | None = None
) -> Observer | None:
    """For load.to_device: write model.json, install the observer the plan asks for (kept in ctx.ext)."""
    if ctx.run_dir is not None:
        _write_json(Path(ctx.run_dir) / MODEL_FILE, model_summary(model, kv_cache))
    settings = ctx.plan.plan.observe if ctx.plan is not None else None
    check_attention_choice(ctx, model)
    observer = install_observers(model, settings, runner)
    if observer is not None:
        ctx.ext[OBSERVER_KEY] = observer
    return observer


def redact_flagged(ctx: InferenceContext, results: list[Result], records: list[dict[str, Any]]) -> None:
    """A generation an output filter of the plan flags keeps no tokens, pieces or logprobs here either; of
    the others, the alternatives that filter would withhold are left out (`withheld_alternatives` counts them)."""
    from .output_filter import screen_generation

    for result, record in zip(results, records, strict=True):
        flagged, withheld = screen_generation(ctx, result)
        if flagged:
            record.update(tokens=[], pieces=[], token_strings=[], logprobs=[], alternatives=[], text="", redacted=True)
        elif any(withheld):
            record["alternatives"] = [
                [alt for alt in step if i >= len(withheld) or int(alt[0]) not in withheld[i]]
                for i, step in enumerate(record["alternatives"])
            ]
            record["withheld_alternatives"] = sum(len(ids) for ids in withheld)


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    vocab = tokenizer.vocab_size
    return tokenizer.decode([int(i) for i in ids if 0 <= int(i) < vocab], skip_special_tokens=True)


def finish_observing(ctx: InferenceContext, results: list[Result], shared_model: bool = False) -> None:
    """For compute.generate: report cut prompts and failed requests; write generations.json and
    whatever the observer recorded."""
    from .compute_tokenize import report_requests

    report_requests(ctx, results)
    if ctx.run_dir is None:
        return
    prompts = {r.id: r.prompt_text for r in ctx.requests or []}
    records = generation_records(results, ctx.tokenizer, prompts, ctx.started)
    redact_flagged(ctx, results, records)
    _write_json(Path(ctx.run_dir) / GENERATIONS_FILE, records)
    observer = ctx.ext.get(OBSERVER_KEY)
    if isinstance(observer, Observer):
        # Not a generation a filter flags: the attention record names its tokens.
        first = next(
            (
                r
                for r, rec in zip(results, records, strict=True)
                if r.tokens and not r.from_cache and not rec.get("redacted")
            ),
            None,
        )
        request = next((q for q in ctx.requests or [] if first is not None and q.id == first.request_id), None)
        uncut = request is not None and first is not None and len(request.prompt_ids) == first.prompt_tokens
        # Not for a prompt cut to fit (which tokens went in is not kept), nor on a model another thread is
        # stepping (a served plan): the extra pass would run beside that thread's.
        if uncut and observer.attention is not None and not shared_model:
            observer.capture(list(request.prompt_ids), list(first.tokens))
        observer.save(Path(ctx.run_dir), ctx.tokenizer)
        if observer.clock is not None:
            trace_layers(ctx, observer.clock)
            observer.clock.passes.clear()  # a resident plan's next request starts afresh
