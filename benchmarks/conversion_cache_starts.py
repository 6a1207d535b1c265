"""A conversion made once: `llmplan serve`'s time to ready without the conversion cache (every start converts, as
before), on the first start with it (converts, writes the entry, maps it) and on later starts (maps the entry),
with the resident memory split into file-backed and anonymous, and two servers of one plan side by side.

    .venv/bin/python benchmarks/conversion_cache_starts.py PLAN[@MODEL_DIR]... [--runs 3] [--share] [--out PREFIX]

Each start is a fresh `serve` process with one slot of 2048 tokens: the time from its start to its first 200 from
/health, then one 8-token completion, then /proc/PID/smaps_rollup (file-backed: mapped files' pages, shared with
the page cache and other processes; anonymous: the process's own). The source files are in the page cache (a
discarded start first). The first start is measured once per plan: its entry is removed before (`llmplan models
rm`). `--share`: two servers of the same plan at once, each one's Shared_Clean pages (what the other maps too).
Writes PREFIX.md and PREFIX.json (default benchmarks/conversion-cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import yaml
from serve_ready import gib, smaps  # this folder's: the script runs from it

from llmplan.commands.bench.report import machine
from llmplan.commands.bench.serve_bench import free_port, running, serve_overrides
from llmplan.commands.bench.traffic import cpu_features

HERE = Path(__file__).resolve().parent
LLMPLAN = [sys.executable, "-m", "llmplan"]


def convert_id(plan: str) -> str:
    stages = yaml.safe_load(Path(plan).read_text())["stages"]
    return next(s["id"] for s in stages if s.get("uses") == "load.convert")


def serve_cmd(plan: str, model: str | None, port: int, extra: list[str]) -> list[str]:
    cmd = [*LLMPLAN, "serve", plan, "--port", str(port), "--slots", "1", "--quiet"]
    cmd += ["--model", model] if model else []
    for setting in serve_overrides(plan, extra, slots=1, context=2048, max_tokens=64):
        cmd += ["--set", setting]
    return cmd


def start_once(cmd: list[str], port: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        with running(cmd, "llmplan serve", url, Path(tmp) / "server.log") as proc:
            ready = time.perf_counter() - began
            complete(url)
            return {"ready_s": ready, **smaps(proc.pid)}


def complete(url: str) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    httpx.post(url + "/v1/completions", json=body, timeout=600, trust_env=False).raise_for_status()


def entries() -> list[dict[str, Any]]:
    listed = subprocess.run([*LLMPLAN, "models", "--json"], capture_output=True, text=True, check=True).stdout
    return [row for row in map(json.loads, listed.splitlines()) if row.get("kind") == "conversion"]


def measure(item: str, runs: int, share: bool) -> dict[str, Any]:
    plan, _, model = item.partition("@")
    port, off = free_port(), [f"{convert_id(plan)}.cache=false"]
    start_once(serve_cmd(plan, model or None, port, off), port)  # the sources into the page cache
    before = {row["name"] for row in entries()}
    every = [start_once(serve_cmd(plan, model or None, port, off), port) for _ in range(runs)]
    mine = [row for row in entries() if row["name"] not in before]
    assert not mine, "cache=false wrote an entry"
    first = first_start(plan, model, port)
    later = [start_once(serve_cmd(plan, model or None, port, []), port) for _ in range(runs)]
    row = {"item": item, "every_start": every, "first": first, "later": later}
    row |= {"entry": first.pop("entry"), "median": {k: _median(row[k]) for k in ("every_start", "later")}}
    if share:
        row["two_servers"] = two_servers(plan, model)
    print(f"{item}: every start {row['median']['every_start']['ready_s']:.2f} s, first {first['ready_s']:.2f} s, "
          f"later {row['median']['later']['ready_s']:.2f} s", file=sys.stderr)  # fmt: skip
    return row


def first_start(plan: str, model: str, port: int) -> dict[str, Any]:
    """The plan's first start with the cache: its entry (same model and dtype) removed first, so this start
    converts and writes it."""
    name, dtype = model_and_dtype(plan, model)
    for row in entries():
        if (row["model"], row["dtype"]) == (name, dtype):
            subprocess.run([*LLMPLAN, "models", "rm", row["name"]], check=True, capture_output=True)
    result = start_once(serve_cmd(plan, model or None, port, []), port)
    (entry,) = [row for row in entries() if (row["model"], row["dtype"]) == (name, dtype)]
    return result | {"entry": entry}


def model_and_dtype(plan: str, model: str) -> tuple[str, str]:
    """The model's name as llmplan says it (a GGUF's stem, a folder's name) and the plan's dtype."""
    stages = yaml.safe_load(Path(plan).read_text())["stages"]
    dtype = next(s for s in stages if s.get("uses") == "load.convert").get("with", {}).get("dtype", "fp32")
    if model:
        return Path(model).stem if model.endswith(".gguf") else Path(model).name, dtype
    source = next(s for s in stages if s.get("uses") == "model.source")["with"]
    named = source.get("pieces", {}).get("name") or source.get("file") or source.get("path")
    return Path(named).stem if str(named).endswith(".gguf") else Path(named).name, dtype


def two_servers(plan: str, model: str) -> list[dict[str, int]]:
    ports = [free_port(), free_port()]
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, port in enumerate(ports):
            url = f"http://127.0.0.1:{port}"
            cmd = serve_cmd(plan, model or None, port, [])
            procs.append(stack.enter_context(running(cmd, "llmplan serve", url, Path(tmp) / f"s{i}.log")))
            complete(url)
        return [smaps(proc.pid) for proc in procs]


def _median(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# A conversion made once: serve's time to ready without and with the conversion cache",
        "",
        f"Machine: {meta['cpu']}, {meta['cores']} cores; features {' '.join(meta['features'])}. Load average "
        f"{meta['load_before']} at start, {meta['load_after']} at the end. One slot of 2048 tokens; sources in the "
        f"page cache; {meta['runs']} starts each (median); memory after one 8-token completion (smaps_rollup).",
        "",
        "| plan | entry | every start (no cache) | first start (converts, writes) | later start (maps) | speed-up "
        "| RSS later | file-backed | anonymous | RSS every start |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        every, later, first = row["median"]["every_start"], row["median"]["later"], row["first"]
        lines.append(
            f"| {row['item']} | {gib(row['entry']['bytes'])} | {every['ready_s']:.2f} s | {first['ready_s']:.2f} s | "
            f"{later['ready_s']:.2f} s | {first['ready_s'] / later['ready_s']:.1f}x first, "
            f"{every['ready_s'] / later['ready_s']:.1f}x every | {gib(later['rss'])} | {gib(later['file'])} | "
            f"{gib(later['anon'])} | {gib(every['rss'])} |"
        )
    for row in rows:
        if "two_servers" in row:
            one, two = row["two_servers"]
            lines += [
                "",
                f"Two servers of {row['item']} at once: entry {gib(row['entry']['bytes'])}; file-backed "
                f"{gib(one['file'])} / {gib(two['file'])}, of which shared with the other {gib(one['shared'])} / "
                f"{gib(two['shared'])}; anonymous {gib(one['anon'])} / {gib(two['anon'])}.",
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="+", help="PLAN or PLAN@MODEL_DIR (serve --model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--share", action="store_true", help="also two servers of each plan at once")
    parser.add_argument("--out", default=str(HERE / "conversion-cache"))
    args = parser.parse_args(argv)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meta = machine() | {"features": cpu_features(), "runs": args.runs, "load_before": load}
    rows = [measure(item, args.runs, args.share) for item in args.items]
    meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
