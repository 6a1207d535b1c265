"""`llmplan eval`'s figures in the results database: one `evals` row per scored plan, keyed by the plan's hash.

The hash is the SHA-256 of the plan as it was scored — its YAML resolved with every default and override
(`--set`, the row's `--dtypes`/`--kv-dtypes` change) — so the same precision of the same plan finds its
earlier figures whatever the file is called, and any change that could move them makes a new hash. The
reference and the text are hashed too: figures are comparable only against the same reference and words.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

SETTINGS = ("context", "chunks", "greedy", "prompts")


def plan_hash(plan: str | Path, overrides: list[str]) -> str:
    """SHA-256 of the plan as resolved with these overrides (every default filled in)."""
    from llmplan.engine.plan import load_plan  # here: `llmplan --help` imports this module, not the plan models
    from llmplan.engine.registry import discover

    return hashlib.sha256(load_plan(plan, discover(), overrides).resolved_yaml().encode("utf-8")).hexdigest()


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_db(db: str) -> None:
    """Before any model is loaded: the path can hold a results database, and what is there already is one."""
    from llmplan.engine.cli import CliError
    from llmplan.stages.results.file import path_problem
    from llmplan.stages.results.store import StoreError, identify

    problem = path_problem(db)
    if problem is not None:
        raise CliError(f"--db {problem}")
    try:
        identify(Path(db).expanduser())
    except StoreError as bad:
        raise CliError(f"--db {bad}") from None


def store(db: str, report: dict[str, Any], text: str) -> list[int]:
    """One `evals` row per plan of the report, in one transaction; returns their ids."""
    from llmplan.engine.cli import CliError
    from llmplan.stages.results.store import EvalRow, ResultsStore, StoreError

    ref = report["reference"]
    settings = {key: report[key] for key in SETTINGS if key in report}
    label = ("plan", "plan_file", "plan_hash", "change")
    rows = [
        EvalRow(
            plan=row["plan"],
            plan_file=row.get("plan_file"),
            plan_hash=row["plan_hash"],
            change=row["change"],
            reference=f"{ref['plan']} ({ref['change']})" if ref["change"] else ref["plan"],
            reference_hash=ref["plan_hash"],
            text_source=report["text"],
            text_hash=text_hash(text),
            settings=settings,
            figures={key: value for key, value in row.items() if key not in label},
        )
        for row in report["plans"]
    ]
    try:
        with ResultsStore(db) as results:
            return results.record_evals(rows)
    except StoreError as bad:
        raise CliError(f"--db {bad}") from None
