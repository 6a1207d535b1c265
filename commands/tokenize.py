"""`llmplan tokenize PLAN "text"` — run only what the tokenizer needs, print ids and tokens (llama-tokenize).

`--decode 1,2,3` goes the other way; `--chat` renders the text as one user message through the
model's chat template first; `--json` prints one machine-readable object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from llmplan.engine.cli import add_model_option


def register(sub: Any) -> None:
    parser = sub.add_parser("tokenize", help="text to token ids (or ids to text) with a plan's tokenizer")
    parser.add_argument("plan", nargs="?", help="the plan (with --model and no plan: the default plan)")
    parser.add_argument("text", nargs="?", default=None)
    parser.add_argument("--decode", metavar="IDS", help="comma-separated ids to turn back into text")
    parser.add_argument("--chat", action="store_true", help="render as a user message via the chat template")
    parser.add_argument("--no-bos", action="store_true", help="never add BOS")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="ID.PARAM=VALUE")
    add_model_option(parser)
    parser.set_defaults(handler=run)


def load_tokenizer(plan: str, overrides: list[str]) -> Any:
    """Run the plan up to its load.tokenizer stage (found from the graph) and return the tokenizer."""
    import tempfile

    from llmplan.engine.cli import CliError
    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover
    from llmplan.engine.runner import Runner

    registry = discover()
    bound = load_plan(plan, registry, overrides)
    stage = next((b.id for b in bound.stages if "tokenizer" in b.cls.writes), None)
    if stage is None:
        raise CliError(f"{plan}: no stage writes the tokenizer (add a load.tokenizer stage)")
    ctx = registry.context_cls()
    with tempfile.TemporaryDirectory(prefix="llmplan-tokenize-") as run_dir:
        result = Runner(bound, ctx, Path(run_dir), until=stage).run()
    if result.exit_code:
        raise CliError(f"error: {result.message}")
    return ctx.tokenizer


def run(args: argparse.Namespace) -> int:
    from llmplan.engine.cli import CliError, settle_plan
    from llmplan.llm.text import TokenizerError

    if args.model is not None and args.text is None and args.plan is not None and not Path(args.plan).is_file():
        args.plan, args.text = None, args.plan  # `tokenize --model DIR "text"`: the one positional is the text
    settle_plan(args)
    if (args.text is None) == (args.decode is None):
        raise CliError("tokenize: give TEXT, or --decode IDS")
    tok = load_tokenizer(args.plan, args.set)
    try:
        if args.decode is not None:
            try:
                ids = [int(part) for part in args.decode.replace(" ", "").split(",") if part]
            except ValueError:
                raise CliError(f"--decode: expected comma-separated integers (got {args.decode!r})") from None
            text = tok.decode(ids)
            print(json.dumps({"ids": ids, "text": text}, ensure_ascii=False) if args.json else text)
            return 0
        # As `llmplan run` encodes it: the text as text; special tokens only from the chat template.
        if args.chat:
            text, ids = tok.encode_chat([{"role": "user", "content": args.text}], add_generation_prompt=True)
        else:
            text = args.text
            ids = tok.encode(text, add_bos=False if args.no_bos else None, special=False)
    except TokenizerError as bad:
        raise CliError(str(bad)) from None
    tokens = [tok.id_to_token(i) for i in ids]
    if args.json:
        print(json.dumps({"text": text, "ids": ids, "tokens": tokens}, ensure_ascii=False))
        return 0
    for index, token in zip(ids, tokens, strict=True):
        sys.stdout.write(f"{index:>7} -> {token!r}  {tok.decode([index])!r}\n")
    sys.stdout.write(f"{len(ids)} tokens\n")
    return 0
