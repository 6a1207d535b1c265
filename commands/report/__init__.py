"""The report of a run: pictures of the plan, the data flow, the model, memory, layers, attention, generation.

`build_report(run_dir)` writes RUN_DIR/report/*.svg and a self-contained RUN_DIR/report/index.html.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# What the pictures need that a plan may not observe (it costs time): `run --report` turns these on for its
# run (engine/cli.py). Attention with its defaults: layer 0, head 0, the first 64 tokens.
REPORT_OBSERVES: dict[str, tuple[Any, str]] = {
    "layer_timings": (True, "per-layer timings"),
    "attention": ({}, "attention weights"),
}


def build_report(run_dir: Path, out: Path | None = None) -> Any:
    """The reporter entry point; matplotlib is imported only when a report is drawn (not by `llmplan --help`)."""
    from .build import build_report as build

    return build(run_dir, out)


def __getattr__(name: str) -> Any:
    """`from llmplan.commands.report import fonts` (a submodule) still works, loaded on first use."""
    import importlib

    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError:
        raise AttributeError(name) from None


__all__ = ["build_report"]
