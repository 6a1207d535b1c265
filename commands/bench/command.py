"""`llmplan bench PLAN`: load time, prefill and decode speed, TTFT and memory of a plan's model.

    llmplan bench plans/llama-int8.yaml [--prompt-tokens 128] [--gen-tokens 128] [--batch 1,4,16] [--runs 3]
        [--vs transformers|llama.cpp] [--format md|json|csv] [--set ID.PARAM=VALUE] [--dtype fp32,int8] [--out PREFIX]

Per dtype of the grid (like llama-bench's): a cold load (after dropping the model files from the page
cache, when the kernel lets us), a warm load whose model is measured, a warm-up at every batch size, then
`--runs` runs per batch size; with `--vs transformers` its runs alternate with transformers' (A B A B), so
both see the same machine load, and the table gives the ratios. Registered through the `llmplan.commands`
entry point group:

    [project.entry-points."llmplan.commands"]
    bench = "llmplan.commands.bench.cli:register"   # its arguments, light to import; this module on use
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

from llmplan.engine.cli import CliError, settle_plan
from llmplan.engine.memory import rss_bytes
from llmplan.llm.formats.gguf import recorded_footprint
from llmplan.ownership import check_writable, write_file

from .measure import Loaded, bench_overrides, drop_page_cache, load, random_prompts, run_once
from .report import FIGURES, machine, render
from .stats import PeakRSS, summary


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def out_pair(prefix: Path) -> tuple[Path, Path]:
    """--out PREFIX's two files: PREFIX.json and PREFIX.md, PREFIX kept whole (`...-qwen2.5` stays so; a
    trailing .json or .md is taken as the prefix's own end)."""
    if prefix.suffix in (".json", ".md"):
        prefix = prefix.with_suffix("")
    return prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".md")


def check_out(prefix: Path) -> None:
    """--out PREFIX: PREFIX.json and PREFIX.md must be free or files llmplan wrote, checked before measuring."""
    for path in out_pair(prefix):
        check_writable(path, "file", "--out")


def write_pair(prefix: Path, json_text: str, markdown: str) -> None:
    """PREFIX.json and PREFIX.md, each atomically and only onto a path llmplan owns (llmplan/ownership.py)."""
    json_path, md_path = out_pair(prefix)
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        write_file(json_path, json_text, "--out")
        write_file(md_path, markdown, "--out")
    except OSError as bad:
        raise CliError(f"--out {prefix}: cannot write ({bad.strerror or bad})") from None


def cmd_bench(args: argparse.Namespace) -> int:
    settle_plan(args)
    if not Path(args.plan).is_file():
        raise CliError(f"{args.plan}: no such plan file")
    if args.out:
        check_out(Path(args.out))
    if getattr(args, "llama_type", None) and args.vs != "llama.cpp":
        raise CliError("--llama-type chooses llama.cpp's GGUFs: add --vs llama.cpp")
    if args.serve:
        return _bench_serve(args)
    if args.vs == "llama-server":
        raise CliError("--vs llama-server compares servers: add --serve")
    if args.vs == "llama.cpp":
        from .llama_cpp import bench_vs_llama_cpp, vs_markdown

        def write(partial: dict[str, Any]) -> None:
            if args.out:
                write_pair(Path(args.out), json.dumps(partial, indent=2), vs_markdown(partial))

        vs = bench_vs_llama_cpp(args, _say, write)
        _emit(args, vs, vs_markdown(vs))
        return 0
    if args.mix:
        return _bench_mix(args)
    result: dict[str, Any] = {
        "plan": args.plan,
        "machine": {},
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "gen_tokens": args.gen_tokens,
            "batch": args.batch,
            "runs": args.runs,
            "vs": args.vs,
            "set": args.set,
            "dtype": args.dtype,
        },
        "results": [],
        "ratios": [],
        "notes": [],
    }
    for dtype in args.dtype or [None]:
        _bench_dtype(args, dtype, result)
    result["machine"]["loadavg_end"] = machine()["loadavg"]
    text = render(result, args.format)
    sys.stdout.write(text)
    if args.out:
        from .report import to_markdown

        prefix = Path(args.out)
        write_pair(prefix, render(result, "json"), to_markdown(result))
        _say("wrote {} and {}".format(*out_pair(prefix)))
    return 0


