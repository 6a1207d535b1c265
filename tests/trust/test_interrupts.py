"""Issue 11: Ctrl-C ends every phase the same way, and SIGKILL at any moment leaves only whole files.

Real signals to a real `llmplan run` subprocess on the tiny checkpoint. tests/trust/hooks/sitecustomize.py
makes the chosen phase slow and announces it, so SIGINT lands inside it (for reading: while the
reader thread is inside a shard).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .checkpoints import make_checkpoint, plan_for

HOOKS = Path(__file__).parent / "hooks"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def full_plan(tmp: Path, model_dir: Path, out: Path, *, tokens: int = 8) -> Path:
    extra = [
        {"id": "lookup", "uses": "cache.lookup", "with": {"db": str(out / "results.sqlite"), "mode": "refresh"}},
        {"id": "clean", "uses": "output.postprocess"},
        {"id": "text", "uses": "output.detokenize"},
        {"id": "write", "uses": "output.write", "with": {"to": [{"json": str(out / "answer.json")}]}},
        {"id": "store", "uses": "output.cache", "with": {"db": str(out / "results.sqlite")}},
        {"id": "release", "uses": "output.release"},
    ]
    return plan_for(tmp, model_dir, hashes="if_present", extra=extra, max_new_tokens=tokens)


def start(plan: Path, run_dir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "llmplan.engine.entry", "run", str(plan), "--out", str(run_dir), "--quiet"],
        env={**os.environ, **env},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


PHASES = ["import", "read", "read", "read", "convert", "place", "generate", "release"]


@pytest.mark.parametrize("phase", PHASES, ids=[f"{p}-{i}" for i, p in enumerate(PHASES)])
def test_ctrl_c_in_every_phase_exits_130_with_one_line(model_dir: Path, tmp_path: Path, phase: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    plan = full_plan(tmp_path, model_dir, out)
    marker = tmp_path / "reached"
    env = {"PYTHONPATH": str(HOOKS), "TRUST_PHASE": phase, "TRUST_MARKER": str(marker), "TRUST_SLEEP": "3"}
    proc = start(plan, tmp_path / "run", env)
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), proc.communicate(timeout=60)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1] == "interrupted"
    assert "Traceback" not in stderr and "terminate called" not in stderr and "failed" not in stderr
    assert not any(line.startswith("error") for line in lines), lines
    if phase != "import":
        run = json.loads((tmp_path / "run" / "run.json").read_text())
        assert run["status"] == "interrupted"


def test_a_second_ctrl_c_during_cleanup_changes_nothing(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "reached"
    env = {"PYTHONPATH": str(HOOKS), "TRUST_PHASE": "read", "TRUST_MARKER": str(marker), "TRUST_SLEEP": "3"}
    proc = start(full_plan(tmp_path, model_dir, out), tmp_path / "run", env)
    while not marker.exists() and proc.poll() is None:
        time.sleep(0.02)
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and stderr.splitlines()[-1] == "interrupted", stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr


def _check_outputs(*folders: Path) -> list[str]:
    """Every file whole: JSON parses, JSONL lines parse, the database passes integrity_check.

    Allowed leftovers: the documented temp names `.NAME.tmp` / `.NAME.<random>.tmp` of atomic writes,
    and SQLite's -wal/-shm companions.
    """
    seen = []
    for folder in folders:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            seen.append(path.name)
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                continue
            if path.suffix in (".json", ".llmplan"):  # .NAME.llmplan: the marker that proves llmplan wrote NAME
                json.loads(path.read_text(encoding="utf-8"))
            elif path.suffix == ".jsonl":
                for line in path.read_text(encoding="utf-8").splitlines():
                    json.loads(line)
            elif path.suffix == ".sqlite":
                with sqlite3.connect(path) as conn:
                    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
                    conn.execute("SELECT COUNT(*) FROM results").fetchone()
            elif path.suffix == ".yaml":
                import yaml

                yaml.safe_load(path.read_text(encoding="utf-8"))
            else:
                assert path.name.endswith(("-wal", "-shm")), f"unexpected file {path}"
    return seen


def test_sigkill_at_random_points_leaves_only_whole_files(model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(11)
    out = tmp_path / "out"  # shared by every trial: answer.json and the database see repeated kills
    out.mkdir()
    plan = full_plan(tmp_path, model_dir, out, tokens=24)
    # How long a whole run takes here, so kills spread over all of it (start-up included).
    began = time.monotonic()
    first = start(plan, tmp_path / "calibrate", {})
    first.communicate(timeout=300)
    assert first.returncode == 0
    span = time.monotonic() - began
    budget = time.monotonic() + 300
    trials = 0
    for trial in range(24):
        if time.monotonic() > budget:
            break
        run_dir = tmp_path / f"run-{trial}"
        proc = start(plan, run_dir, {})
        time.sleep(rng.uniform(0.05, span * 1.1))
        proc.kill()
        proc.communicate(timeout=60)
        trials += 1
        _check_outputs(out, *([run_dir] if run_dir.exists() else []))
    assert trials >= 20
    with sqlite3.connect(out / "results.sqlite") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
