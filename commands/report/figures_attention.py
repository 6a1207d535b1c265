"""Attention heatmaps (attention.json): weights over the prompt's tokens for the chosen layers and heads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.colors import LogNorm

from .common import Figure, plt, save
from .fonts import pick_font
from .run_data import RunData
from .tokens import token_labels

# How the weights were taken (attention.json's "taken"): the generation's figures are not of this pass.
TAKEN = (
    ", after the generation in a separate pass over the prompt and the answer on the torch modules, outside "
    "the timed generation (which ran on the path an unobserved run takes)"
)
FLOOR = 1e-4  # weights below this share the darkest colour (and masked, future positions are 0)


def labels_of(data: dict[str, Any]) -> list[str]:
    return token_labels(data.get("token_ids") or [], data.get("pieces"), data.get("tokens"))


def draw_attention(run: RunData, out_dir: Path) -> list[Figure]:
    data = run.attention
    if not data:
        asked = run.observe.get("attention")
        why = (
            "asked for, but attention.json was not written (observe wiring missing?)"
            if asked
            else "not asked for (plan `observe: {attention: {layers: [...], heads: [...]}}`)"
        )
        return [Figure("attention", "Attention heatmaps", None, notes=[why])]
    maps = data.get("maps") or []
    if not maps:
        why = "no request to recompute it over (none generated, or its prompt was cut to fit, or a served plan)"
        return [Figure("attention", "Attention heatmaps", None, notes=[why])]
    labels = labels_of(data)
    font = pick_font(labels)
    shown = labels  # text, never escaped: a character no font here has is the browser's to draw
    props = font.properties()
    layers, heads = sorted({m["layer"] for m in maps}), sorted({m["head"] for m in maps})
    n = len(labels) or len(maps[0]["weights"])
    cell = min(0.16 * n + 1.6, 9.0)
    fig, axes = plt.subplots(
        len(layers),
        len(heads),
        figsize=(cell * len(heads) + 2, cell * len(layers) + 1),
        squeeze=False,
        layout="constrained",
    )
    image = None
    for m in maps:
        image = _heatmap(axes[layers.index(m["layer"])][heads.index(m["head"])], m, shown, n, props)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label=f"attention weight (log scale; < {FLOOR:g} darkest)")
    fig.suptitle(
        "Attention over the prompt (first request, first prefill pass; each row sums to 1; log colour scale)",
        fontsize=11,
    )
    path = save(fig, out_dir / "attention.svg")
    notes = [font.note] if font.note else []
    ignored = data.get("ignored") or {}
    if ignored.get("layers") or ignored.get("heads"):  # runs from before the plan was checked against the model
        notes.append(f"ignored out-of-range indexes: layers {ignored.get('layers')}, heads {ignored.get('heads')}")
    if not data.get("taken"):  # runs from before the weights were taken after the run
        notes.append("capturing attention hooked the layers: this run decoded on the torch modules, not the fused step")
    caption = (
        f"{n} prompt tokens (max_tokens {data.get('max_tokens')}); weights recomputed from each layer's own "
        f"inputs as softmax(QKᵀ/√d) with the causal mask{TAKEN if data.get('taken') else ''}. A character split over "
        "several tokens shows on the token that completes it, … on those that begin it; ␣ = space."
    )
    return [Figure("attention", "Attention heatmaps", path, caption, notes), *draw_decode_attention(data, out_dir)]


def _heatmap(ax: Any, m: dict[str, Any], shown: list[str], n: int, props: Any) -> Any:
    """One head's prompt attention on `ax`, token labels on both axes where they fit; returns the image."""
    # Log scale: a row's weights span orders of magnitude (a few large, most tiny); linear left them black.
    weights = [[w if w > FLOOR else FLOOR for w in row] for row in m["weights"]]
    image = ax.imshow(weights, cmap="magma", norm=LogNorm(vmin=FLOOR, vmax=1), interpolation="nearest")
    ax.set_title(f"layer {m['layer']}, head {m['head']}", fontsize=9)
    if shown and n <= 96:
        size = max(4.0, min(8.0, 420 / n))
        ax.set_xticks(range(n), shown, rotation=90, fontsize=size, fontproperties=props)
        ax.set_yticks(range(n), shown, fontsize=size, fontproperties=props)
        if props is not None:
            for tick in (*ax.get_xticklabels(), *ax.get_yticklabels()):
                tick.set_fontsize(size)
    ax.set_xlabel("key (attended-to token)", fontsize=8)
    ax.set_ylabel("query token", fontsize=8)
    return image


def draw_decode_attention(data: dict[str, Any], out_dir: Path) -> list[Figure]:
    """Each decode step's attention over the prompt and the tokens generated before it (first request)."""
    decode = data.get("decode") or {}
    maps = decode.get("maps") or []
    if not maps:
        return []
    columns = labels_of(decode["columns"])
    rows = labels_of(decode["rows"])
    font = pick_font(columns + rows)
    props = font.properties()
    prompt = decode["prompt_tokens"]
    layers, heads = sorted({m["layer"] for m in maps}), sorted({m["head"] for m in maps})
    n_rows, n_cols = len(maps[0]["weights"]), len(maps[0]["weights"][0])
    width = min(0.13 * n_cols + 2.0, 12.0)
    height = min(0.16 * n_rows + 1.4, 8.0)
    fig, axes = plt.subplots(
        len(layers) * len(heads),
        1,
        figsize=(width + 2, height * len(layers) * len(heads) + 1),
        squeeze=False,
        layout="constrained",
    )
    image = None
    for i, m in enumerate(maps):
        ax = axes[i][0]
        weights = [[w if w > FLOOR else FLOOR for w in row] for row in m["weights"]]
        image = ax.imshow(
            weights, cmap="magma", norm=LogNorm(vmin=FLOOR, vmax=1), interpolation="nearest", aspect="auto"
        )
        ax.axvline(prompt - 0.5, color="#4dabf7", linewidth=1.5)
        ax.set_title(f"layer {m['layer']}, head {m['head']} — left of the blue line: the prompt", fontsize=9)
        if n_rows <= 64:
            ax.set_yticks(range(n_rows), rows[:n_rows], fontsize=7, fontproperties=props)
        if n_cols <= 96:
            size = max(5.0, min(7.0, 500 / n_cols))
            ax.set_xticks(
                range(n_cols),
                columns[:n_cols],
                rotation=90,
                fontsize=size,
                fontproperties=props,
            )
        ax.set_xlabel("key (attended-to token: prompt, then generated)", fontsize=8)
        ax.set_ylabel("decode step (token it picked)", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label=f"attention weight (log scale; < {FLOOR:g} darkest)")
    fig.suptitle("Attention of each decode step over the prompt and the tokens before it (first request)", fontsize=11)
    path = save(fig, out_dir / "attention_decode.svg")
    caption = (
        f"{n_rows} decode steps over {prompt} prompt tokens. Recomputed after the run in one causal pass over "
        "the prompt and the generated tokens: each row sees exactly the keys its decode step saw."
    )
    return [Figure("attention_decode", "Attention of the decode steps", path, caption)]
