"""`llmplan eval PLAN... [--text FILE] [--ref PLAN]` — what a precision costs in quality.

Each plan's model is loaded through its own stages (as `llmplan bench` does: the plan's precision, kernels and
threads), then scored on the same tokens as the reference (default: the first plan in fp32): perplexity, the
KL-divergence of the next-token distributions (mean, p99), top-1 agreement, per-layer hidden-state drift, and
the same-token rate of free-running greedy continuations. See llm/evaluation/quality.py for what each figure means.

The default text ships with the installed Python itself — the documentation topics of `pydoc_data` — so every
machine scores the same words without fetching anything; `--text FILE` scores the user's own.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from llmplan.commands import eval_store

GREEDY_PROMPT_TOKENS = 64


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "eval",
        help="perplexity and divergence from a reference plan (what a precision costs in quality)",
        description=(
            "Score plans on the same text: perplexity, KL-divergence from a reference (default: the first plan "
            "in fp32), top-1 agreement, per-layer drift and the greedy same-token rate.\n\n"
            "example: llmplan eval plans/llama-int8.yaml plans/llama-int4.yaml --chunks 4"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("plans", nargs="+", metavar="PLAN")
    parser.add_argument("--text", metavar="FILE", help="UTF-8 text to score (default: Python's pydoc_data topics)")
    parser.add_argument("--ref", metavar="PLAN", help="the reference plan (default: the first PLAN in fp32)")
    parser.add_argument("--context", type=int, default=512, metavar="N", help="tokens per chunk (default 512)")
    parser.add_argument("--chunks", type=int, default=8, metavar="N", help="chunks scored (default 8)")
    parser.add_argument(
        "--greedy", type=int, default=32, metavar="N", help="greedy tokens per prompt for the same-token rate (0: off)"
    )
    parser.add_argument("--prompts", type=int, default=4, metavar="N", help="greedy prompts (default 4)")
    parser.add_argument(
        "--dtypes", metavar="LIST", help="also score the first plan with these weight dtypes (e.g. bf16,int8,int4)"
    )
    parser.add_argument(
        "--kv-dtypes", metavar="LIST", help="also score the first plan with these KV cache dtypes (fp32,bf16,fp16)"
    )
    parser.add_argument("--format", choices=["md", "json"], default="md")
    parser.add_argument(
        "--db",
        default=None,
        metavar="PATH",
        help="results database the figures are stored in (default: results.sqlite in the data home, "
        "$LLMPLAN_HOME or ~/.local/share/llmplan)",
    )
    parser.add_argument("--no-store", action="store_true", help="do not store the figures in the results database")
    parser.add_argument("--set", action="append", default=[], metavar="ID.PARAM=VALUE", help="override every plan")
    parser.set_defaults(handler=run)


def default_text() -> str:
    """Python's own documentation topics, in a fixed order (the same text on every machine of one Python)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


# A --text file is read only as far as the chunks need: at most TEXT_BYTES_PER_TOKEN bytes a token wanted (English
# is ~4, code ~3, CJK ~3), never more than TEXT_READ_LIMIT (a 300 MB file must not be read whole, nor tokenized).
TEXT_BYTES_PER_TOKEN = 32
TEXT_READ_LIMIT = 8 << 20
SCORED_TOKENS_LIMIT = 1 << 20  # --context x --chunks: over a million tokens scored is a mistake, not a plan


