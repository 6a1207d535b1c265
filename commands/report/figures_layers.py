"""Per-layer timings (layer_timings.json): attention and MLP per layer, prefill and decode apart."""

from __future__ import annotations

from pathlib import Path

from .common import Figure, plt, save
from .run_data import RunData


def draw_layer_timings(run: RunData, out_dir: Path) -> list[Figure]:
    data = run.layer_timings
    if not data:
        why = (
            "not asked for (plan `observe: {layer_timings: true}`)"
            if not run.observe.get("layer_timings")
            else "asked for, but layer_timings.json was not written (observe wiring missing?)"
        )
        return [Figure("layers", "Per-layer timings", None, notes=[why])]
    n = data["n_layers"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    summary = []
    for ax, phase in zip(axes, ("prefill", "decode"), strict=True):
        bucket = data.get(phase) or {}
        passes = bucket.get("passes") or 0
        if not passes:
            ax.text(0.5, 0.5, f"no {phase} passes", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(phase)
            continue
        attn = [s / passes * 1000 for s in bucket["attention_s"]]
        mlp = [s / passes * 1000 for s in bucket["mlp_s"]]
        layers = list(range(n))
        ax.bar(layers, attn, color="#4dabf7", label="attention (QKV, RoPE, cache, SDPA, O)")
        ax.bar(layers, mlp, bottom=attn, color="#ff922b", label="MLP (SwiGLU)")
        in_layers = (sum(bucket["attention_s"]) + sum(bucket["mlp_s"])) / passes * 1000
        forward = bucket.get("forward_s", 0.0) / passes * 1000
        ax.set_title(
            f"{phase}: {passes} pass(es), {bucket.get('tokens', 0) // passes} tokens/pass\n"
            f"forward {forward:.2f} ms/pass, of which layers {in_layers:.2f} ms",
            fontsize=9,
        )
        ax.set_xlabel("layer")
        ax.set_ylabel("ms per forward pass")
        ax.set_xticks(layers if n <= 32 else layers[:: max(1, n // 16)])
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
        summary.append(
            f"{phase}: attention {sum(attn):.2f} ms, MLP {sum(mlp):.2f} ms per pass, "
            f"other (embedding, norm, head) {max(forward - in_layers, 0):.2f} ms"
        )
    fig.suptitle("Time per layer, split into attention and MLP (forward hooks)", fontsize=11)
    path = save(fig, out_dir / "layer_timings.png")
    sync = "device synchronized at each hook" if data.get("synchronized") else "CPU wall time"
    return [Figure("layers", "Per-layer timings", path, f"Means per forward pass; {sync}.", summary)]
