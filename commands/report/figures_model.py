"""The model as it was loaded (model.json): the stack, and one decoder layer with shapes and dtypes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from .common import Figure, mib, plt, save
from .run_data import RunData

KIND_COLORS = {"fp32": "#9ec5fe", "bf16": "#a5d8ff", "fp16": "#a5d8ff", "int8": "#ffc078", "int4": "#ffa8a8"}
ACT_COLOR, NORM_COLOR, OP_COLOR = "#f1f3f5", "#d3f9d8", "#e5dbff"


def weight_line(info: dict[str, Any] | None) -> str:
    """'FloatLinear fp32 · weight 576×1728 float32' — the module's kind and its main tensor."""
    if not info:
        return "?"
    tensors = info.get("tensors") or {}
    main = next((n for n in ("weight", "qweight", "packed") if n in tensors), next(iter(tensors), None))
    text = f"{info.get('kind', '?')} {info.get('format', '?')}"
    if main:
        t = tensors[main]
        text += f" · {main} {'×'.join(map(str, t['shape']))} {t['dtype']}"
        extra = [n for n in tensors if n != main]
        if extra:
            text += f" (+{', '.join(extra)})"
    return text


def _column(ax: Any, x: float, items: list[tuple[str, str, str]], top: float, width: float = 5.6) -> list[float]:
    """Boxes (title, detail, colour) stacked downwards from `top`, joined by arrows; returns their centre ys."""
    ys, y, prev_bottom = [], top, top
    for i, (title, detail, color) in enumerate(items):
        h = 0.62 if detail else 0.4
        ax.add_patch(
            FancyBboxPatch(
                (x - width / 2, y - h),
                width,
                h,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor=color,
                edgecolor="#343a40",
                linewidth=0.9,
            )
        )
        ax.text(x, y - 0.05, title, ha="center", va="top", fontsize=8, weight="bold")
        if detail:
            ax.text(x, y - 0.3, detail, ha="center", va="top", fontsize=6.6, color="#212529")
        ys.append(y - h / 2)
        if i:
            ax.add_patch(
                FancyArrowPatch(
                    (x, prev_bottom - 0.01),
                    (x, y + 0.01),
                    arrowstyle="-|>",
                    mutation_scale=9,
                    color="#495057",
                    linewidth=0.9,
                )
            )
        prev_bottom = y - h
        y -= h + 0.22
    return ys


def _fmt(fmt: str) -> str:
    return KIND_COLORS.get(fmt, "#dee2e6")


def draw_model_graph(run: RunData, out_dir: Path) -> list[Figure]:
    m = run.model
    if not m:
        return [
            Figure(
                "model",
                "Model graph",
                None,
                notes=[
                    "model.json was not written by this run (load.to_device "
                    "did not run, or the observe wiring is not in place)"
                ],
            )
        ]
    dim, heads, kv, hd = m["dim"], m["n_heads"], m["n_kv_heads"], m["head_dim"]
    act = m["activation_dtype"]
    layer, stack = _layer_items(m), _stack_items(m)
    fig, ax = plt.subplots(figsize=(13, 9.5))
    top = len(layer) * 0.84
    _column(ax, 3.2, stack, top - 0.2)
    _column(ax, 10.2, layer, top + 0.4, width=6.6)
    ax.text(3.2, top + 0.55, "the stack", ha="center", fontsize=11, weight="bold")
    ax.text(10.2, top + 0.75, "one decoder layer (layer 0)", ha="center", fontsize=11, weight="bold")
    notes = [
        f"parameters {mib(m.get('parameter_bytes'))} on {m.get('device')}, activations {act}, "
        f"max_seq_len {m.get('max_seq_len')}",
        "all layers have the same module kinds"
        if m.get("layers_identical")
        else "layers differ in module kinds (see model.json)",
    ]
    ax.text(0.4, -0.9, "\n".join(notes), fontsize=8, color="#495057", va="top")
    ax.set_xlim(0, 13.8)
    ax.set_ylim(-1.6, top + 1.0)
    ax.axis("off")
    family = f" ({m['model_type']})" if m.get("model_type") else ""
    ax.set_title(
        f"Model as loaded{family}: {m['n_layers']} layers, dim {dim}, {heads} query / {kv} KV heads of {hd}",
        fontsize=12,
    )
    path = save(fig, out_dir / "model_graph.svg")
    return [
        Figure(
            "model",
            "Model graph",
            path,
            "Shapes and dtypes are read from the loaded modules (model.json), not from a hand-written table; "
            "B = batch, T = tokens in the pass. Colour = weight format.",
        )
    ]


def _module_line(m: dict[str, Any], name: str) -> tuple[str, str]:
    """A loaded module's line (kind, format, main tensor) and its weight format's colour."""
    info = m.get("modules", {}).get(name) or {}
    return weight_line(info), _fmt(info.get("format", ""))


def _arch(m: dict[str, Any]) -> dict[str, Any]:
    """The family's departures from Llama (model.json `architecture`; a run written before it: Llama's)."""
    return {"mlp": "SwiGLU", "layer_windows": [], **(m.get("architecture") or {})}