def read_text(path: str | None, context: int = 512, chunks: int = 8) -> tuple[str, str]:
    """(text, where it came from): the default text, or the head of a regular file the chunks need."""
    from llmplan.engine.cli import CliError

    if path is None:
        text = default_text()
        check_room(f"pydoc_data.topics (Python {sys.version.split()[0]})", len(text.encode()), context, chunks)
        return text, f"pydoc_data.topics (Python {sys.version.split()[0]})"
    from llmplan.bounded_read import NotRegularFileError, read_head
    from llmplan.llm.trust import describe_os_error

    wanted = min(TEXT_READ_LIMIT, context * chunks * TEXT_BYTES_PER_TOKEN)
    try:
        data, size = read_head(path, wanted, "text file")
    except (NotRegularFileError, IsADirectoryError) as bad:  # a FIFO, device or directory: refused at once
        raise CliError(str(bad)) from None
    except OSError as bad:
        raise CliError(describe_os_error(path, bad)) from None
    whole = len(data) >= size
    try:  # a head cut inside a character keeps the characters before it; invalid bytes are refused
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=whole)
    except UnicodeDecodeError as bad:
        raise CliError(f"{path}: not UTF-8 text (byte {bad.start})") from None
    check_room(path, size, context, chunks)
    return text, path if whole else f"{path} (its first {len(data)} bytes)"


def check_room(source: str, size: int, context: int, chunks: int) -> None:
    """Refuse, before any model loads, what no text could hold: over SCORED_TOKENS_LIMIT tokens, or a text
    too short for one chunk (a token is at least one byte; +1: a tokenizer's leading piece)."""
    from llmplan.engine.cli import CliError

    if context * chunks > SCORED_TOKENS_LIMIT:
        raise CliError(
            f"--chunks {chunks} x --context {context}: more than {SCORED_TOKENS_LIMIT} tokens to score; give fewer"
        )
    if context > size + 1:
        raise CliError(f"{source}: {size} bytes, fewer than the {context} tokens of one chunk (--context)")


def check_args(args: argparse.Namespace) -> None:
    """The scoring settings `evaluate` needs (eval's and compare's flags alike)."""
    from llmplan.engine.cli import CliError

    for flag, value, low in (("--context", args.context, 4), ("--chunks", args.chunks, 1)):
        if value < low:
            raise CliError(f"{flag}: must be at least {low} (got {value})")
    if args.greedy < 0 or args.prompts < 0:
        raise CliError("--greedy and --prompts: must not be negative")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    text, source = read_text(args.text, args.context, args.chunks)
    db = _db(args)
    if db is not None:
        eval_store.check_db(db)  # before the models load: a database that cannot take the figures is one line
    report = evaluate(args, text, source)
    if db is not None:
        ids = eval_store.store(db, report, text)
        print(f"eval: stored in {db} (evals {', '.join(map(str, ids))})", file=sys.stderr)
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        print(markdown(report))
    return 0


def _db(args: argparse.Namespace) -> str | None:
    from llmplan.data_home import default_db

    return None if getattr(args, "no_store", False) else (getattr(args, "db", None) or str(default_db()))


@dataclass(frozen=True)
class Variant:
    """One model to score: a plan, with what is changed in it for this row."""

    plan: str
    overrides: tuple[str, ...] = ()
    change: str = ""  # shown beside the plan's name: "weights int4", "kv bf16"


def variants(args: argparse.Namespace) -> tuple[Variant, list[Variant]]:
    """The reference and the rows: every PLAN as written, then the first plan at each --dtypes / --kv-dtypes."""
    from llmplan.commands.bench.measure import CONVERT, PLACE, stage_ids
    from llmplan.engine.cli import CliError

    first = args.plans[0]
    ids = stage_ids(first, args.set)
    rows = [Variant(plan) for plan in args.plans]
    for flag, values, stage, key, what in (
        ("--dtypes", args.dtypes, CONVERT, "dtype", "weights"),
        ("--kv-dtypes", args.kv_dtypes, PLACE, "kv_cache.dtype", "kv"),
    ):
        if not values:
            continue
        if stage not in ids:
            raise CliError(f"{flag}: {first} has no {stage} stage")
        for value in (v.strip() for v in values.split(",") if v.strip()):
            rows.append(Variant(first, (f"{ids[stage]}.{key}={value}",), f"{what} {value}"))
    if args.ref:
        return Variant(args.ref), rows
    if CONVERT not in ids:
        raise CliError(f"{first}: no {CONVERT} stage to make the fp32 reference from; give --ref PLAN")
    return Variant(first, (f"{ids[CONVERT]}.dtype=fp32",), "weights fp32"), rows


