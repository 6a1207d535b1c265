"""`llmplan bench PLAN --mix N`: requests of mixed lengths, static batches against the scheduler, in one run.

The workload is a fixed, seeded mix: N requests with prompts of 16-512 random ids and 16-256 generated tokens
each (greedy, EOS ignored, so both sides produce exactly the same tokens). All are there at t = 0, as a
prompt file is. The two sides run alternately (A B A B), so both see the same machine load:

- static: batches of `slots` requests in file order, left-padded to the batch's longest prompt; a batch
  decodes until its longest output is done (finished rows idle), and the next batch waits for it.
- scheduler: `slots` slots; a request enters the moment a slot frees and leaves when it is done.

Per side: total wall time, output tokens/s, and time to first token per request (median and p90, from t = 0).
Then the single-request tax: one request alone, decode tok/s through the static path and through the
scheduler, alternating.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

from llmplan.llm.generation import LoopOptions, ModelRunner, PromptRequest, Vocabulary, run_requests
from llmplan.llm.kv import KVCache
from llmplan.llm.sampling import SamplingParams

PROMPT_RANGE, OUTPUT_RANGE = (16, 512), (16, 256)
Mix = list[tuple[list[int], int]]  # (prompt ids, tokens to generate) per request


def workload(
    n: int, vocab: int, prompts: tuple[int, int] = PROMPT_RANGE, outputs: tuple[int, int] = OUTPUT_RANGE, seed: int = 0
) -> Mix:
    """(prompt ids, tokens to generate) for n requests; the same arguments give the same mix."""
    rng = random.Random(seed)
    lo, hi = min(100, vocab // 4), vocab - min(100, vocab // 4)
    mix = []
    for _ in range(n):
        length = rng.randint(*prompts)
        mix.append(([rng.randrange(lo, hi) for _ in range(length)], rng.randint(*outputs)))
    return mix


def _greedy_requests(mix: Mix) -> list[PromptRequest]:
    # greedy, no stop strings, no EOS (Vocabulary below): every request generates exactly its tokens
    return [PromptRequest(prompt, SamplingParams.trusted(max_new_tokens=n)) for prompt, n in mix]


def _no_eos(vocab: int) -> Vocabulary:
    return Vocabulary(tokenizer=None, eos_ids=frozenset(), pad_id=0, vocab_size=vocab)


def run_static(runner: ModelRunner, cache: KVCache, mix: Mix, slots: int) -> dict[str, Any]:
    start = time.perf_counter()
    options = LoopOptions(batch_size=slots, static_batches=True)
    run = run_requests(runner, cache, _greedy_requests(mix), options, _no_eos(runner.model.cfg.vocab_size))
    ttft = [o.batch_start_s + (o.generation.ttft_s or 0.0) for o in run.outcomes]  # from t = 0
    return _summary(time.perf_counter() - start, ttft, [o.generation.tokens for o in run.outcomes], mix)


def run_scheduled(runner: ModelRunner, cache: KVCache, mix: Mix, max_step_tokens: int) -> dict[str, Any]:
    # random prompts share no prefix
    options = LoopOptions(max_step_tokens=max_step_tokens, prefix_reuse=False)
    start = time.perf_counter()
    run = run_requests(runner, cache, _greedy_requests(mix), options, _no_eos(runner.model.cfg.vocab_size))
    wall = time.perf_counter() - start
    ttft = [o.generation.ttft_s or 0.0 for o in run.outcomes]  # from submission, which was t = 0
    out = _summary(wall, ttft, [o.generation.tokens for o in run.outcomes], mix)
    assert run.loop is not None
    out["steps"] = run.loop.stats.steps
    return out


def _summary(wall: float, ttft: list[float], tokens: list[list[int]], mix: Mix) -> dict[str, Any]:
    short = sum(len(t) != n for t, (_, n) in zip(tokens, mix, strict=True))
    if short:
        raise RuntimeError(f"{short} requests did not generate their tokens")
    total = sum(len(t) for t in tokens)
    cuts = statistics.quantiles(ttft, n=10)
    return {
        "wall_s": wall,
        "output_tokens": total,
        "output_tok_s": total / wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": cuts[-1],
        "ttft": ttft,
        "tokens": tokens,
    }


def single_request_tax(runner: ModelRunner, cache: KVCache, prompt: list[int], gen: int, runs: int) -> dict[str, Any]:
    """Decode tok/s of one request alone: static batches and the engine loop, alternating."""
    static, scheduled = [], []
    vocab = _no_eos(runner.model.cfg.vocab_size)
    for _ in range(runs):
        alone = LoopOptions(static_batches=True)
        (g,) = run_requests(runner, cache, _greedy_requests([(prompt, gen)]), alone, vocab).outcomes
        static.append((len(g.generation.tokens) - 1) / g.generation.decode_s)
        one_row = LoopOptions(batch_size=1, max_step_tokens=len(prompt) + 1)
        (s,) = run_requests(runner, cache, _greedy_requests([(prompt, gen)]), one_row, vocab).outcomes
        scheduled.append((len(s.generation.tokens) - 1) / s.generation.decode_s)
        if s.generation.tokens != g.generation.tokens:
            raise RuntimeError("the scheduler and the static path generated different greedy tokens")
    a, b = statistics.median(static), statistics.median(scheduled)
    return {"static_decode_tok_s": static, "scheduler_decode_tok_s": scheduled, "ratio": b / a}


def bench_mix(
    loaded: Any,
    n: int,
    slots: int,
    runs: int,
    max_step_tokens: int,
    say: Any,
    prompts: tuple[int, int] = PROMPT_RANGE,
    outputs: tuple[int, int] = OUTPUT_RANGE,
) -> dict[str, Any]:
    model, cache, cfg = loaded.model, loaded.cache, loaded.ctx.model_config
    runner = loaded.ctx.model_runner or ModelRunner(model, cache)
    mix = workload(n, cfg.vocab_size, prompts, outputs)
    say(f"bench: mix of {n} requests, warm-up")
    warm = mix[: min(2, n)]
    run_static(runner, cache, [(p[:32], 4) for p, _ in warm], slots)
    run_scheduled(runner, cache, [(p[:32], 4) for p, _ in warm], max_step_tokens)
    static_runs, sched_runs = [], []
    for r in range(runs):
        say(f"bench: mix run {r + 1}/{runs}: static batches of {slots}")
        static_runs.append(run_static(runner, cache, mix, slots))
        say(f"bench: mix run {r + 1}/{runs}: scheduler with {slots} slots")
        sched_runs.append(run_scheduled(runner, cache, mix, max_step_tokens))
        if static_runs[-1]["tokens"] != sched_runs[-1]["tokens"]:
            same = sum(a == b for a, b in zip(static_runs[-1]["tokens"], sched_runs[-1]["tokens"], strict=True))
            say(f"bench: note: {n - same} of {n} requests differ in their greedy tokens between the two sides")
    say("bench: one request alone, static vs scheduler")
    alone = min(128, prompts[1]), min(128, outputs[1])
    tax = single_request_tax(runner, cache, workload(1, cfg.vocab_size, (alone[0],) * 2, seed=1)[0][0], alone[1], 3)

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    per_request_faster = statistics.median(
        s / c for s, c in zip(static_runs[-1]["ttft"], sched_runs[-1]["ttft"], strict=True)
    )
    sides = {}
    for name, rows in (("static", static_runs), ("scheduler", sched_runs)):
        sides[name] = {k: med(rows, k) for k in ("wall_s", "output_tok_s", "ttft_p50_s", "ttft_p90_s")}
        sides[name]["runs"] = [{k: v for k, v in r.items() if k not in ("ttft", "tokens")} for r in rows]
    return {
        "requests": n,
        "slots": slots,
        "max_step_tokens": max_step_tokens,
        "prompt_range": prompts,
        "output_range": outputs,
        "single_request_shape": alone,
        "output_tokens": static_runs[-1]["output_tokens"],
        "sides": sides,
        "throughput_ratio": sides["scheduler"]["output_tok_s"] / sides["static"]["output_tok_s"],
        "ttft_p50_ratio": sides["scheduler"]["ttft_p50_s"] / sides["static"]["ttft_p50_s"],
        "ttft_median_per_request_static_over_scheduler": per_request_faster,
        "single_request": tax,
    }


def mix_markdown(result: dict[str, Any], machine: dict[str, Any]) -> str:
    m, s = result, result["sides"]
    lines = [
        f"# llmplan bench --mix: {result['plan']}",
        "",
        f"Machine: {machine['cpu']} ({', '.join(machine.get('cpu_features', []))}), {machine['cores']} cores, "
        f"{machine['threads']} threads, torch {machine['torch']}; load average {machine.get('loadavg')}.",
        f"{m['requests']} requests (seeded mix: prompts {m['prompt_range'][0]}–{m['prompt_range'][1]} random ids, "
        f"{m['output_range'][0]}–{m['output_range'][1]} generated, greedy, EOS ignored; {m['output_tokens']} output "
        f"tokens in all), all present at t = 0. Static: batches of {m['slots']} (left-padded, each batch runs to its "
        f"longest output). Scheduler: {m['slots']} slots, {m['max_step_tokens']} tokens per step. Runs alternate; "
        "medians.",
        "",
        "| side | wall s | output tok/s | TTFT p50 s | TTFT p90 s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("static", "scheduler"):
        r = s[name]
        lines.append(
            f"| {name} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} |"
        )
    tax = m["single_request"]
    lines += [
        "",
        f"Throughput, scheduler / static: **{m['throughput_ratio']:.2f}×**. TTFT p50, scheduler / static: "
        f"**{m['ttft_p50_ratio']:.2f}×**; per request, static TTFT / scheduler TTFT at the median: "
        f"{m['ttft_median_per_request_static_over_scheduler']:.2f}×.",
        "",
        f"One request alone ({m['single_request_shape'][0]}-token prompt, {m['single_request_shape'][1]} generated), "
        "decode tok/s: static "
        f"{statistics.median(tax['static_decode_tok_s']):.1f}, scheduler "
        f"{statistics.median(tax['scheduler_decode_tok_s']):.1f} (ratio {tax['ratio']:.3f}).",
        "",
    ]
    return "\n".join(lines)


def cpu_features() -> list[str]:
    """The SIMD features that decide which kernels run fast here, as /proc/cpuinfo lists them."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), [])
    except OSError:
        return []
    return [f for f in wanted if f in flags]


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
