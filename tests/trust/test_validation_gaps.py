"""Issue 11, validation gaps: each case here was accepted (or crashed) before the fix."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from llmplan.engine.cli import main

PLAN = Path(__file__).resolve().parents[2] / "plans" / "llama-int8.yaml"


def _validate(capsys: pytest.CaptureFixture[str], *paths: str | Path) -> tuple[int, str]:
    code = main(["validate", *map(str, paths)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_deep_nesting_is_one_line_and_other_files_still_checked(tmp_path: Path, capsys) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstages: []\n", encoding="utf-8")
    code, text = _validate(capsys, deep, PLAN, bad)
    assert code == 1
    assert f"{deep}:1:1: nesting deeper than 64 levels; refused" in text
    assert f"{bad}:2:9: stages:" in text  # the third file is still reported
    assert "RecursionError" not in text and "Traceback" not in text


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("{id: generate, uses: compute.generate, with: {max_new_tokens: true}}", "max_new_tokens: must be an integer"),
        ("{id: generate, uses: compute.generate, with: {temperature: '0.5'}}", "temperature: must be a number"),
        ("{id: prompt, uses: compute.tokenize, with: {messages: []}}", "messages: must have at least 1 item"),
    ],
)
def test_strict_values_refused(tmp_path: Path, capsys, snippet: str, expected: str) -> None:
    plan = tmp_path / "p.yaml"
    plan.write_text(f"name: p\nstages:\n  - {snippet}\n", encoding="utf-8")
    code, text = _validate(capsys, plan)
    assert code == 1 and expected in text, text


def test_negative_attention_head_refused(tmp_path: Path, capsys) -> None:
    plan = tmp_path / "p.yaml"
    text = PLAN.read_text(encoding="utf-8").replace("threads: 2\n", "threads: 2\nobserve: {attention: {heads: [-1]}}\n")
    plan.write_text(text, encoding="utf-8")
    code, out = _validate(capsys, plan)
    assert code == 1 and "observe.attention.heads[0]: must be >= 0 (got -1)" in out


def test_hashes_off_unquoted_is_off_like_cache_mode(tmp_path: Path, capsys) -> None:
    plan = tmp_path / "p.yaml"
    text = PLAN.read_text(encoding="utf-8").replace("{hashes: required}", "{hashes: off}")
    assert "{hashes: off}" in text
    plan.write_text(text, encoding="utf-8")
    code, out = _validate(capsys, plan)
    assert code == 0, out


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_plan_that_is_not_a_regular_file_is_refused_without_hanging(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        target = tmp_path / "plan.fifo"
        os.mkfifo(target)
    else:
        target = Path("/dev/zero")
    # In a subprocess with a timeout: the bug is a hang (FIFO) or unbounded growth (/dev/zero).
    done = subprocess.run(
        [sys.executable, "-m", "llmplan", "validate", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"{target}:1:1: not a regular file" in done.stderr + done.stdout


def test_plan_limit_counts_bytes_read_not_st_size(tmp_path: Path) -> None:
    from llmplan.bounded_read import TooLargeError, read_limited

    path = tmp_path / "grow.yaml"
    path.write_bytes(b"a" * 100)
    with pytest.raises(TooLargeError):
        read_limited(path, 10)
    assert read_limited(path, 100) == b"a" * 100


def test_fifo_open_does_not_block(tmp_path: Path) -> None:
    from llmplan.bounded_read import NotRegularFileError, read_limited

    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    result: list[BaseException] = []

    def attempt() -> None:
        try:
            read_limited(fifo, 10)
        except BaseException as error:
            result.append(error)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "opening a FIFO blocked"
    assert result and isinstance(result[0], NotRegularFileError)


def test_out_pointing_at_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    target = tmp_path / "taken"
    target.write_text("keep me", encoding="utf-8")
    code = main(["run", str(PLAN), "--out", str(target), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [f"--out {target}: exists and is not a directory"]
    assert target.read_text(encoding="utf-8") == "keep me"
