"""`llmplan bench PLAN --vs llama.cpp`: the plan's decode, prefill and batch speed against llama.cpp's own tools.

    llmplan bench plans/llama-int8.yaml --vs llama.cpp [--dtype fp32,int8,int4] [--runs 3] [--threads 2]
        [--llama-type Q8_0,Q4_1,as-shipped] [--llama-build native|avx2] [--out benchmarks/vs-llama-cpp]

Three figures per precision, each a ratio llmplan / llama.cpp of medians over `--runs` runs that alternate
(ours, theirs, ours, theirs: both see the same machine load, which on a shared 2-core machine moves the
absolute numbers by 2x or more):

* batch 1 decode: llmplan's greedy decode after a `--prompt-tokens` prompt against `llama-bench -p 0 -n GEN
  -d PROMPT` (tg at the same depth);
* prefill: llmplan's batch-1 prefill of `--prompt-tokens` against `llama-bench -p PROMPT -n 0` (pp);
* batch 16 aggregate decode (the largest `--batch`): against `llama-batched-bench -npp PROMPT -ntg GEN -npl B`
  (every sequence its own prompt, aggregate tg speed).

Each measured batch-1 run of llmplan's follows a short warm-up run (WARM_TOKENS), as each llama-bench measure
follows its own warm-up pass. llama.cpp is the one `benchmarks/build_llama_server.sh` builds from the vendored
source of the pinned llama-cpp-python (GGML_NATIVE=ON, or `--llama-build avx2`: AVX2 only, the reference for
`LLMPLAN_ISA=avx2`). Its GGUFs are requantized from the plan's bundled GGUF with that build's `llama-quantize`:
F32 for fp32, Q8_0 for int8, Q4_1 for int4 (BF16 and F16 for bf16 and fp16), the same weights llmplan quantizes.

`--llama-type` chooses llama.cpp's side instead: a comma list of llama.cpp types (`Q8_0`, `Q4_1`, `F32`...),
each requantized as above, or `as-shipped` (or the GGUF's own type name, e.g. `Q4_K_M`): the plan's GGUF
itself, untouched. Each is paired with the llmplan dtype closest in bits among those run (`--dtype`, else
all five; Q4_K_M pairs with int4), or with the one named: `int8=as-shipped`. A dtype of `--dtype` that no
type names is run against its default type. One load per dtype; each run measures llmplan once, then each
of its llama.cpp types, alternating. The table names the type each GGUF actually is, read from the file
(llm/formats/gguf/file_type.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
from pathlib import Path
from typing import Any, get_args

from llmplan.engine.cli import CliError
from llmplan.engine.memory import mib
from llmplan.llm.formats.gguf import (
    GGUFType,
    file_type_names,
    footprint_line,
    gguf_read_per_token,
    gguf_type,
    nominal_bits,
    read_per_token,
    recorded_footprint,
)
from llmplan.llm.model import QuantDtype
from llmplan.openmp_env import foreign_env

from .measure import bench_overrides, load, random_prompts, run_once
from .read_rate import READ_MIB, read_rate
from .report import machine
from .stats import summary

# Tokens of the short run before each measured batch-1 run. llama-bench runs a warm-up pass before each
# measure; without one of ours, llmplan's run followed llama.cpp's (or the read rate's) idle CPU and cold
# caches: a Gemma 3 fp32 prefill measured 750-785 tok/s after a llama-bench or an 8 s sleep against 822-886
# back to back, which read as a 0.92x prefill in one run whose first (warm) run was 848.
WARM_TOKENS = 2

GGUF_TYPES = {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_1", "bf16": "BF16", "fp16": "F16"}
AS_SHIPPED = "as-shipped"
STORED = "stored"  # load.convert's dtype that keeps the file's own blocks: llama.cpp's side is that file itself
DTYPE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4}
FIGURES = ("decode_b1", "prefill", "decode_batch")
TITLES = {"decode_b1": "batch 1 decode", "prefill": "prefill", "decode_batch": "aggregate decode"}
_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "build_llama_server.sh"


def parse_llama_types(text: str) -> list[tuple[str | None, str]]:
    """`--llama-type`: `TYPE` or `DTYPE=TYPE`, comma-separated; TYPE a llama.cpp type name or `as-shipped`.
    ValueError names the entry that is neither."""
    known = set(file_type_names().values())
    dtypes = get_args(QuantDtype)
    entries: list[tuple[str | None, str]] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        dtype, sep, kind = entry.rpartition("=")
        dtype, kind = dtype.strip().lower() if sep else None, kind.strip()
        if dtype is not None and dtype not in dtypes:
            raise ValueError(f"{entry!r}: {dtype!r} is not an llmplan dtype (one of {', '.join(dtypes)})")
        if kind.lower() == AS_SHIPPED:
            kind = AS_SHIPPED
        elif kind.upper() in known:
            kind = kind.upper()
        else:
            raise ValueError(
                f"{entry!r}: {kind!r} is not a llama.cpp type (e.g. Q8_0, Q4_1, BF16, F32) or {AS_SHIPPED}"
            )
        entries.append((dtype, kind))
    if not entries:
        raise ValueError(f"expected llama.cpp types, e.g. Q8_0,Q4_1,{AS_SHIPPED}")
    return entries


def closest_dtype(kind: str, dtypes: list[str]) -> str:
    """The dtype of `dtypes` nearest `kind` in bits a weight, as a ratio (Q4_K_M and Q5_K_M -> int4, Q6_K and
    Q8_0 -> int8, BF16 -> bf16; BF16 among int8 and fp32: 2x either way): on a tie the same-named float, then
    the more bits."""
    bits = nominal_bits(kind)
    dtypes = [d for d in dtypes if d in DTYPE_BITS]  # `stored` is paired only with the file it maps
    if bits is None:
        raise CliError(
            f"--llama-type {kind}: cannot tell its bits a weight to pair it with a dtype; name one: DTYPE={kind}"
        )
    same = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}.get(kind)
    return min(dtypes, key=lambda d: (abs(math.log2(DTYPE_BITS[d] / bits)), d != same, -DTYPE_BITS[d]))


def llama_grid(
    dtypes: list[str] | None,
    entries: list[tuple[str | None, str]] | None,
    shipped: str | None,
    plan_dtype: str | None = None,
) -> list[tuple[str | None, list[str] | None]]:
    """Which llama.cpp types run beside each llmplan dtype, in order: (dtype, types); types None means the
    dtype's default (GGUF_TYPES), dtype None the plan's own. `as-shipped` becomes `shipped`, the GGUF's own
    type name, which means the file itself wherever it appears; beside `stored` where the grid has it (a plan
    that keeps its file's blocks, `plan_dtype`, has it when no --dtype is given)."""
    if not entries:
        return [(d, None) for d in (dtypes or [None])]
    pool = list(dtypes or ([STORED] if plan_dtype == STORED else []) + list(DTYPE_BITS))
    grid: dict[str, list[str]] = {d: [] for d in dtypes or []}
    for dtype, kind in entries:
        if kind == AS_SHIPPED:
            if shipped is None:
                raise CliError(f"--llama-type {AS_SHIPPED} needs a plan whose model comes from a GGUF")
            kind = shipped
            dtype = dtype or (STORED if STORED in pool else None)
        target = dtype or closest_dtype(kind, pool)
        if kind not in grid.setdefault(target, []):
            grid[target].append(kind)
    return [(d, kinds or None) for d, kinds in grid.items()]


def convert_dtype(plan: str, overrides: list[str]) -> str | None:
    """The dtype the plan's load.convert stage gives the weights (None: it has none)."""
    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover

    bound = load_plan(plan, discover(), overrides)
    return next((str(s.params.dtype) for s in bound.stages if s.spec.uses == "load.convert"), None)


def plan_gguf(plan: str, overrides: list[str]) -> Path | None:
    """The GGUF the plan's model comes from (None: not a GGUF), running only its model source stage."""
    import shutil
    import tempfile

    from llmplan.engine.cli import new_context
    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover
    from llmplan.engine.runner import Runner

    registry = discover()
    bound = load_plan(plan, registry, overrides)
    source = next((s.id for s in bound.stages if s.spec.uses == "model.source"), None)
    if source is None:
        return None
    ctx = new_context(registry, bound, json_mode=True)
    run_dir = Path(tempfile.mkdtemp(prefix="llmplan-bench-"))
    try:
        result = Runner(bound, ctx, run_dir, until=source).run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if result.exit_code:
        raise CliError(f"{plan}: the model source failed: {result.message}")
    found = ctx.model_source.gguf_file if ctx.model_source is not None else None
    return None if found is None else Path(found)


def llama_bin(build: str, say: Any) -> Path:
    """The directory of the llama.cpp tools, building them the first time (several minutes)."""
    env = foreign_env(LLAMA_CPU=build)
    say(f"bench: llama.cpp ({build}) from {_SCRIPT.name}")
    done = subprocess.run(["bash", str(_SCRIPT)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise CliError(f"building llama.cpp failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return Path(done.stdout.strip().splitlines()[-1]).parent


def gguf_for(kind: str, source: Path, bin_dir: Path, shipped: str | None = None) -> Path:
    """The GGUF llama.cpp runs for type `kind`: the plan's own file when that is its type (as shipped), else
    the file requantized to `kind` with llama-quantize, made once and cached."""
    if kind == shipped:
        return source
    out = bin_dir.parent / "models" / f"{source.stem}.requant-{kind}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(tmp), kind]
    done = subprocess.run(cmd, capture_output=True, text=True, env=foreign_env())
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise CliError(f"llama-quantize to {kind} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    tmp.replace(out)
    return out


def default_type(dtype: str, shipped: str) -> str:
    kind = shipped if dtype == STORED else GGUF_TYPES.get(dtype)
    if kind is None:
        raise CliError(f"--vs llama.cpp: no llama.cpp type for dtype {dtype!r} (have {', '.join(GGUF_TYPES)})")
    return kind


def _run_json(cmd: list[str]) -> list[dict[str, Any]]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=foreign_env())
    if done.returncode != 0:
        raise CliError(f"{Path(cmd[0]).name} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    text = done.stdout.strip()
    if text.startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def llama_bench(bin_dir: Path, gguf: Path, prompt: int, gen: int, threads: int) -> dict[str, float]:
    """llama-bench's pp (prompt tok/s) and tg at depth `prompt` (decode tok/s), one repetition each."""
    base = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json"]
    pp = _run_json([*base, "-p", str(prompt), "-n", "0"])[0]
    tg = _run_json([*base, "-p", "0", "-n", str(gen), "-d", str(prompt)])[0]
    return {"prefill": float(pp["avg_ts"]), "decode_b1": float(tg["avg_ts"])}


def batched_bench(bin_dir: Path, gguf: Path, prompt: int, gen: int, batch: int, threads: int) -> dict[str, float]:
    """llama-batched-bench: `batch` sequences of their own prompt, then `gen` tokens each; aggregate tg tok/s."""
    cmd = [
        str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(batch * (prompt + gen) + 64),
        "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(gen), "-npl", str(batch),
        "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl",
    ]  # fmt: skip
    row = _run_json(cmd)[-1]
    return {"decode_batch": float(row["speed_tg"]), "prefill_batch": float(row["speed_pp"])}


def bench_vs_llama_cpp(args: argparse.Namespace, say: Any, partial: Any = None) -> dict[str, Any]:
    """Alternating runs, llmplan then llama.cpp, per precision of the grid; see the module doc. `partial`,
    when given, is called with the result so far after each precision."""
    from llmplan.llm.kernels import native

    entries = getattr(args, "llama_type", None)
    shipped_file = plan_gguf(args.plan, args.set) if entries else None
    shipped = gguf_type(shipped_file).name if shipped_file is not None else None
    grid = llama_grid(args.dtype, entries, shipped, convert_dtype(args.plan, args.set))  # before the build
    bin_dir = llama_bin(args.llama_build, say)
    prompt, gen, batch = args.prompt_tokens, args.gen_tokens, max(args.batch)
    info = _machine_info(args.llama_build, bin_dir)
    result = _new_result(args, info)
    for dtype, kinds in grid:
        overrides = bench_overrides(args.plan, args.set, dtype=dtype, max_batch=batch, max_tokens=prompt + gen)
        say(f"bench: load {dtype or 'the plan dtype'}")
        loaded = load(args.plan, overrides)
        label = dtype or str(loaded.metric("load.convert", "dtype") or "?")
        source = loaded.ctx.model_source.gguf_file
        if source is None:
            raise CliError("--vs llama.cpp needs a plan whose model comes from a GGUF (model.source file:)")
        source = Path(source)
        if shipped is None:
            shipped = gguf_type(source).name
        ggufs = {kind: gguf_for(kind, source, bin_dir, shipped) for kind in kinds or [default_type(label, shipped)]}
        types = {kind: gguf_type(path) for kind, path in ggufs.items()}  # what each file is, from its header
        info["native_kernels"] = native.describe()
        resident = loaded.metric("load.to_device", "resident_weights")
        footprint = recorded_footprint(resident)
        if footprint:  # llmplan's resident weights against the GGUF, beside the files llama.cpp runs
            result.setdefault("memory", {})[label] = footprint
        model, cache, vocab = loaded.model, loaded.cache, loaded.ctx.model_config.vocab_size
        # llama.cpp keeps its KV cache in F16 unless told otherwise; what llmplan keeps goes beside it
        result["settings"].setdefault("kv_cache", {})[label] = str(cache.k.dtype).removeprefix("torch.")
        one, many = random_prompts(1, prompt, vocab, seed=1), random_prompts(batch, prompt, vocab, seed=batch)
        run_once(model, cache, one, min(8, gen))  # warm-up: lazy setup, allocator growth (within the cache)
        run_once(model, cache, many, min(4, gen))
        samples = _alternating_runs(args, say, label, (model, cache, one, many), ggufs, bin_dir)
        result["rows"] += _dtype_rows(label, batch, source, ggufs, types, resident, samples)
        del model, cache, loaded
        gc.collect()
        info["loadavg_end"] = machine()["loadavg"]
        fast = native.kernels()
        if fast is not None:  # how the kernels' team adapted to the load over the runs (#30)
            info["kernel_threads"] = fast.thread_stats()
        if partial is not None:  # each precision's rows as soon as they exist: a run on a busy machine is long
            partial(result)
    return result


def _machine_info(build: str, bin_dir: Path) -> dict[str, Any]:
    """The machine, its CPU features and the llama.cpp build's flags (as the build script recorded them)."""
    from .traffic import cpu_features

    flags_file = bin_dir.parent / ("BUILD_FLAGS" + ("" if build == "native" else f"-{build}"))
    info = machine() | {"cpu_features": cpu_features()}
    info["llama_cpp_build"] = flags_file.read_text().strip() if flags_file.is_file() else build
    return info


def _new_result(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """The result before any row: the plan, the machine and the settings a rerun needs."""
    return {
        "plan": args.plan,
        "machine": info,
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "gen_tokens": args.gen_tokens,
            "batch": max(args.batch),
            "runs": args.runs,
            "threads": args.threads,
            "set": list(args.set or []),  # the plan's overrides: what a rerun must pass again
        },
        "rows": [],
    }


Samples = tuple[dict[str, list[float]], dict[str, dict[str, list[float]]], list[float]]


def _alternating_runs(
    args: argparse.Namespace,
    say: Any,
    label: str,
    ours_setup: tuple[Any, Any, list[list[int]], list[list[int]]],
    ggufs: dict[str, Path],
    bin_dir: Path,
) -> Samples:
    """`args.runs` runs of one dtype, each llmplan then every llama.cpp type, batch 1 then batched: the samples
    per figure (ours, theirs per type) and the memory's plain read rate once a run. `ours_setup` is (model,
    cache, the batch-1 prompt, the batch prompts)."""
    model, cache, one, many = ours_setup
    prompt, gen, batch, threads = args.prompt_tokens, args.gen_tokens, max(args.batch), args.threads
    ours: dict[str, list[float]] = {f: [] for f in FIGURES}
    theirs = {kind: {f: [] for f in FIGURES} for kind in ggufs}
    memory: list[float] = []  # the memory's plain read rate, GB/s, once a run: what bounds batch-1 decode
    for r in range(args.runs):
        say(f"bench: {label} run {r + 1}/{args.runs} (llmplan, llama.cpp {', '.join(ggufs)}, alternating)")
        memory.append(read_rate(threads))
        run_once(model, cache, one, WARM_TOKENS)  # warm, as llama-bench warms before each of its measures
        a = run_once(model, cache, one, gen)
        ours["decode_b1"].append(a["decode_tok_s"])
        ours["prefill"].append(a["prefill_tok_s"])
        for kind, path in ggufs.items():
            for figure, value in llama_bench(bin_dir, path, prompt, gen, threads).items():
                theirs[kind][figure].append(value)
        ours["decode_batch"].append(run_once(model, cache, many, gen)["decode_tok_s"])
        for kind, path in ggufs.items():
            theirs[kind]["decode_batch"].append(
                batched_bench(bin_dir, path, prompt, gen, batch, threads)["decode_batch"]
            )
    return ours, theirs, memory


def _dtype_rows(
    label: str,
    batch: int,
    source: Path,
    ggufs: dict[str, Path],
    types: dict[str, GGUFType],
    resident: Any,
    samples: Samples,
) -> list[dict[str, Any]]:
    """One dtype's rows: each llama.cpp type's figures against ours, batch-1 decode with its read rates."""
    ours, theirs, memory = samples
    rows: list[dict[str, Any]] = []
    mine = read_per_token(resident) if resident else None
    for kind, path in ggufs.items():
        ran = _gguf_fields(types[kind], path, as_shipped=path == source)
        for figure in FIGURES:
            row = _row(figure, label, batch, ours[figure], theirs[kind][figure]) | ran
            if figure == "decode_b1" and mine:
                row |= _read_rates(row, mine, gguf_read_per_token(path), memory)
            rows.append(row)
    return rows


def _row(figure: str, dtype: str, batch: int, ours: list[float], theirs: list[float]) -> dict[str, Any]:
    mine, hers = summary(ours), summary(theirs)
    ratio = mine["median"] / hers["median"] if mine["median"] and hers["median"] else None
    return {"figure": figure, "dtype": dtype, "batch": batch if figure == "decode_batch" else 1, "llmplan": mine,
            "llama_cpp": hers, "ratio": ratio}  # fmt: skip


def _read_rates(row: dict[str, Any], mine: int, theirs: int, memory: list[float]) -> dict[str, Any]:
    """Batch-1 decode reads every weight once a token, so its tok/s is also a read rate: the bytes a token
    (llmplan's resident weights, llama.cpp's file but the embedding rows) and GB/s at the median tok/s; and
    each side's share of the best plain read of the memory in the same runs (`memory`, GB/s a run)."""
    rates = {
        side: None if row[side]["median"] is None else read * row[side]["median"] / 1e9
        for side, read in (("llmplan", mine), ("llama_cpp", theirs))
    }
    best = max(memory, default=0.0)
    shares = {side: None if rate is None or not best else rate / best for side, rate in rates.items()}
    return {"read_bytes": {"llmplan": mine, "llama_cpp": theirs}, "read_gb_s": rates,
            "memory_read_gb_s": summary(memory), "memory_share": shares}  # fmt: skip


def _gguf_fields(kind: GGUFType, path: Path, *, as_shipped: bool) -> dict[str, Any]:
    """The GGUF llama.cpp ran: its type as its header says, whether it is the plan's file untouched, its size."""
    return {"gguf_type": kind.name, "gguf_type_from": kind.source, "as_shipped": as_shipped,
            "gguf_file": path.name, "gguf_bytes": kind.file_bytes}  # fmt: skip


def vs_markdown(result: dict[str, Any]) -> str:
    m, s = result["machine"], result["settings"]
    load = m.get("loadavg") or []
    end = m.get("loadavg_end") or []
    lines = [
        f"# llmplan vs llama.cpp: {result['plan']}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; features {' '.join(m.get('cpu_features', []))}; "
        f"{s['threads']} threads on both sides; torch {m['torch']}.",
        f"llmplan native kernels: {m.get('native_kernels')}. llama.cpp build: {m.get('llama_cpp_build')}.",
        f"Load average {' '.join(f'{v:.2f}' for v in load)} at start, {' '.join(f'{v:.2f}' for v in end)} at the "
        "end (the CPU is shared: the runs alternate so both sides see the same load; read the ratios).",
        f"Prompt {s['prompt_tokens']} tokens, {s['gen_tokens']} generated, {s['runs']} alternating runs; tok/s "
        "median [min-max]. Decode at batch 1 against llama-bench tg at the prompt's depth, prefill against "
        f"llama-bench pp, batch {s['batch']} aggregate decode against llama-batched-bench.",
        *([f"Plan overrides: {' '.join('--set ' + o for o in s['set'])}."] if s.get("set") else []),
        *(
            [f"KV cache: llmplan {', '.join(f'{v} ({k})' for k, v in s['kv_cache'].items())}; llama.cpp float16 "
             "(its default)."]
            if s.get("kv_cache")
            else []
        ),
        "",
        "| figure | llmplan dtype | llama.cpp type | llmplan tok/s | llama.cpp tok/s | ratio |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        title = TITLES[row["figure"]] + (f" (batch {row['batch']})" if row["figure"] == "decode_batch" else "")
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        how = row.get("as_shipped")
        kind = row["gguf_type"] + ("" if how is None else " (as shipped)" if how else " (requantized)")
        lines.append(
            f"| {title} | {row['dtype']} | {kind} | {_fmt(row['llmplan'])} | {_fmt(row['llama_cpp'])} | {ratio} |"
        )
    reads = [row for row in result["rows"] if row.get("read_bytes")]
    if reads:
        lines += [
            "",
            "Batch-1 decode reads every weight once a token, so its speed is a read rate too (llmplan's resident "
            "weights, llama.cpp's GGUF but the embedding rows; GB a token at the median tok/s). Where both sides "
            "read at the memory's rate, the ratio is the ratio of the bytes. Beside each rate, its share of the "
            f"best plain read of the memory in the same runs (torch's sum over {READ_MIB} MiB on "
            f"{s['threads']} threads, once a run): a side near 100 % decodes as fast as the memory lets it.",
            "",
        ]
        lines += [f"- {row['dtype']} / {row['gguf_type']}: {_read_line(row)}" for row in reads]
    memory = result.get("memory") or {}
    if memory:
        files = {row["gguf_file"]: row for row in result["rows"] if "gguf_file" in row}
        sizes = ", ".join(f"{r['gguf_type']} {mib(r['gguf_bytes'])}" for r in files.values())
        lines += ["", f"Memory: llama.cpp's GGUFs {sizes}; llmplan's resident weights per dtype:", ""]
        lines += [f"- {dtype}: {footprint_line(fp, mib)}" for dtype, fp in memory.items()]
    return "\n".join(lines) + "\n"


def _read_line(row: dict[str, Any]) -> str:
    def side(name: str, key: str) -> str:
        rate, share = row["read_gb_s"][key], (row.get("memory_share") or {}).get(key)
        at = "" if rate is None else f" at {rate:.1f} GB/s" + ("" if share is None else f" ({share:.0%})")
        return f"{name} {row['read_bytes'][key] / 1e9:.3f} GB a token{at}"

    memory = row.get("memory_read_gb_s") or {}
    plain = "" if memory.get("max") is None else f"; the memory {_fmt(memory)} GB/s"
    return f"{side('llmplan', 'llmplan')}, {side('llama.cpp', 'llama_cpp')}{plain}"


def _fmt(s: dict[str, Any]) -> str:
    if s.get("median") is None:
        return "-"
    return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"
