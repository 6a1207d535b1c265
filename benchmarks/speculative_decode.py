"""Prompt-lookup speculation against plain decoding, greedy, batch 1, alternating in one process.

    .venv/bin/python benchmarks/speculative_decode.py [--plan plans/llama-int8.yaml] [--rounds 6]
        [--tokens 128] [--spec-tokens 4] [--ngram 3] [--threads N] [--out benchmarks/speculative-decode]
    .venv/bin/python benchmarks/speculative_decode.py --plan plans/llama-fp32-draft.yaml --method draft

The plan's model is loaded once through the engine (up to `load.to_device`, or its `load.draft` where it has
one: `--method draft`); each prompt is then answered by the engine loop twice per round, plain and with
`speculative: {method: prompt_lookup}` (or `draft`), the order flipping
every round so a machine that slows down over the run favours neither. Decode speed is the request's own:
tokens after the first / time from the first token to the last (prefill apart, as `llmplan run` reports it).
Beside the wall-clock rate, the CPU-time rate (the process's CPU seconds over the same tokens): on a machine
shared with other work, wall time counts the seconds the scheduler gave to others, CPU time mostly does not,
so the CPU ratio is the steadier of the two there (with one thread, `--threads 1`, no spinning OpenMP worker
adds to it either).
Greedy answers must be the same token for token; a run where they are not stops the benchmark.

Two groups of prompts: answers that quote their input (rename a variable in code, repeat a text with one
change, extract fields) — the case speculation is for — and free-form answers, where it must cost nothing.
The quoted texts come from the installed software itself (the standard library's source, pydoc's topics,
an installed package's metadata), never from a file in the repository.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def quoting_prompts() -> dict[str, str]:
    """Tasks whose answer copies most of its input."""
    from pydoc_data.topics import topics

    code = inspect.getsource(textwrap.indent)
    topic = " ".join(topics["pass"].split())[:700]
    meta = metadata.metadata("rich")
    card = "\n".join(f"{k}: {meta[k]}" for k in ("Name", "Version", "Summary", "License", "Requires-Python"))
    return {
        "rename-in-code": f"Rename the parameter `predicate` to `keep` in this Python function and show the whole "
        f"function:\n\n```python\n{code}```",
        "repeat-with-change": f"Repeat the following text exactly, but write the word 'pass' in capitals:\n\n{topic}",
        "extract-fields": f"From this package record, write each field as a line `field = value`:\n\n{card}",
    }


def free_prompts() -> dict[str, str]:
    """Tasks whose answer is new text."""
    return {
        "poem": "Write a short poem about the sea at night.",
        "explain": "Explain to a child why the sky is blue.",
        "tips": "Give five tips for someone learning to cook.",
    }


def load(plan: str) -> Any:
    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover
    from llmplan.engine.runner import Runner
    from llmplan.stages.slots import InferenceContext

    bound = load_plan(Path(plan), discover())
    ctx = InferenceContext()
    # The last stage of the load: the draft's where the plan has one (it comes after the placement).
    last = next((b.id for b in bound.stages if b.spec.uses == "load.draft"), None)
    last = last or next(b.id for b in bound.stages if b.spec.uses == "load.to_device")
    with tempfile.TemporaryDirectory() as tmp:
        result = Runner(bound, ctx, Path(tmp), until=last, cleanup=False).run()
        if result.status != "ok":
            raise SystemExit(f"loading {plan}: {result.message}")
    if ctx.tokenizer is None:  # the tokenizer stage is not upstream of the placement
        from llmplan.llm.text import Tokenizer

        ctx.tokenizer = Tokenizer.from_dir(ctx.model_source.model_dir)
    return ctx


def answer(ctx: Any, prompt: list[int], tokens: int, spec: Any) -> dict[str, Any]:
    """One greedy answer through the engine loop: its tokens, decode speed and the guesses it verified."""
    from llmplan.llm.generation import EngineLoop
    from llmplan.llm.generation.engine_loop import GenerationRequest
    from llmplan.llm.kv import SlotCache
    from llmplan.llm.sampling import build_picker
    from llmplan.llm.sampling.chain import SamplingParams

    loop = EngineLoop(ctx.model_runner, SlotCache.over(ctx.kv_cache), draft=ctx.draft_model)
    picker = build_picker(SamplingParams(temperature=0.0), len(prompt))
    eos = {i for i in (ctx.tokenizer.eos_id,) if i is not None}
    cpu: list[float] = []  # the process's CPU seconds at each token
    seq = loop.submit(
        GenerationRequest(
            prompt=prompt, picker=picker, max_new_tokens=tokens, eos_ids=eos, speculation=spec,
            on_token=lambda _: cpu.append(time.process_time()),
        )
    )  # fmt: skip
    loop.run()
    gen = seq.generation
    times = gen.token_times
    decode_s, cpu_s = times[-1] - times[0], cpu[-1] - cpu[0]
    return {
        "tokens": list(gen.tokens),
        "decode_tok_s": (len(times) - 1) / decode_s if decode_s > 0 else None,
        "cpu_tok_s": (len(cpu) - 1) / cpu_s if cpu_s > 0 else None,
        "guessed": gen.guessed,
        "accepted": gen.accepted,
        "passes": gen.decode_steps,
    }


def encode(ctx: Any, text: str) -> list[int]:
    tok = ctx.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from llmplan.llm.sampling import Speculation

    ctx = load(args.plan)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)  # the native kernels share torch's thread count
    if args.method == "draft" and ctx.draft_model is None:
        raise SystemExit(f"{args.plan}: --method draft needs a plan with a load.draft stage")
    spec = Speculation(method=args.method, tokens=args.spec_tokens, ngram=args.ngram)
    groups = {"quoting": quoting_prompts(), "free": free_prompts()}
    prompts = {name: (group, encode(ctx, text)) for group, texts in groups.items() for name, text in texts.items()}
    for ids in (p for _, p in prompts.values()):  # warm-up: kernels built, caches touched
        answer(ctx, ids, 8, None)
        answer(ctx, ids, 8, spec)
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        load_1 = os.getloadavg()[0]
        for name, (group, ids) in prompts.items():
            order = (False, True) if rnd % 2 == 0 else (True, False)
            runs = {on: answer(ctx, ids, args.tokens, spec if on else None) for on in order}
            if runs[True]["tokens"] != runs[False]["tokens"]:
                raise SystemExit(f"{name}: the speculative answer differs from the plain one (round {rnd})")
            rows.append({
                "round": rnd, "prompt": name, "group": group, "prompt_tokens": len(ids),
                "answer_tokens": len(runs[False]["tokens"]), "load_1min": load_1,
                "plain_tok_s": runs[False]["decode_tok_s"], "spec_tok_s": runs[True]["decode_tok_s"],
                "plain_cpu_tok_s": runs[False]["cpu_tok_s"], "spec_cpu_tok_s": runs[True]["cpu_tok_s"],
                "guessed": runs[True]["guessed"], "accepted": runs[True]["accepted"],
                "passes_plain": runs[False]["passes"], "passes_spec": runs[True]["passes"],
            })  # fmt: skip
            r = rows[-1]
            print(
                f"round {rnd} {name:20s} wall {r['spec_tok_s'] / r['plain_tok_s']:.2f}x "
                f"cpu {r['spec_cpu_tok_s'] / r['plain_cpu_tok_s']:.2f}x guessed {r['guessed']} "
                f"accepted {r['accepted']}",
                file=sys.stderr,
            )
    result = summarize(args, rows)
    costs = ctx.model_runner.pass_costs  # what the runner learnt a pass of n inputs costs (generation/speculative.py)
    result["pass_costs"] = {n: round(costs.cost(n), 3) for n in range(1, args.spec_tokens + 2)}
    return result


def summarize(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from llmplan.commands.bench.report import machine

    per_prompt = {}
    for name in dict.fromkeys(r["prompt"] for r in rows):
        mine = [r for r in rows if r["prompt"] == name]
        guessed = sum(r["guessed"] for r in mine)
        per_prompt[name] = {
            "group": mine[0]["group"],
            "answer_tokens": mine[0]["answer_tokens"],
            "plain_tok_s": statistics.median(r["plain_tok_s"] for r in mine),
            "spec_tok_s": statistics.median(r["spec_tok_s"] for r in mine),
            "ratio": statistics.median(r["spec_tok_s"] / r["plain_tok_s"] for r in mine),
            "cpu_ratio": statistics.median(r["spec_cpu_tok_s"] / r["plain_cpu_tok_s"] for r in mine),
            "guessed": guessed / len(mine),  # a round's mean (they vary with timing)
            "acceptance": sum(r["accepted"] for r in mine) / guessed if guessed else None,
            "tokens_per_pass": mine[0]["answer_tokens"] / max(1, statistics.median(r["passes_spec"] for r in mine) + 1),
        }
    groups = {
        (g, key): statistics.median(p[key] for p in per_prompt.values() if p["group"] == g)
        for g in ("quoting", "free") for key in ("ratio", "cpu_ratio")
    }  # fmt: skip
    loads = [r["load_1min"] for r in rows]
    return {
        "plan": args.plan, "rounds": args.rounds, "max_tokens": args.tokens,
        "speculative": {"method": args.method, "tokens": args.spec_tokens, "ngram": args.ngram},
        "machine": machine(), "features": features(), "threads": args.threads or "the plan's",
        "load_1min": {"min": min(loads), "max": max(loads)},
        "median_ratio_by_group": {f"{g} {key}": v for (g, key), v in groups.items()},
        "per_prompt": per_prompt, "runs": rows,
    }  # fmt: skip


def report(
    args: argparse.Namespace, measure: Callable[[argparse.Namespace], dict[str, Any]], markdown: Callable[..., str]
) -> int:
    """Measure, print the Markdown, and with `--out OUT` write OUT.json and OUT.md (the benchmarks' one ending)."""
    started = time.time()
    result = measure(args)
    result["wall_s"] = time.time() - started
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(text)
    return 0


def features() -> str:
    """The CPU's SIMD features that the kernels may use, from /proc/cpuinfo."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "features unknown"
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16")
    return "features " + ", ".join(f for f in wanted if f in flags.split())


def markdown(result: dict[str, Any]) -> str:
    m, spec = result["machine"], result["speculative"]
    setting = f"method: {spec['method']}, tokens: {spec['tokens']}" + (
        f", ngram: {spec['ngram']}" if spec["method"] == "prompt_lookup" else ""
    )
    title = "Prompt-lookup speculation" if spec["method"] == "prompt_lookup" else "Speculation with a draft model"
    lines = [
        f"# {title} against plain decoding (greedy, batch 1)",
        "",
        f"`{result['plan']}`, `speculative: {{{setting}}}`, up to {result['max_tokens']} tokens, "
        f"{result['rounds']} alternating rounds in one "
        f"process; {m.get('cpu', '?')}, {m.get('cores', '?')} CPUs, {result['features']}, threads "
        f"{result['threads']}; load average (1 min) {result['load_1min']['min']:.2f}-{result['load_1min']['max']:.2f}. "
        "Every speculative answer equalled the plain one token for token.",
        "",
        "| prompt | group | answer tokens | plain tok/s | speculative tok/s | wall ratio | CPU-time ratio "
        "| guesses a round | accepted | tokens/pass |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in result["per_prompt"].items():
        acc = "-" if p["acceptance"] is None else f"{100 * p['acceptance']:.0f} %"
        lines.append(
            f"| {name} | {p['group']} | {p['answer_tokens']} | {p['plain_tok_s']:.1f} | {p['spec_tok_s']:.1f} | "
            f"**{p['ratio']:.2f}×** | **{p['cpu_ratio']:.2f}×** | {p['guessed']:.0f} | {acc} | "
            f"{p['tokens_per_pass']:.2f} |"
        )
    g = result["median_ratio_by_group"]
    lines += [
        "",
        f"Median ratio, wall clock: quoting prompts **{g['quoting ratio']:.2f}×**, free-form "
        f"**{g['free ratio']:.2f}×**; CPU time: quoting **{g['quoting cpu_ratio']:.2f}×**, free-form "
        f"**{g['free cpu_ratio']:.2f}×** (each prompt's ratio is the median over rounds of the paired runs).",
        "",
        "A decode pass of n inputs as the runner had measured it at the end, in one-input passes: "
        + ", ".join(f"{n}: {c:.2f}×" for n, c in result["pass_costs"].items())
        + " (a width never measured: the prior, +15 % an input).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="plans/llama-int8.yaml")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--method", choices=["prompt_lookup", "draft"], default="prompt_lookup")
    parser.add_argument("--threads", type=int, help="torch's (and the kernels') thread count; default: the plan's")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    return report(parser.parse_args(argv), measure, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
