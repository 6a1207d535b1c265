"""`llmplan bench`'s arguments: light to import (no torch), so `llmplan --help` starts quickly.

The measuring code (commands/bench/command.py and what it imports) is loaded when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from llmplan.commands.arguments import positive
from llmplan.engine.cli import add_model_option


def cmd_bench(args: argparse.Namespace) -> int:
    from .command import cmd_bench as run

    return run(args)


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="measure load, prefill, decode and memory of a plan's model")
    bench.add_argument("plan", nargs="?", help="the plan (with --model and no plan: the default plan)")
    bench.add_argument("--prompt-tokens", type=positive, default=128, help="prompt length (random ids)")
    bench.add_argument("--gen-tokens", type=positive, default=128, help="tokens generated per row (EOS ignored)")
    bench.add_argument("--batch", type=_int_list, default=[1, 4, 16], help="batch sizes, e.g. 1,4,16")
    bench.add_argument("--runs", type=positive, default=3, help="measured runs per batch size (after a warm-up)")
    bench.add_argument(
        "--vs",
        choices=["transformers", "llama-server", "llama.cpp"],
        help="the reference, alternating (llama-server: --serve; llama.cpp: llama-bench and llama-batched-bench)",
    )
    bench.add_argument(
        "--llama-build", choices=["native", "avx2"], default="native", help="--vs llama.cpp: avx2 = no AVX-512"
    )
    bench.add_argument(
        "--llama-type",
        type=_llama_types,
        metavar="[DTYPE=]TYPE,...",
        help="--vs llama.cpp: llama.cpp's GGUF types, e.g. Q8_0,Q4_1,as-shipped (as-shipped or the GGUF's own "
        "type: the plan's file untouched; else requantized), each beside the dtype closest in bits or DTYPE",
    )
    bench.add_argument("--format", choices=["md", "json", "csv"], default="md")
    bench.add_argument("--set", action="append", default=[], metavar="ID.PARAM=VALUE", help="override a parameter")
    bench.add_argument("--dtype", type=_str_list, help="a grid over the convert stage's dtype, e.g. fp32,int8")
    bench.add_argument("--no-cold", action="store_true", help="skip the cold (page-cache dropped) load")
    bench.add_argument("--out", metavar="PREFIX", help="also write PREFIX.json and PREFIX.md")
    bench.add_argument("--mix", type=positive, metavar="N", help="N requests of mixed lengths: static vs scheduler")
    bench.add_argument("--serve", action="store_true", help="`llmplan serve` under concurrent streaming clients")
    bench.add_argument("--clients", type=_int_list, default=[1, 4, 16], help="--serve: concurrent clients per level")
    bench.add_argument("--time-limit", type=float, default=600.0, help="--serve: seconds per level at most")
    bench.add_argument("--threads", type=positive, default=2, help="--serve, --vs llama.cpp: llama.cpp's threads (-t)")
    bench.add_argument("--slots", type=positive, default=16, help="--mix: batch size and scheduler slots")
    bench.add_argument("--max-step-tokens", type=positive, default=512, help="--mix: scheduler tokens per step")
    bench.add_argument("--mix-prompts", type=_range, default=(16, 512), metavar="LO-HI", help="--mix: prompt lengths")
    bench.add_argument("--mix-outputs", type=_range, default=(16, 256), metavar="LO-HI", help="--mix: output lengths")
    add_model_option(bench)
    bench.set_defaults(handler=cmd_bench)


def _llama_types(text: str) -> list[tuple[str | None, str]]:
    from .llama_cpp import parse_llama_types  # only when the option is given: it reads gguf-py's type table

    try:
        return parse_llama_types(text)
    except ValueError as bad:
        raise argparse.ArgumentTypeError(str(bad)) from None


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        pair = (int(lo), int(hi))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI, e.g. 16-512, got {text!r}") from None
    if not sep or not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return pair


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be at least 1")
    return values


def _str_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated names")
    return values
