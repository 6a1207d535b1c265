"""`llmplan report RUN_DIR`: build the HTML report of a finished run and print its path."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Entry point of group `llmplan.commands`: add the `report` subcommand."""
    parser = subparsers.add_parser("report", help="draw a run's pictures into one self-contained HTML page")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<time>-<plan>)")
    parser.add_argument("-o", "--out", metavar="DIR", help="where to write (default: RUN_DIR/report)")
    parser.set_defaults(handler=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from llmplan.engine.cli import CliError

    from .build import build_report

    run_dir = Path(args.run_dir)
    if not (run_dir / "stages.json").is_file() and not (run_dir / "plan.resolved.yaml").is_file():
        raise CliError(f"{run_dir}: not a run directory (no stages.json or plan.resolved.yaml)")
    print(build_report(run_dir, Path(args.out) if args.out else None))
    return 0
