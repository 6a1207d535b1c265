"""A busy machine (#30): llmplan and llama.cpp with 0, 1, 2 background CPU-bound spinners (and niced ones).

Usage: python benchmarks/busy_machine.py OUT_PREFIX [--checkout NAME=DIR ...] [--levels 0,1,2,1n]
           [--rounds N] [--prompt-tokens 118] [--gen-tokens 64] [--no-llama] [--serve CLIENTS]

A level is a number of spinner processes (`while True: pass`), `n` after it runs them under `nice -n 19`.
Per round and level: spinners start, the load average is recorded, then each checkout's
`llmplan bench plans/llama-int8.yaml --vs llama.cpp --batch 1,16 --runs 1 --no-cold` runs (decode at batch
1, prefill, batch-16 aggregate decode; llmplan through the engine, then llama-bench / llama-batched-bench on
the same model as Q8_0), the checkouts' order flipped every round; spinners stop. Medians over rounds; each
figure also as a share of the same engine's quiet (level 0) figure. Writes OUT_PREFIX.json and .md.
`--serve CLIENTS`: the serving loop instead, `llmplan bench --serve --vs llama-server --clients CLIENTS` (64-token
prompts, 32 out, streaming): output tok/s and TTFT p50 of `llmplan serve` and llama-server under the same load.
`--no-llama`: llmplan only (`llmplan bench --batch 1,16` without --vs), for A/B rounds of two checkouts
where llama.cpp is not built or its time is better spent on more rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_checkouts import cpu_flags

SPIN = [sys.executable, "-c", "while True: pass"]


def spinners(level: str) -> list[subprocess.Popen[bytes]]:
    count, niced = int(level.rstrip("n")), level.endswith("n")
    cmd = ["nice", "-n", "19", *SPIN] if niced else SPIN
    return [subprocess.Popen(cmd) for _ in range(count)]


def bench(checkout: Path, out: Path, prompt: int, gen: int, llama: bool = True) -> list[dict[str, Any]]:
    cmd = [
        str(checkout / ".venv/bin/llmplan"), "bench", "plans/llama-int8.yaml", *(["--vs", "llama.cpp"] if llama
        else []), "--batch", "1,16", "--runs", "1", "--no-cold", "--prompt-tokens", str(prompt), "--gen-tokens",
        str(gen), "--format", "json", "--out", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    subprocess.run(cmd, cwd=checkout, check=True, capture_output=True, text=True, timeout=1800, env=env)
    found = json.loads(out.with_suffix(".json").read_text())
    if llama:
        threads = found["machine"].get("kernel_threads")
        return [{**row, "kernel_threads": threads} for row in found["rows"]]
    by_batch = {row["batch"]: row for row in found["results"]}  # the --vs figures from a plain bench
    figures = {"decode_b1": (1, "decode_tok_s"), "prefill": (1, "prefill_tok_s"), "decode_batch": (16, "decode_tok_s")}
    return [{"figure": f, "llmplan": by_batch[b][key]} for f, (b, key) in figures.items()]


def bench_serve(checkout: Path, out: Path, clients: int) -> list[dict[str, Any]]:
    """`llmplan bench --serve --vs llama-server`: `clients` streaming clients against each server (the
    scheduler's serving loop, and llama-server on the Q8_0 GGUF); output tok/s and TTFT p50 of each."""
    cmd = [
        str(checkout / ".venv/bin/llmplan"), "bench", "plans/llama-int8.yaml", "--serve", "--vs", "llama-server",
        "--clients", str(clients), "--prompt-tokens", "64", "--gen-tokens", "32", "--time-limit", "600",
        "--format", "json", "--out", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    subprocess.run(cmd, cwd=checkout, check=True, capture_output=True, text=True, timeout=1800, env=env)
    sides = json.loads(out.with_suffix(".json").read_text())["sides"]
    ours, theirs = sides["llmplan"][str(clients)], sides["llama-server"][str(clients)]
    return [
        {"figure": f"serve_{clients}_tok_s", "llmplan": {"median": ours["output_tok_per_s"]},
         "llama_cpp": {"median": theirs["output_tok_per_s"]}},
        {"figure": f"serve_{clients}_ttft_p50_s", "llmplan": {"median": ours["ttft_p50_s"]},
         "llama_cpp": {"median": theirs["ttft_p50_s"]}},
    ]  # fmt: skip


def measure(args: argparse.Namespace, checkouts: list[tuple[str, Path]], tmp: Path) -> dict[str, Any]:
    samples: dict[str, list[float]] = {}
    loads: dict[str, list[float]] = {}
    teams: dict[str, list[dict[str, int]]] = {}
    for r in range(args.rounds):
        order = checkouts if r % 2 == 0 else checkouts[::-1]
        for level in args.levels.split(","):
            procs = spinners(level)
            try:
                loads.setdefault(level, []).append(os.getloadavg()[0])
                for name, checkout in order:
                    out = tmp / f"{name}-{r}-{level}"
                    rows = (
                        bench_serve(checkout, out, args.serve)
                        if args.serve
                        else bench(checkout, out, args.prompt_tokens, args.gen_tokens, not args.no_llama)
                    )
                    for row in rows:
                        for engine in ("llmplan", "llama_cpp")[: 1 if args.no_llama else 2]:
                            who = name if engine == "llmplan" else f"llama.cpp (beside {name})"
                            key = json.dumps([level, who, row["figure"]])
                            samples.setdefault(key, []).append(row[engine]["median"])
                    if row.get("kernel_threads"):  # the team at the end, drops and raises (#30)
                        teams.setdefault(json.dumps([level, name]), []).append(row["kernel_threads"])
                    print(f"round {r} level {level} {name} done", file=sys.stderr, flush=True)
            finally:
                for proc in procs:
                    proc.kill()
                    proc.wait()
    return {"samples": samples, "loadavg_before": loads, "kernel_threads": teams}


def rows_of(samples: dict[str, list[float]]) -> list[dict[str, Any]]:
    medians = {tuple(json.loads(k)): statistics.median(v) for k, v in samples.items()}
    rows = []
    for (level, who, figure), value in sorted(medians.items()):
        quiet = medians.get(("0", who, figure))
        rows.append({"level": level, "engine": who, "figure": figure, "tok_s": value,
                     "of_quiet": value / quiet if quiet else None,
                     "samples": samples[json.dumps([level, who, figure])]})  # fmt: skip
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# A busy machine (#30): tok/s with background CPU-bound spinners",
        "",
        f"Machine: {meta['cpu']}; load average (1 min) {meta['loadavg_start'][0]:.2f} at start, "
        f"{meta['loadavg_end'][0]:.2f} at the end; before each level: {meta['loadavg_before']}.",
        f"{meta['rounds']} round(s); prompt {meta['prompt_tokens']} tokens, {meta['gen_tokens']} generated; "
        "spinners `while True: pass` (`n`: under nice -n 19). Medians over rounds; share = of the same "
        "engine's quiet figure.",
        "",
        "| spinners | engine | figure | tok/s (or s) | share of quiet |",
        "|---|---|---|---:|---:|",
    ]
    for row in rows:
        share = f"{row['of_quiet']:.2f}" if row["of_quiet"] is not None else "-"
        lines.append(f"| {row['level']} | {row['engine']} | {row['figure']} | {row['tok_s']:.4g} | {share} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--checkout", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--levels", default="0,1,2,1n")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=118)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--no-llama", action="store_true", help="llmplan only: no llama.cpp runs")
    ap.add_argument("--serve", type=int, default=0, metavar="CLIENTS",
                    help="the serving loop instead: CLIENTS streaming clients, llmplan serve beside llama-server")
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    checkouts = [(c.split("=", 1)[0], Path(c.split("=", 1)[1])) for c in args.checkout] or [("this", here)]
    start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        found = measure(args, checkouts, Path(tmp))
    meta = {"cpu": cpu_flags(), "rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
            "gen_tokens": args.gen_tokens, "loadavg_start": start, "loadavg_end": os.getloadavg(),
            "loadavg_before": found["loadavg_before"], "kernel_threads": found["kernel_threads"]}  # fmt: skip
    rows = rows_of(found["samples"])
    Path(args.out + ".json").write_text(json.dumps({"machine": meta, "rows": rows}, indent=2))
    text = markdown(meta, rows)
    Path(args.out + ".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