def _load(variant: Variant, overrides: list[str], max_tokens: int) -> Any:
    from llmplan.commands.bench.measure import bench_overrides, load

    wanted = [*overrides, *variant.overrides]
    return load(variant.plan, bench_overrides(variant.plan, wanted, dtype=None, max_batch=1, max_tokens=max_tokens))


def _label(variant: Variant, loaded: Any, overrides: list[str]) -> dict[str, Any]:
    cache = loaded.cache
    return {
        "plan": loaded.bound.plan.name,
        "plan_file": str(variant.plan),
        "plan_hash": eval_store.plan_hash(variant.plan, [*overrides, *variant.overrides]),
        "change": variant.change,
        "weights": str(loaded.metric("load.convert", "dtype") or "as stored"),
        "activations": _activations(loaded),
        "kv_cache": str(cache.k.dtype).removeprefix("torch.") if cache is not None else None,
    }


def _activations(loaded: Any) -> str:
    """The residual stream's dtype, and how a GGUF's block kernels round the products' inputs."""
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    bits = loaded.metric("load.convert", "activation_bits")
    return f"{dtype} (products: x to {bits} bits per 32)" if bits else dtype


def evaluate(args: argparse.Namespace, text: str, source: str) -> dict[str, Any]:
    """Load the reference and every plan, score them chunk by chunk on the same tokens, summarise."""
    from llmplan.commands.tokenize import load_tokenizer
    from llmplan.engine.cli import CliError
    from llmplan.engine.console import RichProgress
    from llmplan.llm.evaluation import quality

    need = max(args.context, GREEDY_PROMPT_TOKENS + args.greedy + 1)
    ref_variant, rows_wanted = variants(args)
    # The tokenizer loads on its own (loading a model stops at `load.to_device`, which does not need it): the
    # text is cut into chunks before any model loads, so a text that holds none costs no load.
    tok = load_tokenizer(ref_variant.plan, args.set)
    ids = tok.encode(text, add_bos=False, special=False)
    pieces = text_chunks(ids, args, source)
    ref = _load(ref_variant, args.set, need)
    models = [_load(variant, args.set, need) for variant in rows_wanted]
    tokenizers = {ref_variant.plan: tok}
    probe = ids[:256]
    for variant, loaded in zip(rows_wanted, models, strict=True):
        if variant.plan not in tokenizers:
            tokenizers[variant.plan] = load_tokenizer(variant.plan, args.set)
        theirs = tokenizers[variant.plan].encode(tok.decode(probe), add_bos=False, special=False)
        if loaded.model.cfg.vocab_size != ref.model.cfg.vocab_size or theirs != probe:
            raise CliError(f"{variant.plan}: its tokenizer differs from the reference's: nothing to compare")
        check_shapes(variant.plan, loaded.model.cfg, ref_variant.plan, ref.model.cfg)
    perplexity = [quality.Perplexity() for _ in models]
    ref_perplexity = quality.Perplexity()
    divergence = [quality.Divergence() for _ in models]
    progress = RichProgress()
    with progress.task("scoring", total=len(pieces) * (len(models) + 1)) as advance:
        for chunk in pieces:
            ref_pass = quality.score_chunk(ref.model, chunk, ref.cache)
            ref_perplexity.add(ref_pass, chunk)
            advance(1)
            for i, loaded in enumerate(models):
                ours = quality.score_chunk(loaded.model, chunk, loaded.cache)
                perplexity[i].add(ours, chunk)
                divergence[i].add(ours, ref_pass)
                advance(1)
    prompts = [chunk[:GREEDY_PROMPT_TOKENS] for chunk in pieces[: args.prompts]] if args.greedy else []
    ref_greedy = _greedy(ref, prompts, args.greedy)
    rows = []
    for i, (variant, loaded) in enumerate(zip(rows_wanted, models, strict=True)):
        row = {**_label(variant, loaded, args.set), **perplexity[i].summary(), **divergence[i].summary()}
        row["same_token_rate"] = quality.same_token_rate(_greedy(loaded, prompts, args.greedy), ref_greedy)
        rows.append(row)
    return {
        "text": source,
        "context": args.context,
        "chunks": len(pieces),
        "reference": {**_label(ref_variant, ref, args.set), **ref_perplexity.summary()},
        "plans": rows,
    }


