"""Time to ready and resident memory of `llmplan serve` and llama.cpp's `llama-server` on the same GGUF file.

    .venv/bin/python benchmarks/serve_ready.py PLAN_OR_GGUF... [--runs 3] [--context 4096] [--out PREFIX]

Each argument is a plan (its model's GGUF is the one llama-server gets) or a .gguf file (llmplan serves it with
`--model`, the default plan's stages, the file's blocks as stored). Both servers get one slot of `--context`
tokens and 2 threads. After a discarded start of each (the file in the page cache: a warm start, as a second
`serve` of the day is), the two start in turn `--runs` times: the time from the process's start to its first
200 from /health, then one 8-token completion, then its memory from /proc/PID/smaps_rollup: resident bytes, of
which file-backed (the mapped GGUF's pages: shared with the page cache and other processes, given back under
pressure) and anonymous (the process's own copies). Writes PREFIX.md and PREFIX.json (default
benchmarks/serve-ready).
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
from pathlib import Path
from typing import Any

import httpx

from llmplan.commands.bench.report import machine
from llmplan.commands.bench.serve_bench import free_port, running, serve_overrides
from llmplan.commands.bench.traffic import cpu_features

HERE = Path(__file__).resolve().parent
DEFAULT_PLAN = HERE.parent / "plans" / "llama-stored.yaml"  # what `--model FILE.gguf` runs with no plan


def tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def smaps(pid: int) -> dict[str, int]:
    """Resident bytes of a process: total, anonymous, file-backed (the rest: mapped files' pages), and the clean
    pages another process maps too (Shared_Clean)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    rss, anon = fields["Rss"], fields.get("Anonymous", 0)
    return {"rss": rss, "anon": anon, "file": rss - anon, "shared": fields.get("Shared_Clean", 0)}


def commands(item: str, gguf: Path, port: int, context: int) -> dict[str, list[str]]:
    plan = item if not item.endswith(".gguf") else str(DEFAULT_PLAN)
    ours = [sys.executable, "-m", "llmplan", "serve", plan, "--port", str(port), "--slots", "1", "--quiet"]
    if item.endswith(".gguf"):
        ours += ["--model", str(gguf)]
    for setting in serve_overrides(plan, [], slots=1, context=context, max_tokens=64):
        ours += ["--set", setting]
    server = os.environ.get("LLAMA_SERVER") or subprocess.run(
        [str(HERE / "build_llama_server.sh")], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip().splitlines()[-1]
    theirs = [server, "-m", str(gguf), "--port", str(port), "-t", "2", "-c", str(context), "--parallel", "1"]
    return {"llmplan": ours, "llama-server": theirs}


def start_once(cmd: list[str], port: int, what: str) -> dict[str, float]:
    """One start: seconds to ready, then one short completion, then the process's memory; stopped after."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with running(cmd, what, url, Path(tmp) / "server.log") as proc:
            ready = time.perf_counter() - start
            body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
            httpx.post(url + "/v1/completions", json=body, timeout=600, trust_env=False).raise_for_status()
            return {"ready_s": ready, **smaps(proc.pid)}


def measure(item: str, gguf: Path, runs: int, context: int) -> dict[str, Any]:
    port = free_port()
    cmds = commands(item, gguf, port, context)
    for name, cmd in cmds.items():
        start_once(cmd, port, name)  # the file into the page cache: warm starts from here on
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in cmds}
    for _ in range(runs):
        for name, cmd in cmds.items():
            samples[name].append(start_once(cmd, port, name))
            print(f"serve_ready: {gguf.name} {name} {samples[name][-1]['ready_s']:.2f} s", file=sys.stderr)
    medians = {name: {k: statistics.median(s[k] for s in runs_) for k in runs_[0]} for name, runs_ in samples.items()}
    return {"item": item, "gguf": str(gguf), "file_bytes": gguf.stat().st_size, "tensor_bytes": tensor_bytes(gguf),
            "samples": samples, "median": medians}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Serve: time to ready and resident memory, llmplan against llama-server on the same GGUF",
        "",
        f"Machine: {meta['cpu']}, {meta['cores']} cores; features {' '.join(meta['features'])}. "
        f"Load average {meta['load_before']} at start, {meta['load_after']} at the end.",
        f"One slot of {meta['context']} tokens and 2 threads each; warm page cache (a discarded start of each "
        f"first); {meta['runs']} alternating starts, median. Memory after ready and one 8-token completion, from "
        "/proc/PID/smaps_rollup (file-backed: the mapped file's pages; anonymous: the process's own).",
        "",
        "| model | file | tensors | server | ready s | ratio | RSS | file-backed | anonymous | RSS / tensors |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        base = row["median"]["llama-server"]["ready_s"]
        for name, m in row["median"].items():
            lines.append(
                f"| {Path(row['gguf']).name} | {gib(row['file_bytes'])} | {gib(row['tensor_bytes'])} | {name} | "
                f"{m['ready_s']:.2f} | {m['ready_s'] / base:.2f}x | {gib(m['rss'])} | {gib(m['file'])} | "
                f"{gib(m['anon'])} | {m['rss'] / row['tensor_bytes']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def cpu_meta(runs: int, context: int) -> dict[str, Any]:
    """The machine as `llmplan bench` records it, with its CPU features and this run's settings."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return machine() | {"features": cpu_features(), "runs": runs, "context": context, "load_before": load}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="+", help="plans (their GGUF) or .gguf files")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--out", default=str(HERE / "serve-ready"))
    args = parser.parse_args(argv)
    meta = cpu_meta(args.runs, args.context)
    rows = [measure(item, _plan_gguf(item), args.runs, args.context) for item in args.items]
    meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


def _plan_gguf(item: str) -> Path:
    """A plan's GGUF: its `pieces:` name in the downloads cache (where the plan's first use joined it)."""
    if item.endswith(".gguf"):
        return Path(item)
    import yaml

    from llmplan.cache_home import cache_home

    plan = yaml.safe_load(Path(item).read_text())
    source = next(s for s in plan["stages"] if s.get("uses") == "model.source")
    pieces = source["with"]["pieces"]
    return cache_home() / "downloads" / pieces["sha256"][:16] / pieces["name"]


if __name__ == "__main__":
    sys.exit(main())