def _attention_items(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The attention's split/RoPE and attend boxes, saying what this family adds (q/k norms, windows, scale,
    soft-cap)."""
    heads, kv, hd = m["n_heads"], m["n_kv_heads"], m["head_dim"]
    arch = _arch(m)
    windows = [w for w in arch["layer_windows"] if w]
    sliding = [i for i, w in enumerate(arch["layer_windows"]) if w]
    how = ["causal"] + ([f"GQA {heads // kv}:1"] if heads != kv else [])
    if windows:
        every = len(sliding) == m["n_layers"]
        how.append(f"window {max(windows)}" + ("" if every else f" on {len(sliding)} of {m['n_layers']} layers"))
    scale = f"{arch['attn_scale']:.4g}" if arch.get("attn_scale") else f"1/√{hd}"
    scores = f"Q Kᵀ·{scale}"
    if arch.get("attn_softcap"):
        scores = f"{arch['attn_softcap']:g}·tanh({scores}/{arch['attn_softcap']:g})"
    split = "split, q/k RMSNorm, RoPE" if arch.get("qk_norm") else "split + RoPE"
    if arch.get("rope_local_theta") and windows:
        split += f" (sliding layers: base {arch['rope_local_theta']:g})"
    return [
        (split, f"Q [B, {heads}, T, {hd}] · K, V [B, {kv}, T, {hd}]", OP_COLOR),
        ("KV cache write", _cache_line(m), OP_COLOR),
        (f"attention ({', '.join(how)})", f"softmax({scores}) V → [B, T, {heads * hd}]", OP_COLOR),
    ]


def _layer_items(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    """One decoder layer's boxes (title, detail, colour), in forward order, read from layer 0's modules."""
    dim, inter, act = m["dim"], m["intermediate_size"], m["activation_dtype"]
    arch = _arch(m)

    def mod(name: str) -> tuple[str, str]:
        return _module_line(m, name)

    def norm(name: str) -> tuple[str, str, str]:
        return (f"RMSNorm ({name})", mod(f"layers.0.{name}")[0], NORM_COLOR)

    x_act = f"[B, T, {dim}] {act}"
    sandwich = bool(arch.get("sandwich_norms"))
    gate = "gelu_tanh(gate) · up" if arch["mlp"] == "GeGLU" else "silu(gate) · up"
    wqkv = "wqkv: fused Q/K/V projection" + (" + bias" if arch.get("qkv_bias") else "")
    return [
        ("x", x_act, ACT_COLOR),
        norm("attention_norm"),
        (wqkv, mod("layers.0.attention.wqkv")[0], mod("layers.0.attention.wqkv")[1]),
        *_attention_items(m),
        ("wo: output projection", mod("layers.0.attention.wo")[0], mod("layers.0.attention.wo")[1]),
        *([norm("post_attention_norm")] if sandwich else []),
        ("+ residual", x_act, ACT_COLOR),
        norm("ffn_norm"),
        (
            "w13: gate | up",
            mod("layers.0.feed_forward.w13")[0] + f" → [B, T, 2×{inter}]",
            mod("layers.0.feed_forward.w13")[1],
        ),
        (f"{arch['mlp']}: {gate}", f"[B, T, {inter}] {act}", OP_COLOR),
        ("w2: down projection", mod("layers.0.feed_forward.w2")[0], mod("layers.0.feed_forward.w2")[1]),
        *([norm("post_ffn_norm")] if sandwich else []),
        ("+ residual", x_act, ACT_COLOR),
    ]


def _stack_items(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The whole model's boxes: embedding, the layers as one box, final norm, head, logits."""
    vocab, act = m["vocab_size"], m["activation_dtype"]
    arch = _arch(m)

    def mod(name: str) -> tuple[str, str]:
        return _module_line(m, name)

    logits = f"[B, T, {vocab}] {act} (last position only in prefill)"
    if arch.get("final_softcap"):
        logits = f"{arch['final_softcap']:g}·tanh(x/{arch['final_softcap']:g}) · " + logits
    return [
        ("token ids", "[B, T] int64", ACT_COLOR),
        (
            "embedding" + (" × √dim" if arch.get("embed_scale") else ""),
            mod("tok_embeddings")[0],
            mod("tok_embeddings")[1],
        ),
        (
            f"{m['n_layers']} × decoder layer",
            f"attention + {arch['mlp']} MLP, each with RMSNorm and a residual  →",
            "#fff3bf",
        ),
        ("RMSNorm (norm)", mod("norm")[0], NORM_COLOR),
        (
            "head (output)" + (" — tied to the embedding" if m.get("tied_embeddings") else ""),
            mod("output")[0],
            mod("output")[1],
        ),
        ("logits", logits, ACT_COLOR),
    ]


def _cache_line(m: dict[str, Any]) -> str:
    cache = m.get("kv_cache")
    if not cache:
        return "no KV cache recorded"
    line = (
        f"[{', '.join(map(str, cache['shape']))}] {cache['dtype']} ({mib(cache.get('bytes'))}, {cache.get('policy')})"
    )
    shape = cache["shape"]
    rings = [n for n in sorted(set(cache.get("layer_tokens") or [])) if len(shape) == 5 and n < shape[3]]
    return line + (f"; sliding layers keep {', '.join(map(str, rings))} tokens" if rings else "")
