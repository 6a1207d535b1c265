"""Bench results as JSON, a Markdown table (naming the machine) or CSV rows."""

from __future__ import annotations

import csv
import io
import json
import os
import platform
from typing import Any

from llmplan.engine.memory import mib
from llmplan.llm.formats.gguf import footprint_line

FIGURES = ("prefill_tok_s", "decode_tok_s", "ttft_s")
"""Per-run figures, summarized as median [min-max]; higher is better except ttft_s."""


def machine() -> dict[str, Any]:
    """CPU model, cores, threads, library versions and the load average (the CPU may be shared)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _fmt(summary: dict[str, Any] | None, scale: float = 1.0, digits: int = 1) -> str:
    if not summary or summary.get("median") is None:
        return "-"
    med, lo, hi = (summary[k] * scale for k in ("median", "min", "max"))
    return f"{med:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.0f}"


def to_markdown(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        f"# llmplan bench: {result['plan']}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch {m['torch']}"
        + (f", transformers {m['transformers']}" if m.get("transformers") else "")
        + f"; load average {_loadavg(m.get('loadavg'))} at start, {_loadavg(m.get('loadavg_end'))} at the end.",
        f"Prompt {s['prompt_tokens']} tokens (random ids), {s['gen_tokens']} generated (greedy, EOS ignored), "
        f"{s['runs']} runs after a warm-up; median [min–max]. Decode tok/s is aggregate over the batch. "
        "load→1st token: warm load + the first prefill after it (lazy kernel setup included).",
        "",
        "| engine | dtype | batch | prefill tok/s | decode tok/s | TTFT ms | load warm s | load cold s "
        "| load→1st token s | peak RSS MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["results"]:
        load = row.get("load", {})
        cold = load.get("cold_s")
        lines.append(
            f"| {row['engine']} | {row['dtype']} | {row['batch']} | {_fmt(row['prefill_tok_s'], digits=0)} "
            f"| {_fmt(row['decode_tok_s'])} | {_fmt(row['ttft_s'], 1000, 0)} "
            f"| {_num(load.get('warm_s'), 2)} | {_num(cold, 2) if cold is not None else 'n/a'} "
            f"| {_num(row.get('load_to_first_token_s'), 2)} | {_mib(row.get('peak_rss_bytes'))} |"
        )
    if result.get("ratios"):
        lines += ["", "Ratios llmplan / transformers (medians; > 1 is llmplan faster, for TTFT < 1 is):", ""]
        lines += ["| dtype | batch | prefill | decode | TTFT |", "|---|---:|---:|---:|---:|"]
        for r in result["ratios"]:
            lines.append(
                f"| {r['dtype']} | {r['batch']} | {_num(r.get('prefill_tok_s'), 2)} "
                f"| {_num(r.get('decode_tok_s'), 2)} | {_num(r.get('ttft_s'), 2)} |"
            )
    mem = [r for r in result["results"] if r["engine"] == "llmplan" and r.get("memory")]
    if mem:
        lines += ["", "Memory (llmplan, MiB): weights + KV cache + RSS before loading → peak RSS of load and runs:", ""]
        seen: set[str] = set()
        for row in mem:
            if row["dtype"] in seen:
                continue
            seen.add(row["dtype"])
            mm = row["memory"]
            lines.append(
                f"- {row['dtype']}: {_mib(mm['weights_bytes'])} + {_mib(mm['kv_cache_bytes'])} + "
                f"{_mib(mm['rss_before_bytes'])} → {_mib(mm['peak_rss_bytes'])} "
                f"(×{mm['peak_over_budget']:.2f} of the sum)"
            )
            if mm.get("gguf"):
                lines.append(f"  - {footprint_line(mm['gguf'], mib)}")
    for note in result.get("notes", []):
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def _loadavg(values: list[float] | None) -> str:
    return "-" if not values else "/".join(f"{v:.1f}" for v in values)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def to_csv(result: dict[str, Any]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["engine", "dtype", "batch", "figure", "median", "min", "max", "n"])
    for row in result["results"]:
        for figure in FIGURES:
            s = row[figure]
            writer.writerow(
                [row["engine"], row["dtype"], row["batch"], figure, s["median"], s["min"], s["max"], s["n"]]
            )
        load = row.get("load", {})
        for key in ("warm_s", "cold_s"):
            if load.get(key) is not None:
                writer.writerow([row["engine"], row["dtype"], row["batch"], f"load_{key}", load[key], "", "", 1])
        if row.get("peak_rss_bytes") is not None:
            writer.writerow(
                [row["engine"], row["dtype"], row["batch"], "peak_rss_bytes", row["peak_rss_bytes"], "", "", 1]
            )
    return out.getvalue()


def render(result: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(result, indent=2, default=str) + "\n"
    if fmt == "csv":
        return to_csv(result)
    return to_markdown(result)
