"""Looking inside a loaded model: its structure, per-layer timings and attention weights, on request.

`model_summary` describes the model as it was built (shapes, dtypes, linear kinds); it costs nothing
at run time. The hooks are opt-in through the plan's `observe:` block: `install_observers` returns
None and installs nothing when nothing is asked, so an unobserved run is the plain model.

* layer timings: a pre/post forward hook pair on every layer's attention and feed-forward module;
  a pass with more than one token per row is prefill, one token is decode.
* attention: SDPA returns no weights, so a forward hook on the chosen layers' attention modules
  recomputes softmax(q k^T / sqrt(d)) for the chosen heads from the module's input x, its wqkv and the
  model's RoPE tables, over the first request's prompt, during the first prefill pass only.

The run directory gets model.json, generations.json, and layer_timings.json / attention.json when asked.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from llmplan.engine.runner import write_json
from llmplan.llm.model import apply_rope

if TYPE_CHECKING:
    from llmplan.llm.kv_cache import KVCache
    from llmplan.llm.model import Transformer
    from llmplan.llm.tokenizer import Tokenizer

    from .slots import InferenceContext
    from .types import Result

OBSERVER_KEY = "ext.observer"
MODEL_FILE, GENERATIONS_FILE = "model.json", "generations.json"
TIMINGS_FILE, ATTENTION_FILE = "layer_timings.json", "attention.json"
LAYER_MODULES = ("attention_norm", "attention.wqkv", "attention.wo", "ffn_norm", "feed_forward.w13", "feed_forward.w2")


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
    embed = model.tok_embeddings.weight
    output_weight = getattr(model.output, "weight", None)
    summary: dict[str, Any] = {
        "n_layers": len(model.layers),
        "dim": cfg.dim,
        "n_heads": model.layers[0].attention.n_heads,
        "n_kv_heads": model.layers[0].attention.n_kv_heads,
        "head_dim": model.layers[0].attention.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": int(embed.shape[0]),
        "max_seq_len": model.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "norm_eps": cfg.norm_eps,
        "activation_dtype": _dtype(model.dtype),
        "device": str(model.device),
        "tied_embeddings": output_weight is not None and output_weight.data_ptr() == embed.data_ptr(),
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
            "shape": list(kv_cache.k.shape),
            "axes": ["layer", "batch", "kv_head", "token", "head_dim"],
            "dtype": _dtype(kv_cache.k.dtype),
            "bytes": kv_cache.nbytes,
            "policy": kv_cache.policy,
        }
    return summary


# --- hooks -------------------------------------------------------------------------------------------


def _phase(x: Tensor) -> str:
    return "prefill" if x.shape[1] > 1 else "decode"


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
    """Hooks on one model; `save` writes what they recorded, `remove` takes them off again."""

    def __init__(self, model: Transformer, layer_timings: bool, attention: Any | None) -> None:
        self.model = model
        self.handles: list[Any] = []
        n = len(model.layers)
        self.n_layers = n
        self.sync = model.device.type == "cuda"  # kernels are asynchronous: time them only once done
        self.timings: dict[str, dict[str, Any]] | None = None
        if layer_timings:
            self.timings = {
                p: {"passes": 0, "tokens": 0, "forward_s": 0.0, "attention_s": [0.0] * n, "mlp_s": [0.0] * n}
                for p in ("prefill", "decode")
            }
            self._install_timings()
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
                "maps": {},  # (layer, head) -> [[...]]
                "ids": None,
            }
            self._prompt_ids: Tensor | None = None
            self._install_attention(layers, heads)

    # timings

    def _clock(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _install_timings(self) -> None:
        assert self.timings is not None
        timings = self.timings
        started: dict[int, float] = {}

        def pre(_module: nn.Module, args: tuple[Any, ...]) -> None:
            started[id(_module)] = self._clock()

        def post_for(layer: int, key: str) -> Callable[..., None]:
            def post(module: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
                timings[_phase(args[0])][key][layer] += self._clock() - started.pop(id(module), time.perf_counter())

            return post

        def model_post(module: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
            bucket = timings[_phase(args[0])]
            bucket["passes"] += 1
            bucket["tokens"] += int(args[0].numel())
            bucket["forward_s"] += self._clock() - started.pop(id(module), time.perf_counter())

        self.handles.append(self.model.register_forward_pre_hook(pre))
        self.handles.append(self.model.register_forward_hook(model_post))
        for i, block in enumerate(self.model.layers):
            for module, key in ((block.attention, "attention_s"), (block.feed_forward, "mlp_s")):
                self.handles.append(module.register_forward_pre_hook(pre))
                self.handles.append(module.register_forward_hook(post_for(i, key)))

    # attention

    def _install_attention(self, layers: list[int], heads: list[int]) -> None:
        state = self.attention
        assert state is not None

        def remember_prompt(_module: nn.Module, args: tuple[Any, ...]) -> None:
            tokens = args[0]
            if state["ids"] is None and tokens.shape[1] > 1:
                self._prompt_ids = tokens

        def capture_for(layer: int) -> Callable[..., None]:
            def capture(module: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
                x, mask, start = args[0], args[3], args[6]
                if x.shape[1] <= 1 or start != 0 or any(k[0] == layer for k in state["maps"]):
                    return  # decode, a later prefill chunk, or already captured
                self._capture(module, layer, heads, x, mask)

            return capture

        self.handles.append(self.model.register_forward_pre_hook(remember_prompt))
        for layer in layers:
            self.handles.append(self.model.layers[layer].attention.register_forward_hook(capture_for(layer)))

    def _capture(self, attn: nn.Module, layer: int, heads: list[int], x: Tensor, mask: Tensor | None) -> None:
        state = self.attention
        assert state is not None
        # Row 0 = the first request; its prompt is the valid (not left-padding) columns, all at the end.
        columns = torch.arange(x.shape[1], device=x.device)
        if mask is not None:
            columns = columns[mask[0, 0, -1, : x.shape[1]]]
        columns = columns[: state["max_tokens"]]  # the first tokens: their rows see only kept tokens
        xs = x[:1, columns]
        q, k, _ = attn.wqkv(xs).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        t = xs.shape[1]
        q = q.view(1, t, attn.n_heads, attn.head_dim).transpose(1, 2)
        k = k.view(1, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        # RoPE from the model's own tables, by position (row 0's prompt starts at position 0): this does
        # not depend on how the forward pass lays out its cos/sin arguments.
        positions = torch.arange(t, device=x.device)
        cos_t = self.model.rope_cos[positions].to(q.dtype)[None, None]
        sin_t = self.model.rope_sin[positions].to(q.dtype)[None, None]
        q, k = apply_rope(q, cos_t, sin_t), apply_rope(k, cos_t, sin_t)
        group = attn.n_heads // attn.n_kv_heads
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        for head in heads:
            scores = (q[0, head].float() @ k[0, head // group].float().T) / math.sqrt(attn.head_dim)
            weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            state["maps"][(layer, head)] = weights.cpu().tolist()
        if state["ids"] is None and self._prompt_ids is not None:
            state["ids"] = self._prompt_ids[0, columns.to(self._prompt_ids.device)].tolist()

    # results

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def release(self) -> None:
        """Hooks off and the model let go: the hooks' closures and this object would keep it alive."""
        self.remove()
        self.model = None  # type: ignore[assignment]
        self._prompt_ids = None

    def timings_record(self) -> dict[str, Any] | None:
        if self.timings is None:
            return None
        return {"n_layers": self.n_layers, "device": str(self.model.device), "synchronized": self.sync, **self.timings}

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
            "token_ids": ids,
            "tokens": [tokenizer.id_to_token(i) for i in ids] if tokenizer is not None else None,
            "pieces": pieces,
            "maps": [
                {"layer": layer, "head": head, "weights": w} for (layer, head), w in sorted(state["maps"].items())
            ],
        }

    def save(self, run_dir: Path, tokenizer: Tokenizer | None = None) -> list[Path]:
        """Write layer_timings.json / attention.json (only what was asked); return the paths written."""
        written = []
        for name, record in ((TIMINGS_FILE, self.timings_record()), (ATTENTION_FILE, self.attention_record(tokenizer))):
            if record is not None:
                written.append(_write_json(Path(run_dir) / name, record))
        return written


