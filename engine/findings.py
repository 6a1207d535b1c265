"""Findings: one problem in a plan, located by file, line, column and field path.

Every error the engine reports to a user is a Finding (or a list of them), so the CLI can print
`plans/x.yaml:12:7: stages[3].with.top_p: must be <= 1 (got 1.5)` or the same as JSON for CI.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

Path = tuple[str | int, ...]


def format_path(path: Path) -> str:
    """('stages', 3, 'with', 'top_p') -> 'stages[3].with.top_p'."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    column: int
    field: str
    message: str
    kind: str = "error"

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PlanError(Exception):
    """One or more findings that make a plan unusable."""

    def __init__(self, findings: list[Finding]) -> None:
        super().__init__("\n".join(str(f) for f in findings))
        self.findings = findings


class StageFailure(Exception):
    """A stage's own, user-facing failure: one clear line, no traceback needed.

    Stages raise it (or a subclass) for bad input they detect: a missing shard, a hash mismatch,
    a prompt file with no valid line. Anything else escaping a stage is reported as a bug.
    """


class InputRefused(StageFailure):
    """A StageFailure caused by one request's own input (a prompt too long for the context, a message the
    chat template cannot render): a server answers it as the client's error (400), not its own (500)."""
