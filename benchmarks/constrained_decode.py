"""Constrained (`format: json_schema`) against free decoding, batch 1 and 16, alternating in one process.

    .venv/bin/python benchmarks/constrained_decode.py [--plan plans/llama-int8.yaml] [--rounds 4]
        [--tokens 64] [--out benchmarks/constrained-decode]

The plan's model is loaded once through the engine (up to `load.to_device`); each round runs, at batch 1 and
at batch 16 (16 requests submitted at once to the engine loop), the same prompts free and under a JSON Schema
whose answer never has to end (an array of strings), so both run to the token limit; the order flips every
round so a machine that slows down favours neither. Greedy. Decode speed: tokens after each row's first,
summed over the rows / time from the first row's first token to the last row's last (prefill apart).
The issue asks constrained >= 0.95x free.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative_decode import encode, features, report

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
}
QUESTIONS = [
    "Write notes about the sea.",
    "Write notes about cooking rice.",
    "Write notes about the history of Rome.",
    "Write notes about learning to swim.",
]


def load(plan: str) -> Any:
    """The plan loaded up to `load.to_device`, with 16 cache rows (and its tokenizer)."""
    import tempfile

    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover
    from llmplan.engine.runner import Runner
    from llmplan.llm.text import Tokenizer
    from llmplan.stages.slots import InferenceContext

    bound = load_plan(Path(plan), discover(), ["place.max_batch=16"])
    ctx = InferenceContext()
    with tempfile.TemporaryDirectory() as tmp:
        result = Runner(bound, ctx, Path(tmp), until="place", cleanup=False).run()
        if result.status != "ok":
            raise SystemExit(f"loading {plan}: {result.message}")
    ctx.tokenizer = ctx.tokenizer or Tokenizer.from_dir(ctx.model_source.model_dir)
    return ctx


def batch(ctx: Any, prompts: list[list[int]], tokens: int, grammar: Any) -> dict[str, Any]:
    from llmplan.llm.generation import EngineLoop
    from llmplan.llm.generation.engine_loop import GenerationRequest
    from llmplan.llm.kv import SlotCache
    from llmplan.llm.sampling import build_picker
    from llmplan.llm.sampling.chain import SamplingParams

    loop = EngineLoop(ctx.model_runner, SlotCache.over(ctx.kv_cache), max_running=len(prompts))
    eos = frozenset(i for i in (ctx.tokenizer.eos_id,) if i is not None)
    seqs = [
        loop.submit(
            GenerationRequest(
                prompt=p,
                picker=build_picker(SamplingParams.trusted(temperature=0.0, grammar=grammar), len(p)),
                max_new_tokens=tokens,
                eos_ids=eos,
            )
        )
        for p in prompts
    ]
    loop.run()
    times = [s.generation.token_times for s in seqs]
    decoded = sum(len(t) - 1 for t in times)
    span = max(t[-1] for t in times) - min(t[0] for t in times)
    ended = [s.generation.finish_reason for s in seqs]
    return {"tok_s": decoded / span if span > 0 else None, "decoded": decoded, "ended": ended}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from llmplan.llm.sampling import OutputFormat, compile_format

    ctx = load(args.plan)
    eos = frozenset(i for i in (ctx.tokenizer.eos_id,) if i is not None)
    grammar = compile_format(OutputFormat.from_json_schema(SCHEMA), ctx.tokenizer, eos, ctx.model_config.vocab_size)
    ids = [encode(ctx, q) for q in QUESTIONS]
    sizes = {1: ids[:1], 16: [ids[i % len(ids)] for i in range(16)]}
    for prompts in sizes.values():  # warm-up
        batch(ctx, prompts, 8, None)
        batch(ctx, prompts, 8, grammar)
    rows = []
    for rnd in range(args.rounds):
        for size, prompts in sizes.items():
            load_1 = os.getloadavg()[0]
            order = (False, True) if rnd % 2 == 0 else (True, False)
            runs = {on: batch(ctx, prompts, args.tokens, grammar if on else None) for on in order}
            ratio = runs[True]["tok_s"] / runs[False]["tok_s"]
            rows.append({
                "round": rnd, "batch": size, "load_1min": load_1, "free_tok_s": runs[False]["tok_s"],
                "constrained_tok_s": runs[True]["tok_s"], "ratio": ratio,
                "decoded_free": runs[False]["decoded"], "decoded_constrained": runs[True]["decoded"],
            })  # fmt: skip
            print(f"round {rnd} batch {size:2d}: {ratio:.3f}x (load {load_1:.1f})", file=sys.stderr)
    from llmplan.commands.bench.report import machine

    loads = [r["load_1min"] for r in rows]
    per_batch = {
        size: {
            "free_tok_s": statistics.median(r["free_tok_s"] for r in rows if r["batch"] == size),
            "constrained_tok_s": statistics.median(r["constrained_tok_s"] for r in rows if r["batch"] == size),
            "ratio": statistics.median(r["ratio"] for r in rows if r["batch"] == size),
        }
        for size in sizes
    }
    return {
        "plan": args.plan, "rounds": args.rounds, "max_tokens": args.tokens, "schema": SCHEMA,
        "machine": machine(), "features": features(), "load_1min": {"min": min(loads), "max": max(loads)},
        "per_batch": per_batch, "runs": rows,
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# Constrained (JSON Schema) against free decoding, greedy",
        "",
        f"`{result['plan']}`, {result['max_tokens']} tokens a row, {result['rounds']} alternating rounds in one "
        f"process; {m.get('cpu', '?')}, {m.get('cores', '?')} CPUs, {result['features']}; load average (1 min) "
        f"{result['load_1min']['min']:.2f}-{result['load_1min']['max']:.2f}.",
        "",
        "| batch | free tok/s | constrained tok/s | ratio (median of paired rounds) |",
        "|---|---|---|---|",
    ]
    for size, p in result["per_batch"].items():
        lines.append(f"| {size} | {p['free_tok_s']:.1f} | {p['constrained_tok_s']:.1f} | **{p['ratio']:.3f}×** |")
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="plans/llama-int8.yaml")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    return report(parser.parse_args(argv), measure, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