def _emit(args: argparse.Namespace, result: dict[str, Any], markdown: str) -> None:
    """A --mix or --serve result: Markdown (or JSON) on stdout; with --out, PREFIX.json and PREFIX.md."""
    import json

    sys.stdout.write(json.dumps(result, indent=2) + "\n" if args.format == "json" else markdown)
    if args.out:
        prefix = Path(args.out)
        write_pair(prefix, json.dumps(result, indent=2), markdown)
        _say("wrote {} and {}".format(*out_pair(prefix)))


def _bench_serve(args: argparse.Namespace) -> int:
    """The resident server under concurrent clients, beside llama-server when asked (see serve_bench.py)."""

    from .serve_bench import bench_serve, serve_markdown
    from .traffic import cpu_features

    if args.vs == "transformers":
        raise CliError("--serve compares servers: --vs llama-server")
    info = machine() | {"cpu_features": cpu_features()}
    result: dict[str, Any] = {"plan": args.plan, "machine": info}
    result |= bench_serve(args, _say)
    info["loadavg_end"] = machine()["loadavg"]
    text = serve_markdown(result, info)
    _emit(args, result, text)
    lost = sum(f["lost"] for side in result["sides"].values() for f in side.values())
    return 0 if lost == 0 else 1


def _bench_mix(args: argparse.Namespace) -> int:
    """Static batches against the scheduler on a seeded mix of request lengths (see traffic.py)."""

    from .traffic import bench_mix, cpu_features, mix_markdown

    if args.max_step_tokens <= args.slots:
        raise CliError(f"--max-step-tokens ({args.max_step_tokens}) must exceed --slots ({args.slots})")
    dtype = args.dtype[0] if args.dtype else None
    tokens = args.mix_prompts[1] + args.mix_outputs[1]
    overrides = bench_overrides(args.plan, args.set, dtype=dtype, max_batch=args.slots, max_tokens=tokens)
    _say("bench: load")
    loaded = load(args.plan, overrides)
    info = machine() | {"cpu_features": cpu_features()}
    result = {"plan": args.plan, "machine": info}
    result |= bench_mix(
        loaded, args.mix, args.slots, args.runs, args.max_step_tokens, _say, args.mix_prompts, args.mix_outputs
    )
    result["machine"]["loadavg_end"] = machine()["loadavg"]
    text = mix_markdown(result, info)
    _emit(args, result, text)
    return 0


def _bench_dtype(args: argparse.Namespace, dtype: str | None, result: dict[str, Any]) -> None:
    prompt, gen = args.prompt_tokens, args.gen_tokens
    overrides = bench_overrides(args.plan, args.set, dtype=dtype, max_batch=max(args.batch), max_tokens=prompt + gen)
    cold_s = None if args.no_cold else _cold_load_s(args.plan, overrides, result["notes"])
    _say("bench: warm load")
    loaded = load(args.plan, overrides)
    if not result["machine"]:
        result["machine"] = machine()  # now: the plan's env stage has set the thread count
    label = dtype or str(loaded.metric("load.convert", "dtype") or "?")
    model, cache, cfg = loaded.model, loaded.cache, loaded.ctx.model_config
    prompts = {b: random_prompts(b, prompt, cfg.vocab_size, seed=b) for b in args.batch}

    # Warm-up at every batch size, inside the peak-RSS window that began with the load.
    # The first run after the load pays the one-time costs (lazy kernel prepacking, allocator growth):
    # its TTFT is what a user waits for after loading, so it is reported apart from the warm TTFT.
    with PeakRSS() as window:
        first_ttft: float | None = None
        for b in args.batch:
            _say(f"bench: {label} warm-up, batch {b}")
            warm = run_once(model, cache, prompts[b], min(gen, 8))
            first_ttft = warm["ttft_s"] if first_ttft is None else first_ttft
    peak = max(loaded.peak_rss, window.peak)
    memory = _memory(loaded, peak)

    hf = None
    if args.vs == "transformers":
        from .hf import hf_run_once

        hf, hf_load_s, hf_rss = _load_transformers(loaded, result["machine"])
        hf_first_ttft = 0.0

    for b in args.batch:
        ours: list[dict[str, Any]] = []
        theirs: list[dict[str, Any]] = []
        if hf is not None:
            warm = hf_run_once(hf, prompts[b], min(gen, 8))  # its warm-up
            hf_first_ttft = warm["ttft_s"] if b == args.batch[0] else hf_first_ttft
        for r in range(args.runs):
            _say(f"bench: {label} batch {b} run {r + 1}/{args.runs}")
            ours.append(run_once(model, cache, prompts[b], gen))
            if hf is not None:
                theirs.append(hf_run_once(hf, prompts[b], gen))
        row = _row("llmplan", label, b, ours)
        row["load"] = {"warm_s": loaded.wall_s, "cold_s": cold_s}
        row["first_ttft_s"] = first_ttft  # the first prefill after the load (batch of the first warm-up)
        row["load_to_first_token_s"] = loaded.wall_s + (first_ttft or 0.0)
        row |= {"peak_rss_bytes": peak, "memory": memory, "stages": _stage_figures(loaded)}
        result["results"].append(row)
        if hf is not None:
            hrow = _row("transformers", "fp32", b, theirs)
            hrow["paired_with"] = label
            hrow["load"] = {"warm_s": hf_load_s, "cold_s": None}
            hrow["load_to_first_token_s"] = hf_load_s + hf_first_ttft
            hrow["rss_delta_load_bytes"] = hf_rss
            result["results"].append(hrow)
            result["ratios"].append(_ratios(label, b, row, hrow, ours, theirs, gen))
    del model, cache, loaded, hf
    gc.collect()


