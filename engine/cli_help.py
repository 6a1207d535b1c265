"""How `llmplan … --help` reads: every default shown, and an example of each command at the end.

Plugin commands get the same: the top-level parser's class is inherited by every subparser argparse makes,
and `add_examples` fills the epilog of a command that has none from EXAMPLES (a third-party command may set
its own).
"""

from __future__ import annotations

import argparse
from typing import Any

# What a first-day user types; each line runs as written from a fresh clone (after `make run`).
EXAMPLES: dict[str, list[str]] = {
    "run": [
        "llmplan run plans/llama-int8.yaml",
        'llmplan run plans/llama-int8.yaml --prompt "Why is the sky blue?" --set generate.max_new_tokens=64',
        "llmplan run --model ~/models/my-llama --report     # your model, the default plan, a report",
    ],
    "validate": ["llmplan validate plans/*.yaml", "llmplan validate --deep plans/llama-int8.yaml --memory 2G"],
    "graph": ["llmplan graph plans/llama-int8.yaml -o plan.svg"],
    "stages": ["llmplan stages", "llmplan stages compute.generate     # one stage, its options in full"],
    "schema": ["llmplan schema > plan.schema.json"],
    "history": ["llmplan history --limit 5", "llmplan history --json | head -1"],
    "show": ["llmplan show 12", "llmplan show 12 --json"],
    "report": ["llmplan report ~/.local/share/llmplan/runs/20261203-071200-llama-int8 -o /tmp/report"],
    "tokenize": [
        'llmplan tokenize plans/llama-int8.yaml "Hello, world"',
        'llmplan tokenize plans/llama-int8.yaml "Hi" --chat --no-bos',
        "llmplan tokenize plans/llama-int8.yaml --decode 1,2,3",
    ],
    "bench": ["llmplan bench plans/llama-int8.yaml --vs transformers", "llmplan bench plans/llama-int8.yaml --mix 64"],
    "eval": ["llmplan eval plans/llama-int8.yaml plans/llama-int4.yaml --dtypes bf16,int8,int4"],
    "compare": [
        "llmplan compare plans/llama-*.yaml --picture compare.svg",
        "llmplan compare plans/llama-int8.yaml plans/llama-int4.yaml --batch 1,4 --runs 5 --out /tmp/compare",
    ],
    "serve": [
        "llmplan serve plans/llama-int8.yaml --port 8000",
        "llmplan serve plans/qwen2.5-0.5b-chat.yaml --host 0.0.0.0 --api-key KEY --set generate.temperature=0.2",
    ],
    "models": ["llmplan models", "llmplan models rm SmolLM2-135M-Instruct.Q4_1"],
    "chat": ['llmplan chat plans/llama-int8.yaml --system "Answer in one sentence." --set generate.temperature=0.2'],
}
_HIDDEN_DEFAULTS = {"key", "token", "secret", "password"}  # a default read from the environment stays unseen


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs as written (examples keep their lines); `(default: X)` after any option with a real default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = default_text(action)
        return f"{text} (default: {shown})".strip() if shown is not None else text


def default_text(action: argparse.Action) -> str | None:
    """The default worth saying of an option, or None (none, a flag, already said, or a secret)."""
    text, default = action.help or "", action.default
    if "%(default)" in text or "default" in text.lower() or action.help == argparse.SUPPRESS:
        return None
    if default in (None, False, [], "", argparse.SUPPRESS) or _HIDDEN_DEFAULTS & set(action.dest.split("_")):
        return None
    if not action.option_strings and action.nargs not in ("?", "*"):
        return None
    return ",".join(map(str, default)) if isinstance(default, list | tuple) else "%(default)s"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help is HelpFormatter's (subparsers are made of this class too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def add_examples(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Give every command without an epilog its examples from EXAMPLES, and every option with a default but
    no help a line saying the default (argparse shows no line at all for an option without help)."""
    for name, parser in subparsers.choices.items():
        for action in parser._actions:
            shown = default_text(action) if action.help is None else None
            if shown is not None:
                action.help = f"(default: {shown})"
        lines = EXAMPLES.get(name)
        if lines and not parser.epilog:
            parser.epilog = "example:\n" + "\n".join(f"  {line}" for line in lines)
