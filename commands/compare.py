"""`llmplan compare PLAN...` — what each plan costs and buys, in one table and one picture.

Per plan, through the code of `llmplan bench` (commands/bench/measure.py: the plan's own stages, the same
timed generate call) and of `llmplan eval` (commands/eval.py: the same chunks, reference and figures):
the weight and KV-cache bytes and the peak RSS of the plan's load as written, its load time, TTFT and
decode tok/s at each batch size (a smaller cache, just what the runs need), perplexity and the
KL-divergence from the reference. The picture (commands/compare_figure.py) is a Pareto view: decode speed
and bytes against KL, one labelled point per plan, the frontier of plans no other beats on both.
Defaults are small (short prompts, few tokens, two chunks) so six plans of the bundled model take minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

from llmplan.commands.arguments import positive


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "compare",
        help="weights, KV cache, load, speed and quality of several plans: one table, one Pareto picture",
        description=(
            "Per plan: weight and KV bytes, the peak and time of its load, TTFT, decode tok/s per batch size, "
            "perplexity and KL-divergence from the reference; a table and a Pareto picture."
        ),
    )
    parser.add_argument("plans", nargs="+", metavar="PLAN")
    parser.add_argument("--picture", default="compare.svg", metavar="PATH", help="the Pareto view (.svg or .png)")
    parser.add_argument("--out", metavar="PREFIX", help="also write PREFIX.json and PREFIX.md")
    parser.add_argument("--format", choices=["md", "json"], default="md")
    parser.add_argument("--prompt-tokens", type=positive, default=32, help="prompt length for the speed runs")
    parser.add_argument("--gen-tokens", type=positive, default=16, help="tokens generated per row")
    parser.add_argument("--batch", default="1,16", help="batch sizes for decode tok/s (default 1,16)")
    parser.add_argument("--runs", type=positive, default=3, help="timed runs per batch size (after a warm-up)")
    parser.add_argument("--ref", metavar="PLAN", help="the reference plan (default: the first PLAN in fp32)")
    parser.add_argument("--text", metavar="FILE", help="UTF-8 text to score (default: Python's pydoc_data topics)")
    parser.add_argument("--context", type=int, default=128, metavar="N", help="tokens per scored chunk")
    parser.add_argument("--chunks", type=int, default=2, metavar="N", help="chunks scored")
    parser.add_argument("--greedy", type=int, default=16, metavar="N", help="greedy tokens for the same-token rate")
    parser.add_argument("--prompts", type=int, default=1, metavar="N", help="greedy prompts")
    parser.add_argument("--set", action="append", default=[], metavar="ID.PARAM=VALUE", help="override every plan")
    parser.set_defaults(handler=run, dtypes=None, kv_dtypes=None)


def _batches(text: str) -> list[int]:
    from llmplan.engine.cli import CliError

    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise CliError(f"--batch: expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise CliError("--batch: batch sizes must be at least 1")
    return values


def run(args: argparse.Namespace) -> int:
    from llmplan.commands.bench.command import check_out, write_pair
    from llmplan.commands.bench.report import machine
    from llmplan.commands.bench.traffic import cpu_features
    from llmplan.commands.eval import check_args, evaluate, read_text
    from llmplan.engine.cli import CliError
    from llmplan.ownership import check_writable

    from .compare_figure import draw

    check_args(args)
    batches = _batches(args.batch)
    for plan in args.plans:
        if not Path(plan).is_file():
            raise CliError(f"{plan}: no such plan file")
    picture = Path(args.picture)
    if picture.suffix.lower() not in (".svg", ".png"):
        raise CliError(f"--picture {picture}: give a .svg or .png path")
    check_writable(picture, "file", "--picture")
    if args.out:
        check_out(Path(args.out))
    text, source = read_text(args.text, args.context, args.chunks)
    info = machine() | {"cpu_features": cpu_features()}
    shape = _warm_up(args.plans[0], args)
    rows = [measure(plan, args, batches, shape) for plan in args.plans]
    quality = evaluate(args, text, source)
    for row, scored in zip(rows, quality["plans"], strict=True):
        row.update({key: scored[key] for key in QUALITY})
    info["loadavg_end"] = machine()["loadavg"]
    result = {
        "machine": info,
        "settings": {k: getattr(args, k) for k in ("prompt_tokens", "gen_tokens", "runs", "context", "chunks")},
        "batches": batches,
        "text": source,
        "reference": {key: quality["reference"][key] for key in ("plan", "change", "weights", "perplexity")},
        "plans": rows,
    }
    draw(result, picture)
    _say(f"compare: drew {picture}")
    table = markdown(result)
    sys.stdout.write(json.dumps(result, indent=2) + "\n" if args.format == "json" else table + "\n")
    if args.out:
        write_pair(Path(args.out), json.dumps(result, indent=2), table + "\n")
        _say(f"compare: wrote {args.out}.json and {args.out}.md")
    return 0


QUALITY = ("plan_hash", "perplexity", "kl_mean", "kl_p99", "top1_agreement", "same_token_rate")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _warm_up(plan: str, args: argparse.Namespace) -> Any:
    """One load before any is timed: the process's first pays the imports and the kernels' first use.
    Returns the model's config: every plan's shape is checked against it before its speed is measured."""
    from llmplan.commands.bench.measure import load

    _say("compare: warm-up load")
    config = load(plan, args.set).ctx.model_config
    gc.collect()
    return config


def measure(plan: str, args: argparse.Namespace, batches: list[int], shape: Any) -> dict[str, Any]:
    """One plan: its load as written (bytes, peak, time), then speed at every batch size on a small cache.
    `shape`: the first plan's model config; a plan of another width or depth is refused before its speed runs."""
    from llmplan.commands.bench.measure import bench_overrides, load, random_prompts, run_once
    from llmplan.commands.bench.stats import summary
    from llmplan.commands.eval import check_shapes
    from llmplan.engine.console import RichProgress

    steps = 2 + len(batches) * (args.runs + 1)
    with RichProgress().task(f"measuring {Path(plan).name}", total=steps) as advance:
        written = load(plan, args.set)
        check_shapes(plan, written.ctx.model_config, args.plans[0], shape)
        regions = written.regions
        row: dict[str, Any] = {
            "plan": written.bound.plan.name,
            "plan_file": plan,
            "weights": str(written.metric("load.convert", "dtype") or "as stored"),
            "kv_cache": str(written.cache.k.dtype).removeprefix("torch.") if written.cache is not None else None,
            "weights_bytes": regions.get("weights"),
            "kv_cache_bytes": regions.get("kv_cache"),
            "load_peak_bytes": written.peak_rss - written.rss_before,
            "load_s": written.wall_s,
        }
        del written
        gc.collect()
        advance(1)
        tokens = args.prompt_tokens + args.gen_tokens
        overrides = bench_overrides(plan, args.set, dtype=None, max_batch=max(batches), max_tokens=tokens)
        loaded = load(plan, overrides)
        advance(1)
        vocab = loaded.ctx.model_config.vocab_size
        for b in batches:
            prompts = random_prompts(b, args.prompt_tokens, vocab, seed=b)
            run_once(loaded.model, loaded.cache, prompts, min(args.gen_tokens, 8))  # warm-up
            advance(1)
            runs = []
            for _ in range(args.runs):
                runs.append(run_once(loaded.model, loaded.cache, prompts, args.gen_tokens))
                advance(1)
            row[f"decode_tok_s_b{b}"] = summary([r["decode_tok_s"] for r in runs if r["decode_tok_s"]])["median"]
            if b == batches[0]:
                row["ttft_s"] = summary([r["ttft_s"] for r in runs])["median"]
                row["ttft_batch"] = b
    del loaded
    gc.collect()
    _say(f"compare: {row['plan']}: load {row['load_s']:.2f} s, " + ", ".join(
        f"batch {b} {row[f'decode_tok_s_b{b}']:.1f} tok/s" for b in batches
    ))  # fmt: skip
    return row


