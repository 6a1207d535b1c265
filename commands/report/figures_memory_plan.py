"""Memory predicted beside measured: what `validate --deep` predicts for each region and for the peak while
converting, next to what the run allocated and the RSS it reached (issue 27's "a memory plan that holds")."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from llmplan.llm.formats.gguf import footprint_line, recorded_footprint

from .common import Figure, mib
from .figures_memory import stage_spans
from .run_data import RunData

LOADERS = ("load.shard_stream", "load.convert", "load.to_device")
# region, predicted, measured, and the difference where it is not predicted against measured
Row = tuple[str, int | None, int | None] | tuple[str, int | None, int | None, str]


def draw_memory_plan(run: RunData, out_dir: Path) -> list[Figure]:
    convert = run.metrics_of("load.convert") or {}
    place = run.metrics_of("load.to_device") or {}
    regions = place.get("regions") or {}
    if not regions:
        return [Figure("memory_plan", "Memory: predicted and measured", None, notes=["no load.to_device stage ran"])]
    predicted = dict(place.get("predicted_regions") or {})
    if convert.get("predicted_bytes") is not None:
        predicted["weights"] = convert["predicted_bytes"]
    rows: list[Row] = [(name.replace("_", " "), predicted.get(name), regions.get(name)) for name in regions]
    rows.append(("steady state (sum)", _sum(predicted, regions), sum(regions.values())))
    notes = [
        "measured regions: the bytes load.to_device holds (tensors counted); peaks: host RSS above the RSS "
        "before the first loading stage, from memory.json's samples"
    ]
    rss = _rss_in(run, ("load.convert",))
    if rss is not None:
        rows.append(("peak while converting", convert.get("predicted_peak_bytes"), rss))
    load = _rss_in(run, LOADERS)
    if load is not None:
        steady = _sum(predicted, regions)
        peak = None if steady is None else max(steady, convert.get("predicted_peak_bytes") or 0)
        rows.append(("peak of the load", peak, load))
    if rss is not None:
        every = (run.memory or {}).get("interval_ms")
        notes.append(
            f"RSS sampled every {every} ms (and at stage edges): a shorter peak can be missed, which "
            "`llmplan bench` (every 2 ms) does not"
        )
    rows += _backing_rows(convert, place, run.metrics_of("output.release") or {})
    footprint = recorded_footprint(place.get("resident_weights"))
    if footprint:  # a GGUF import: the weights against the file's own size, and why they differ
        rows.append((f"the GGUF file ({footprint['gguf_type']})", None, footprint["gguf_bytes"],
                     f"weights {footprint['ratio']:.2f}x"))  # fmt: skip
        notes.append(footprint_line(footprint, mib))
    if (place.get("device") or "cpu") != "cpu":
        notes.append("the model is on a GPU: the regions are device memory, the RSS peaks host memory")
    caption = "What `llmplan validate --deep` predicts for this plan, beside what this run held."
    return [Figure("memory_plan", "Memory: predicted and measured", None, caption, notes, html=_table(rows))]


def _backing_rows(convert: dict[str, Any], place: dict[str, Any], release: dict[str, Any]) -> list[Row]:
    """Mapped weights (a cache entry's, a GGUF's, a source shard's pages: shared, evictable) apart from the
    process's own memory: predicted by load.convert, measured by where each of the model's tensors lies."""
    rows: list[Row] = []
    mapped, backing = convert.get("file_backed_bytes"), place.get("weights_backing") or {}
    if mapped is not None or backing:
        rows.append(("weights, file-backed (mapped)", mapped, backing.get("file_backed")))
        total = (place.get("regions") or {}).get("weights")
        predicted = None if mapped is None or total is None else total - mapped
        rows.append(("weights, anonymous (own copies)", predicted, backing.get("anonymous")))
    touched = release.get("mapped_weights_before")
    if mapped and touched is not None:
        rows.append(("mapped weights resident at the end", None, touched, f"{touched / mapped:.0%} of them touched"))
    if release.get("anonymous_before") is not None:
        rows.append(("process RSS, file-backed", None, release.get("file_backed_before"), "libraries + mappings"))
        rows.append(("process RSS, anonymous", None, release.get("anonymous_before"), "its own memory"))
    return rows


def _sum(predicted: dict[str, Any], regions: dict[str, Any]) -> int | None:
    if any(predicted.get(name) is None for name in regions):
        return None
    return sum(int(predicted[name]) for name in regions)


def _rss_in(run: RunData, uses: tuple[str, ...]) -> int | None:
    """The highest RSS sampled while these stages ran, above the RSS when the first loading stage began."""
    memory = run.memory or {}
    samples = memory.get("samples") or []
    spans = [s for s in stage_spans(memory.get("marks") or []) if (run.record(s[0]) or {}).get("uses") in uses]
    starts = [s for s in stage_spans(memory.get("marks") or []) if (run.record(s[0]) or {}).get("uses") in LOADERS]
    if not samples or not spans or not starts:
        return None
    first = min(a for _, a, _ in starts)
    before = [s["rss"] for s in samples if s["t"] <= first]
    inside = [s["rss"] for s in samples if any(a <= s["t"] <= b for _, a, b in spans)]
    if not before or not inside:
        return None
    return max(inside) - before[-1]


def _table(rows: list[Row]) -> str:
    head = "<tr><th>region</th><th>predicted</th><th>measured</th><th>difference</th></tr>"
    cells = []
    for name, want, got, *said in rows:
        diff = said[0] if said else "-" if want is None or not got else f"{(want - got) / got:+.1%}"
        cells.append(f"<tr><th>{escape(name)}</th><td>{mib(want)}</td><td>{mib(got)}</td><td>{escape(diff)}</td></tr>")
    return f"<table>{head}{''.join(cells)}</table>"
