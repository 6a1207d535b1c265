"""The README's quickstart as a new user follows it (issue 57): in a fresh data home and cache home, `make run`'s
`llmplan run plans/llama-int8.yaml`, then `llmplan run plans/llama-int8.yaml --report`; the page draws every
picture it names (no "Not drawn", no figure that failed), though the results cache holds the first run's answer."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import REPO

# the README's `--set generate.max_new_tokens=N` keeps the answers short; a pinned seed makes the second run the
# same computation as the first, whose answer the results cache then holds
SHORT = ["--set", "generate.max_new_tokens=8", "--set", "seed=0"]
# what the README says `run --report` draws: the plan and its data flow, memory over time, per-layer timings,
# decode speed, attention heatmaps (pictures), predicted beside measured memory and every token (tables)
PICTURES = ("plan", "flow_load", "flow_compute", "flow_output", "model", "memory", "layers", "decode", "attention")
TABLES = {"memory_plan": "<table>", "generation": 'class="tok"'}


def quickstart_env(tmp_path: Path) -> dict[str, str]:
    """A fresh data home and cache home; the compiled kernels copied in, so that nothing is rebuilt."""
    env = {**os.environ, "LLMPLAN_HOME": str(tmp_path / "home"), "LLMPLAN_CACHE": str(tmp_path / "cache")}
    env.pop("MPLCONFIGDIR", None)
    kernels = Path(os.environ.get("LLMPLAN_CACHE") or Path.home() / ".cache" / "llmplan") / "kernels"
    if kernels.is_dir():
        shutil.copytree(kernels, tmp_path / "cache" / "kernels")
    return env


def llmplan(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "llmplan", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def sections(page: str) -> dict[str, str]:
    found = re.findall(r'<section id="([^"]+)"><h2>[^<]*</h2>(.*?)</section>', page, re.S)
    return dict(found)


def test_the_quickstart_report_draws_every_picture_it_names(tmp_path: Path) -> None:
    env = quickstart_env(tmp_path)
    llmplan(env, "run", "plans/llama-int8.yaml", *SHORT)
    said = llmplan(env, "run", "plans/llama-int8.yaml", "--report", *SHORT)
    assert "replayed" not in said and "nothing was generated" not in said
    page_path = re.search(r"^report: (.+index\.html)$", said, re.M)
    assert page_path, said
    page = Path(page_path.group(1)).read_text(encoding="utf-8")
    assert page_path.group(1).startswith(str(tmp_path / "home"))
    assert "Not drawn" not in page and "could not draw" not in page and "Replayed" not in page
    drawn = sections(page)
    for key in PICTURES:
        assert key in drawn, f"no section {key!r}: {sorted(drawn)}"
        assert "<svg" in drawn[key] or "<img" in drawn[key], key
    for key, mark in TABLES.items():
        assert mark in drawn.get(key, ""), key
    # and `llmplan history` names the model by its file, not by a hash
    rows = [json.loads(line) for line in llmplan(env, "history", "--json").splitlines() if line.startswith("{")]
    assert [row["model"] for row in rows] == ["SmolLM2-135M-Instruct.Q4_1"] * 2