def install_observers(model: Transformer, observe_settings: Any) -> Observer | None:
    """Hooks for what `observe_settings` (the plan's `observe:` block) asks; None, and no hooks, otherwise."""
    timings = bool(getattr(observe_settings, "layer_timings", False))
    attention = getattr(observe_settings, "attention", None)
    if not timings and attention is None:
        return None
    return Observer(model, timings, attention)


# --- what a run records ------------------------------------------------------------------------------


def _write_json(path: Path, data: Any) -> Path:
    return write_json(path, data, indent=None)


def generation_records(results: list[Result], tokenizer: Tokenizer | None = None) -> list[dict[str, Any]]:
    """One record per request: generated ids (and their text pieces), logprobs, per-token timestamps."""
    records = []
    for result in results:
        records.append(
            {
                "request_id": result.request_id,
                "prompt_tokens": result.prompt_tokens,
                "tokens": list(result.tokens),
                "pieces": [tokenizer.decode([t]) for t in result.tokens] if tokenizer is not None else None,
                "token_strings": [tokenizer.id_to_token(t) for t in result.tokens] if tokenizer is not None else None,
                "logprobs": list(result.logprobs),
                "step_times": list(getattr(result, "step_times", None) or []),
                "finish_reason": result.finish_reason,
                "temperature": result.params.get("temperature"),
                "num_beams": result.params.get("num_beams", 1),
                "timings": dict(result.timings),
            }
        )
    return records


