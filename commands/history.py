"""CLI commands over the results database: `llmplan history` and `llmplan show ID`.

Registered through the `llmplan.commands` entry point group; both only read the database and
never create it (a missing file is one line and exit status 1). A file that is not an llmplan results
database is refused in one line and left as it was. A stored row that does not decode is listed as
damaged (one line on stderr says which), and `show` of one says so in one line; stored text is shown as
text, never read as console markup.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from llmplan.commands.arguments import positive
from llmplan.data_home import default_db, shown
from llmplan.engine.cli import CliError
from llmplan.llm.generation import shown_finish
from llmplan.stages.results.store import ResultsStore, StoreError

T = TypeVar("T")
_MARKERS = re.compile(r"<\|[^|<>]{1,40}\|>|</?s>")  # chat-template markers, hidden in the listing


def register(subparsers: Any) -> None:
    db_help = f"results database (default: {shown(default_db())}, the data home's; $LLMPLAN_HOME moves it)"
    history = subparsers.add_parser("history", help="list past results from the results database")
    history.add_argument("--db", default=None, help=db_help)
    history.add_argument("--limit", type=positive, default=20, help="how many results, newest first")
    history.add_argument("--json", action="store_true", help="one JSON object per result per line")
    history.add_argument("--evals", action="store_true", help="the stored `llmplan eval` figures instead of results")
    history.set_defaults(handler=cmd_history, needs_stages=False)  # a database read: no torch

    show = subparsers.add_parser("show", help="print one stored result")
    show.add_argument("id", type=int, help="result id (the first column of `llmplan history`)")
    show.add_argument("--db", default=None, help=db_help)
    show.add_argument("--json", action="store_true", help="the result as one JSON object")
    show.set_defaults(handler=cmd_show, needs_stages=False)


def _open(path: str) -> ResultsStore:
    try:
        return ResultsStore(path, create=False)
    except StoreError as bad:
        hint = " (run a plan with output.cache first)" if "no results" in str(bad) else ""
        raise CliError(f"{bad}{hint}") from None


def _read(args: argparse.Namespace, action: Callable[[ResultsStore], T]) -> T:
    args.db = str(default_db()) if args.db is None else args.db  # a `--db` is relative to here
    try:
        with _open(args.db) as store:
            return action(store)
    except StoreError as bad:
        raise CliError(str(bad)) from None


def _damaged_note(db: str, rows: list[dict[str, Any]]) -> None:
    damaged = [r for r in rows if "damaged" in r]
    if damaged:
        ids = ", ".join(str(r["id"]) for r in damaged[:5]) + (", …" if len(damaged) > 5 else "")
        print(
            f"{db}: result {ids} {'is' if len(damaged) == 1 else 'are'} damaged ({damaged[0]['damaged']}); "
            "listed as damaged, never replayed",
            file=sys.stderr,
        )


def cmd_evals(args: argparse.Namespace) -> int:
    """`history --evals`: the newest stored evaluations (plan, its hash, the reference, the main figures)."""
    rows = _read(args, lambda store: store.evals(limit=args.limit))
    if args.json:
        for row in rows:
            print(json.dumps(row, ensure_ascii=False, default=str))
        return 0
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(f"evaluations in {args.db}"), box=box.SIMPLE_HEAD)
    for column in ("id", "time", "plan", "plan hash", "against", "perplexity", "KL mean", "top-1"):
        right = column in ("id", "perplexity", "KL mean", "top-1")
        table.add_column(column, justify="right" if right else "left", overflow="fold")  # narrow: folded, not cut
    for row in rows:
        figures = row.get("figures") or {}
        name = f"{row['plan']} ({row['change']})" if row.get("change") else str(row.get("plan"))
        cells = [str(row["id"]), _short_time(str(row.get("time") or "")), name, str(row.get("plan_hash") or "")[:12]]
        if "damaged" in row:
            cells = [str(row["id"]), "", str(row.get("plan")), "", f"damaged: {row['damaged']}", "", "", ""]
        else:
            cells += [str(row["reference"]), *(_figure(figures, key) for key in ("perplexity", "kl_mean")),
                      _figure(figures, "top1_agreement", 100, " %")]  # fmt: skip
        table.add_row(*(Text(cell) for cell in cells))
    Console(highlight=False, markup=False, emoji=False).print(table if rows else "no evaluations yet")
    return 0


def _figure(figures: dict[str, Any], key: str, scale: float = 1.0, unit: str = "") -> str:
    value = figures.get(key)
    return f"{value * scale:.4g}{unit}" if isinstance(value, int | float) else "-"


def cmd_history(args: argparse.Namespace) -> int:
    if getattr(args, "evals", False):
        return cmd_evals(args)
    rows = _read(args, lambda store: store.history(args.limit))
    _damaged_note(args.db, rows)
    if args.json:
        for row in rows:
            print(json.dumps(_public(row), ensure_ascii=False, default=str))
        return 0
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(f"results in {args.db}"), box=box.SIMPLE_HEAD)
    for column, justify in (
        ("id", "right"),
        ("time", "left"),
        ("plan", "left"),
        ("model", "left"),
        ("prompt", "left"),
        ("tokens", "right"),
        ("tok/s", "right"),
        ("finish", "left"),
    ):
        wide = column == "prompt"
        table.add_column(
            column,
            justify=justify,
            no_wrap=column in ("id", "tokens", "tok/s"),
            min_width=12 if wide else None,
            max_width=40 if wide else None,
            overflow="fold" if column == "model" else "ellipsis",  # a model's name is folded, never cut
        )  # type: ignore[arg-type]
    for row in rows:
        cells = _damaged_cells(row) if "damaged" in row else _cells(row)
        table.add_row(*(Text(cell) for cell in cells))  # Text: stored text is never read as markup
    Console(highlight=False, markup=False, emoji=False).print(table if rows else "no results yet")  # cells as written
    return 0


def _cells(row: dict[str, Any]) -> list[str]:
    usage = row["usage"]
    speed = row["timings"].get("decode_tokens_per_s")
    return [
        str(row["id"]),
        _short_time(str(row.get("run_time") or row.get("created") or "")),
        str(row.get("plan") or ""),
        model_name(row),
        _excerpt(row["prompt_excerpt"]),
        f"{usage['prompt_tokens']}+{usage['completion_tokens']}",
        "cache" if row.get("from_cache") else _speed(speed),
        _finish(row),
    ]


def _finish(row: dict[str, Any]) -> str:
    """The finish reason; under a format, which one, and whether the length limit cut the answer short."""
    said = shown_finish(row["finish_reason"], row["finish_detail"])
    fmt = row.get("format")
    if not fmt:
        return said
    if fmt.get("complete") is False:
        return f"{said} (cut short: {fmt['kind']} may not parse)"
    return f"{said} · {fmt['kind']}"


def _damaged_cells(row: dict[str, Any]) -> list[str]:
    time_text = _short_time(str(row.get("run_time") or row.get("created") or ""))
    return [str(row.get("id")), time_text, str(row.get("plan") or ""), "-", "(damaged)", "-", "-", "damaged"]


def _speed(value: Any) -> str:
    return f"{float(value):.1f}" if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def cmd_show(args: argparse.Namespace) -> int:
    row = _read(args, lambda store: store.get(args.id))
    if row is None:
        raise CliError(f"no result with id {args.id} in {args.db}")
    if "damaged" in row:
        raise CliError(f"{args.db}: result {args.id} is damaged ({row['damaged']}); it is never replayed")
    if args.json:
        print(json.dumps(_public(row), ensure_ascii=False, default=str))
        return 0
    usage = row["usage"]
    out = sys.stdout
    out.write(f"result {row['id']}  ·  run {row['run_id']} ({row.get('run_time')})  ·  plan {row.get('plan')}\n")
    files = f"  ·  files {row['model_fingerprint']}" if row.get("model") and row.get("model_fingerprint") else ""
    out.write(f"model {model_name(row, whole=True)}{files}  ·  device {row.get('device') or '-'}\n")
    out.write(f"request {row['request_id']}  ·  finish {_finish(row)}")
    out.write(f"  ·  {usage.get('prompt_tokens', 0)} prompt + {usage.get('completion_tokens', 0)} generated tokens\n")
    fmt = row.get("format")
    if fmt:
        out.write(f"format {fmt['kind']} {fmt['sha256'][:12]}: {fmt['summary']}\n")
    timings = {k: v for k, v in row["timings"].items() if v is not None}
    if timings:
        out.write("timings " + ", ".join(f"{k}={_number(v)}" for k, v in timings.items()) + "\n")
    if row.get("error"):
        out.write(f"error: {row['error']}\n")
    out.write("\nprompt:\n" + (row.get("prompt_excerpt") or "") + "\n\nanswer:\n" + (row.get("text") or "") + "\n")
    for rank, cand in enumerate(row["candidates"], start=1):
        out.write(f"\ncandidate {rank} (score {_number(cand.get('score'))}):\n{cand.get('text', '')}\n")
    return 0


def model_name(row: dict[str, Any], whole: bool = False) -> str:
    """The model a result's run ran, by its name (a GGUF's file stem, an HF directory's name); a run stored
    before llmplan recorded names (schema v5) by its files' fingerprint, the first 8 characters unless `whole`."""
    name = row.get("model")
    if isinstance(name, str) and name.strip():
        return name
    fingerprint = str(row.get("model_fingerprint") or "-")
    return fingerprint if whole else fingerprint[:8]


def _public(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "run_dir" or v is not None}


def _excerpt(text: str, limit: int = 48) -> str:
    """The user's words, cut at the end; an older row's templated prompt by its end (the question), unmarked."""
    flat = " ".join(_MARKERS.sub(" ", text).split())
    if len(flat) <= limit:
        return flat
    if _MARKERS.search(text):  # a row stored before the user's words were: the question ends the template
        return "…" + flat[-(limit - 1) :]
    return flat[: limit - 1] + "…"


def _short_time(iso: str) -> str:
    # "2026-11-30T14:20:05+00:00" -> "11-30 14:20" (UTC, as stored; `show` has the full time)
    return iso[5:16].replace("T", " ")


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