def _num(value: Any, digits: int = 4) -> str:
    from llmplan.commands.eval import _num as number

    return number(value, digits)


def markdown(result: dict[str, Any]) -> str:
    from llmplan.engine.memory import mib

    ref = result["reference"]
    batches = result["batches"]
    speed = " | ".join(f"decode tok/s b{b}" for b in batches)
    lines = [
        f"Reference: {ref['plan']}" + (f" ({ref['change']})" if ref["change"] else "") + f", perplexity "
        f"{_num(ref['perplexity'], 6)}; text {result['text']}, {result['settings']['chunks']} chunks of "
        f"{result['settings']['context']} tokens. Speed: {result['settings']['prompt_tokens']}-token prompts, "
        f"{result['settings']['gen_tokens']} generated, median of {result['settings']['runs']}. "
        f"Load average {_load(result['machine'])}; {result['machine']['cpu']} "
        f"({', '.join(result['machine'].get('cpu_features') or []) or 'no SIMD features listed'}, "
        f"{result['machine']['threads']} threads).",
        "",
        f"| plan | weights | KV | weight bytes | KV bytes | load peak | load s | TTFT ms | {speed} | perplexity | "
        "KL mean | KL p99 | top-1 |",
        "|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(batches) + "---:|---:|---:|---:|",
    ]
    for row in result["plans"]:
        rates = " | ".join(_num(row.get(f"decode_tok_s_b{b}")) for b in batches)
        lines.append(
            f"| {row['plan']} | {row['weights']} | {row['kv_cache']} | {mib(row['weights_bytes'])} | "
            f"{mib(row['kv_cache_bytes'])} | {mib(row['load_peak_bytes'])} | {row['load_s']:.2f} | "
            f"{row['ttft_s'] * 1000:.1f} | {rates} | {_num(row['perplexity'], 6)} | {_num(row['kl_mean'], 3)} | "
            f"{_num(row['kl_p99'], 3)} | {row['top1_agreement'] * 100:.1f} % |"
        )
    return "\n".join(lines)


def _load(info: dict[str, Any]) -> str:
    start, end = info.get("loadavg"), info.get("loadavg_end")
    if not start:
        return "not known"
    return f"{start[0]:.2f} at the start, {end[0]:.2f} at the end" if end else f"{start[0]:.2f}"
