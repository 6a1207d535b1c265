"""Where runs leave what they make: one data home, whatever directory llmplan is started from.

`$LLMPLAN_HOME` if set, else `$XDG_DATA_HOME/llmplan`, else `~/.local/share/llmplan` (the XDG Base Directory
default). Run directories (`runs/`), the results database (`results.sqlite`) and every relative path a plan
writes (`out/llama-int8.json`) live there, so `llmplan history`, `show`, a replay and the results cache find
them from any directory. A path given on the command line (`--out`, `--db`, `-o`) is the user's own: relative
to the current directory, as every command-line tool reads it.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_VARIABLE = "LLMPLAN_HOME"
RUNS = "runs"
RESULTS_DB = "results.sqlite"


def data_home() -> Path:
    """The data home, read from the environment each time (a test or a caller may change it)."""
    explicit = os.environ.get(HOME_VARIABLE)
    if explicit:
        return Path(explicit).expanduser().absolute()  # stored in the database: never relative
    xdg = os.path.expanduser(os.environ.get("XDG_DATA_HOME") or "")
    # A relative XDG_DATA_HOME is invalid by the spec, which says to ignore it.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "llmplan"


def in_home(path: str | os.PathLike[str]) -> Path:
    """A path a plan writes: `~` expanded, an absolute one as given, a relative one under the data home."""
    expanded = Path(path).expanduser()
    return expanded if expanded.is_absolute() else data_home() / expanded


def runs_home() -> Path:
    return data_home() / RUNS


def default_db() -> Path:
    return data_home() / RESULTS_DB


def shown(path: Path) -> str:
    """A path as a message says it: under the user's home as `~/…` (shorter, and the same on every machine)."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)
