"""The first minute of the command line (#29): --version, `python -m llmplan`, help that starts without torch
and shows an example and the defaults of every command."""

from __future__ import annotations

import os
import subprocess
import sys

import llmplan

COMMAND = [sys.executable, "-m", "llmplan"]

# Every command's --help, then which heavy modules were imported (pydantic and yaml too: the plan models load
# with a command that reads a plan); in one interpreter (one start-up of torch-free code, a few hundred ms)
# rather than one process per command.
_PROBE = """
import contextlib, io, json, sys
from llmplan.engine.cli import build_parser
from llmplan.engine.entry import main
commands = sorted(build_parser()._subparsers._group_actions[0].choices)
helps = {}
for argv in [["--help"]] + [[c, "--help"] for c in commands]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    helps[" ".join(argv)] = out.getvalue()
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "matplotlib", "numpy", "networkx", "structlog", "pydantic", "yaml"})
print(json.dumps({"helps": helps, "heavy": heavy}))
"""


def _probe(env: dict[str, str] | None = None) -> dict[str, object]:
    import json

    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, env=env, check=True
    )
    return json.loads(done.stdout)


def test_version_flags_and_python_dash_m() -> None:
    for argv in (["--version"], ["-V"]):
        done = subprocess.run([*COMMAND, *argv], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout.strip()) == (0, f"llmplan {llmplan.__version__}")
    assert llmplan.__version__ != "unknown"  # the installed package's metadata, stated once in pyproject.toml
    done = subprocess.run([*COMMAND, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: llmplan ")


def test_help_of_every_command_imports_no_torch_and_shows_an_example() -> None:
    env = dict(os.environ, LLMPLAN_API_KEY="sekrit-from-the-environment")
    result = _probe(env)
    assert result["heavy"] == []  # imports on demand: torch, matplotlib, ... come with the command that uses them
    helps = result["helps"]
    assert {"--help", "run --help", "chat --help", "serve --help", "history --help"} <= set(helps)
    for argv, text in helps.items():
        assert text.startswith("usage: llmplan"), argv
        assert "\nexample:\n  llmplan " in text, f"{argv}: no example"
    assert "(default: 8000)" in helps["serve --help"]  # an option without help text still says its default
    assert "(default: 20)" in helps["history --help"]
    assert "sekrit" not in helps["serve --help"]  # a default read from the environment (the API key) is not shown
    assert "-V, --version" in helps["--help"]


def test_make_clean_keeps_the_users_runs() -> None:
    # `make clean` removes what setup made here, never runs/ (nor the data home, where runs now live).
    import shutil
    from pathlib import Path

    import pytest

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["make", "-n", "clean"], cwd=root, capture_output=True, text=True, check=True)
    removed = {word for line in done.stdout.splitlines() if line.startswith("rm ") for word in line.split()[2:]}
    assert ".venv" in removed and not removed & {"runs", "runs/", "results.sqlite", "out", "~/.local/share/llmplan"}