def text_chunks(ids: list[int], args: argparse.Namespace, source: str) -> list[list[int]]:
    """The chunks scored: --chunks of them, or as many as the text holds (said on stderr), never none."""
    from llmplan.engine.cli import CliError
    from llmplan.llm.evaluation import quality

    pieces = quality.chunks(ids, args.context, args.chunks)
    if not pieces:
        raise CliError(f"{source}: {len(ids)} tokens, fewer than one chunk of --context {args.context}")
    if len(pieces) < args.chunks:
        print(
            f"eval: {source} holds {len(pieces)} chunks of --context {args.context} tokens; scoring those, "
            f"not --chunks {args.chunks}",
            file=sys.stderr,
        )
    return pieces


def check_shapes(plan: str, cfg: Any, ref_plan: str, ref_cfg: Any) -> None:
    """Hidden states are compared layer by layer: a model of another width or depth has nothing to set beside
    the reference's (tensors of different sizes)."""
    from llmplan.engine.cli import CliError

    if (cfg.dim, cfg.n_layers) != (ref_cfg.dim, ref_cfg.n_layers):
        raise CliError(
            f"{plan}: {cfg.n_layers} layers of width {cfg.dim}, the reference {ref_plan}'s {ref_cfg.n_layers} of "
            f"width {ref_cfg.dim}: layer drift cannot be compared; compare plans of one model's shape"
        )


def _greedy(loaded: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Free-running greedy continuations, one prompt at a time (batch 1: no padding to differ on)."""
    from llmplan.llm.generation import LoopOptions, ModelRunner, PromptRequest, Vocabulary, run_requests
    from llmplan.llm.sampling import SamplingParams

    runner = loaded.ctx.model_runner or ModelRunner(loaded.model, loaded.cache)
    no_eos = Vocabulary(tokenizer=None, eos_ids=frozenset(), pad_id=0, vocab_size=loaded.model.cfg.vocab_size)
    greedy = SamplingParams.trusted(max_new_tokens=tokens)
    out = []
    for prompt in prompts:
        (one,) = run_requests(
            runner, loaded.cache, [PromptRequest(prompt, greedy)], LoopOptions(static_batches=True), no_eos
        ).outcomes
        out.append(list(one.generation.tokens))
    return out


def _num(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _name(row: dict[str, Any]) -> str:
    return f"{row['plan']} ({row['change']})" if row["change"] else row["plan"]


def markdown(report: dict[str, Any]) -> str:
    ref = report["reference"]
    lines = [
        f"Text: {report['text']}; {report['chunks']} chunks of {report['context']} tokens, "
        f"{ref['tokens_scored']} tokens scored (the second half of each chunk).",
        f"Reference: {ref['plan']} with {ref['weights']} weights and a {ref['kv_cache']} KV cache — perplexity "
        f"{_num(ref['perplexity'], 6)}.",
        "",
        "| plan | weights | activations | KV cache | perplexity | Δ ppl | KL mean | KL p99 | top-1 agree | "
        "same greedy | max layer drift |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["plans"]:
        drift = [d for d in row["layer_drift"] if not math.isnan(d)]
        delta = (row["perplexity"] / ref["perplexity"] - 1) * 100
        lines.append(
            f"| {_name(row)} | {row['weights']} | {row['activations']} | {row['kv_cache']} | "
            f"{_num(row['perplexity'], 6)} | "
            f"{delta:+.2f} % | {_num(row['kl_mean'])} | {_num(row['kl_p99'])} | "
            f"{_num(row['top1_agreement'] * 100, 4)} % | {_num(row['same_token_rate'] * 100, 4)} % | "
            f"{_num(max(drift) if drift else math.nan)} |"
        )
    return "\n".join(lines)