def _load_transformers(loaded: Loaded, machine_info: dict[str, Any]) -> tuple[Any, float, int]:
    """transformers' fp32 model of the same files: (model, load seconds, RSS it added); its version noted."""
    from .hf import load_transformers

    before = rss_bytes()
    _say("bench: loading transformers (fp32)")
    hf, hf_load_s = load_transformers(Path(loaded.ctx.model_source.model_dir))
    hf_rss = rss_bytes() - before
    import transformers

    machine_info["transformers"] = transformers.__version__
    return hf, hf_load_s, hf_rss


def _cold_load_s(plan: str | Path, overrides: list[str], notes: list[str]) -> float | None:
    """The load's wall time with the model files dropped from the page cache; None (and a note) where
    the OS does not drop them."""
    probe = load(plan, overrides)  # the first load of the process also warms up imports
    files = probe.files
    del probe
    gc.collect()
    if not drop_page_cache(files):
        notes.append("cold load not measurable here: posix_fadvise(DONTNEED) did not drop the files")
        return None
    _say("bench: cold load (model files dropped from the page cache)")
    cold = load(plan, overrides)
    cold_s = cold.wall_s
    del cold
    gc.collect()
    return cold_s


def _memory(loaded: Loaded, peak: int) -> dict[str, Any]:
    """The loaded regions and the peak RSS against their sum (the budget: weights, KV cache, the RSS before)."""
    regions = loaded.regions
    budget = regions.get("weights", 0) + regions.get("kv_cache", 0) + loaded.rss_before
    return {
        "weights_bytes": regions.get("weights"),
        "kv_cache_bytes": regions.get("kv_cache"),
        "rss_before_bytes": loaded.rss_before,
        "peak_rss_bytes": peak,
        "peak_over_budget": peak / budget if budget else None,
        "gguf": recorded_footprint(loaded.metric("load.to_device", "resident_weights")),  # against the GGUF
    }


def _stage_figures(loaded: Loaded) -> dict[str, Any]:
    return {
        "convert_s": loaded.metric("load.convert", "convert_s"),
        "activation_dtype": loaded.metric("load.to_device", "activation_dtype"),
    }


def _row(engine: str, dtype: str, batch: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"engine": engine, "dtype": dtype, "batch": batch}
    for figure in FIGURES:
        row[figure] = summary([r[figure] for r in runs if r[figure] is not None])
    row["decode_ms_per_step"] = summary([r["decode_ms_per_step"] for r in runs if r["decode_ms_per_step"]])
    devices = [r["peak_device_bytes"] for r in runs if r["peak_device_bytes"] is not None]
    row["peak_device_bytes"] = max(devices) if devices else None
    return row


def _ratios(
    dtype: str,
    batch: int,
    ours: dict[str, Any],
    theirs: dict[str, Any],
    our_runs: list[dict[str, Any]],
    their_runs: list[dict[str, Any]],
    gen: int,
) -> dict[str, Any]:
    """llmplan / transformers per figure (medians); and how many leading greedy tokens agree (row 0)."""
    ratio: dict[str, Any] = {"dtype": dtype, "batch": batch}
    for figure in FIGURES:
        a, b = ours[figure]["median"], theirs[figure]["median"]
        ratio[figure] = a / b if a is not None and b else None
    mine, hers = our_runs[0]["tokens"][0], their_runs[0]["tokens"][0]
    same = next((i for i, (x, y) in enumerate(zip(mine, hers, strict=True)) if x != y), gen)
    ratio["greedy_tokens_agree"] = same
    return ratio
