"""A/B speed of two llmplan checkouts, alternating in one run: `llmplan bench` from each, round by round.

Usage: python ab_bench.py BASE_DIR NEW_DIR OUT_PREFIX [--rounds N] [--plans a.yaml,b.yaml]

Each round runs BASE then NEW (then NEW then BASE the next round, so drift in machine load hits both
alike) with --runs 1 --no-cold; medians over rounds per (plan, batch) of prefill and decode tok/s, and the
ratio NEW/BASE. Writes OUT_PREFIX.json and OUT_PREFIX.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(keep)})"


def bench_once(checkout: Path, plan: str, batch: str, out: Path) -> list[dict]:
    cmd = [
        str(checkout / ".venv/bin/llmplan"), "bench", plan, "--batch", batch, "--runs", "1", "--no-cold",
        "--prompt-tokens", "128", "--gen-tokens", "64", "--format", "json", "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, cwd=checkout, check=True, capture_output=True, text=True)
    return json.loads(out.with_suffix(".json").read_text())["results"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--plans", default="plans/llama-int8.yaml,plans/llama-fp32.yaml")
    ap.add_argument("--batch", default="1,16")
    args = ap.parse_args()
    samples: dict[tuple[str, int, str, str], list[float]] = {}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = [("base", args.base), ("new", args.new)]
            if r % 2:
                order.reverse()
            for plan in args.plans.split(","):
                for name, checkout in order:
                    out = Path(tmp) / f"{name}-{r}-{Path(plan).stem}"
                    for row in bench_once(checkout, plan, args.batch, out):
                        for metric in ("prefill_tok_s", "decode_tok_s"):
                            key = (plan, row["batch"], metric, name)
                            samples.setdefault(key, []).append(row[metric]["median"])
                    print(f"round {r} {plan} {name} done", file=sys.stderr, flush=True)
    rows = []
    for plan, batch, metric in sorted({k[:3] for k in samples}):
        base = statistics.median(samples[(plan, batch, metric, "base")])
        new = statistics.median(samples[(plan, batch, metric, "new")])
        rows.append({"plan": plan, "batch": batch, "metric": metric, "base": base, "new": new, "ratio": new / base,
                     "base_samples": samples[(plan, batch, metric, "base")],
                     "new_samples": samples[(plan, batch, metric, "new")]})  # fmt: skip
    meta = {"cpu": cpu_flags(), "python": platform.python_version(), "rounds": args.rounds,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg()}  # fmt: skip
    Path(args.out + ".json").write_text(json.dumps({"machine": meta, "rows": rows}, indent=2))
    lines = [
        "# A/B: before and after the refactor, alternating in one run",
        "",
        f"Machine: {meta['cpu']}; load average {load_start[0]:.1f} at start, {meta['loadavg_end'][0]:.1f} at the end.",
        f"{args.rounds} rounds, each `llmplan bench --runs 1 --no-cold --prompt-tokens 128 --gen-tokens 64` from",
        "each checkout, the order flipped every round; medians over rounds.",
        "",
        "| plan | batch | metric | before tok/s | after tok/s | after/before |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        cells = (row["plan"], row["batch"], row["metric"], f"{row['base']:.1f}", f"{row['new']:.1f}")
        lines.append("| " + " | ".join(map(str, cells)) + f" | {row['ratio']:.3f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