def begin_observing(ctx: InferenceContext, model: Transformer, kv_cache: KVCache | None) -> Observer | None:
    """For load.to_device: write model.json, install the hooks the plan asks for (kept in ctx.ext)."""
    if ctx.run_dir is not None:
        _write_json(Path(ctx.run_dir) / MODEL_FILE, model_summary(model, kv_cache))
    settings = ctx.plan.plan.observe if ctx.plan is not None else None
    observer = install_observers(model, settings)
    if observer is not None:
        ctx.ext[OBSERVER_KEY] = observer
    return observer


def redact_flagged(ctx: InferenceContext, results: list[Result], records: list[dict[str, Any]]) -> None:
    """A generation an output filter of the plan flags keeps no tokens, pieces or logprobs here either."""
    from .output_filter import flags

    tokenizer = ctx.tokenizer
    if tokenizer is None:
        return
    for result, record in zip(results, records, strict=True):
        texts = [_text(tokenizer, result.tokens), *(_text(tokenizer, c.tokens) for c in result.candidates)]
        if flags(ctx, *texts):
            record.update(tokens=[], pieces=[], token_strings=[], logprobs=[], redacted=True)


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    vocab = tokenizer.vocab_size
    return tokenizer.decode([int(i) for i in ids if 0 <= int(i) < vocab], skip_special_tokens=True)


def finish_observing(ctx: InferenceContext, results: list[Result]) -> None:
    """For compute.generate: report cut prompts and failed requests; write generations.json and
    whatever the observer recorded."""
    from .compute_tokenize import report_requests

    report_requests(ctx, results)
    if ctx.run_dir is None:
        return
    records = generation_records(results, ctx.tokenizer)
    redact_flagged(ctx, results, records)
    _write_json(Path(ctx.run_dir) / GENERATIONS_FILE, records)
    observer = ctx.ext.get(OBSERVER_KEY)
    if isinstance(observer, Observer):
        observer.save(Path(ctx.run_dir), ctx.tokenizer)
