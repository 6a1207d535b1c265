"""Memory over time: host RSS and device memory (memory.json), stage spans, the place stage's regions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import Figure, mib, plt, save
from .run_data import RunData

MB = 1 << 20
REGION_COLORS = {"weights": "#4dabf7", "kv_cache": "#ff922b", "work_buffers": "#82c91e"}


def stage_spans(marks: list[dict]) -> list[tuple[str, float, float]]:
    """(stage, start, end) from the runner's start/end marks, in start order."""
    starts: dict[str, float] = {}
    spans = []
    for mark in marks:
        if mark.get("edge") == "start":
            starts[mark["stage"]] = mark["t"]
        elif mark.get("edge") == "end" and mark["stage"] in starts:
            spans.append((mark["stage"], starts.pop(mark["stage"]), mark["t"]))
    return sorted(spans, key=lambda s: s[1])


def draw_memory(run: RunData, out_dir: Path) -> list[Figure]:
    memory = run.memory
    samples = (memory or {}).get("samples") or []
    if not samples:
        return [
            Figure(
                "memory",
                "Memory over time",
                None,
                notes=["memory.json has no samples (observe.memory_interval_ms = 0?)"],
            )
        ]
    t = [s["t"] for s in samples]
    rss = [s["rss"] / MB for s in samples]
    device = [s["device"] / MB if s.get("device") is not None else None for s in samples]
    has_device = any(d is not None for d in device)
    spans = stage_spans(memory.get("marks") or [])
    fig, ax = plt.subplots(figsize=(12, 5.2))
    top = max(rss) * 1.18
    unlabelled = _stage_bands(ax, spans, t, top)
    ax.plot(t, rss, color="#1c7ed6", linewidth=1.6, label="host RSS", zorder=3)
    file_backed = [s.get("file") for s in samples]
    if all(f is not None for f in file_backed):  # mapped files' pages: shared, evictable; the rest is anonymous
        label = "of which file-backed (mapped weights, libraries)"
        ax.fill_between(t, 0, [f / MB for f in file_backed], color="#74c0fc", alpha=0.35, label=label, zorder=2)
    if has_device:
        ax.plot(
            t,
            [d if d is not None else float("nan") for d in device],
            color="#e8590c",
            linewidth=1.6,
            label="device allocated",
            zorder=3,
        )
    notes: list[str] = []
    level = _region_bars(ax, run, spans, samples, has_device, notes)
    if level is not None:
        top = max(top, level * 1.1)
    _release_arrow(ax, run, spans, t, notes)
    if unlabelled:
        notes.append(f"stages too short to label in the chart: {', '.join(unlabelled)}")
    ax.set_ylim(0, top)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("MiB")
    ax.set_title(f"Memory over time — peak RSS {mib((run.metrics.get('run') or {}).get('peak_rss_bytes'))}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)
    path = save(fig, out_dir / "memory.svg")
    caption = f"Samples every {memory.get('interval_ms')} ms plus one at each stage boundary; grey bands are stages."
    return [Figure("memory", "Memory over time", path, caption, notes)]


def _stage_bands(ax: Any, spans: list[tuple[str, float, float]], t: list[float], top: float) -> list[str]:
    """A grey band per stage, named where it is wide enough; returns the stages left unnamed."""
    # A label only where the band is wide enough for it: short stages side by side made an unreadable clump;
    # they are named in a note instead.
    span_all = max(t[-1] - t[0], 1e-9)
    unlabelled = []
    last_label = float("-inf")
    for i, (stage, a, b) in enumerate(spans):
        ax.axvspan(a, b, color="#e9ecef" if i % 2 else "#f8f9fa", zorder=0)
        ax.axvline(a, color="#ced4da", linewidth=0.6, zorder=1)
        middle = (a + b) / 2
        if b - a < span_all * 0.018 or middle - last_label < span_all * 0.018:
            unlabelled.append(stage)
            continue
        last_label = middle
        ax.text(
            middle, top * 0.995, stage, rotation=90, ha="center", va="top", fontsize=8, color="#495057", clip_on=True
        )
    return unlabelled


def _region_bars(
    ax: Any,
    run: RunData,
    spans: list[tuple[str, float, float]],
    samples: list[dict[str, Any]],
    has_device: bool,
    notes: list[str],
) -> float | None:
    """The place stage's regions as a stacked bar right of the curves, with a dashed line at each level;
    returns the top level (None when the run has no regions or no loading stage)."""
    t = [s["t"] for s in samples]
    place = run.metrics_of("load.to_device")
    regions = (place or {}).get("regions") or {}
    on_device = (place or {}).get("device", "cpu") != "cpu" and has_device
    # Weights land in host memory from the first loading stage on (device memory: from place).
    loaders = ("load.to_device",) if on_device else ("load.shard_stream", "load.convert", "load.to_device")
    load_span = next((s for s in spans if (run.record(s[0]) or {}).get("uses") in loaders), None)
    if not regions or load_span is None:
        return None
    # The regions stacked on the memory in use before the weights were loaded, as reference lines.
    before = min(
        (s for s in samples if s["t"] <= load_span[1]),
        key=lambda s: abs(s["t"] - load_span[1]),
        default=samples[0],
    )
    base = ((before.get("device") or 0) if on_device else before["rss"]) / MB
    level = base
    x_bar = t[-1] + (t[-1] - t[0]) * 0.03
    width = (t[-1] - t[0]) * 0.025
    for name in ("weights", "kv_cache", "work_buffers"):
        size = (regions.get(name) or 0) / MB
        ax.bar(
            x_bar,
            size,
            width=width,
            bottom=level,
            color=REGION_COLORS[name],
            align="edge",
            zorder=3,
            label=f"{name.replace('_', ' ')} {mib(regions.get(name))}",
        )
        level += size
        ax.axhline(level, color=REGION_COLORS[name], linestyle="--", linewidth=0.9, zorder=2)
    notes.append(
        f"regions from the place stage, stacked on the {'device' if on_device else 'host'} memory "
        f"before stage {load_span[0]!r} ({base:.0f} MiB); dashed lines mark each level"
    )
    return level


def _release_arrow(
    ax: Any, run: RunData, spans: list[tuple[str, float, float]], t: list[float], notes: list[str]
) -> None:
    """An arrow at the output.release stage showing what it freed, or a note that the plan has none."""
    release = run.metrics_of("output.release")
    release_span = next(
        (s for s in spans if run.record(s[0]) and run.record(s[0]).get("uses") == "output.release"), None
    )
    if release and release_span is not None:
        _, a, b = release_span
        ax.annotate(
            f"release: −{mib(release.get('freed_bytes'))}",
            xy=(b, release["rss_after"] / MB),
            xytext=(a - (t[-1] - t[0]) * 0.18, release["rss_before"] / MB * 1.04),
            fontsize=8,
            arrowprops={"arrowstyle": "-|>", "color": "#c92a2a"},
            color="#c92a2a",
        )
    else:
        notes.append("no output.release stage in this plan: memory is returned when the process exits")
