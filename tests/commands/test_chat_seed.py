"""Issue 57: `llmplan chat` with a sampled plan that pins no seed samples anew in every session, as `run` does:
a fresh seed per session, said in one line with the way to repeat it; a plan's own seed is kept, unsaid."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from llmplan.commands.chat.command import session_seed
from tests.commands.conftest import write_serve_plan

SEED_LINE = re.compile(r"seed (\d+): drawn for this session \(the plan pins none; --set seed=\1 repeats it\)")


def sampled_plan(tmp_path: Path, model_dir: Path, *, seed: bool) -> Path:
    path = write_serve_plan(tmp_path, model_dir, name="tiny-chat", temperature=0.9, top_k=50, max_new_tokens=8)
    plan = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not seed:
        del plan["seed"]
    path.write_text(yaml.safe_dump(plan, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def chat(plan: Path, message: str) -> tuple[str, str]:
    """One session as typed into a pipe: the message, then the end of the input. (stdout, stderr)"""
    done = subprocess.run(
        [sys.executable, "-m", "llmplan", "chat", str(plan)],
        input=f"{message}\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def test_each_chat_session_of_a_sampled_plan_draws_its_own_seed(tiny_model: Path, tmp_path: Path) -> None:
    plan = sampled_plan(tmp_path, tiny_model, seed=False)
    sessions = [chat(plan, "Tell me about the cache.") for _ in range(2)]
    seeds = []
    for _, err in sessions:
        said = SEED_LINE.search(err)
        assert said, err
        seeds.append(int(said.group(1)))
    assert seeds[0] != seeds[1]
    assert sessions[0][0] != sessions[1][0]  # the same message, sampled anew: another answer


def test_a_pinned_seed_is_kept_for_the_session(tiny_model: Path, tmp_path: Path) -> None:
    pinned = sampled_plan(tmp_path, tiny_model, seed=True)
    assert session_seed(str(pinned), []) == []
    unpinned = sampled_plan(tmp_path, tiny_model, seed=False)
    assert session_seed(str(unpinned), ["seed=7"]) == []  # a --set seed pins it too
    drawn = session_seed(str(unpinned), [])
    assert len(drawn) == 1 and drawn[0].startswith("seed=")
