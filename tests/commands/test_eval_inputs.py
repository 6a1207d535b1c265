"""What `llmplan eval` and `llmplan compare` read is bounded (#56): a --text file is a regular file read only as far
as the chunks need (a 300 MB file stays far under 1 GB of RSS), a FIFO, device or directory is refused at once,
--chunks is capped by what the text holds, plans of different widths are refused in one line, and matplotlib's
font cache goes to llmplan's cache home, not $HOME."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmplan.engine.cli import main
from tests.llm.tiny import make_tiny_llama
from tests.stages.tiny_run import SENTENCES, make_tiny_model_dir, make_tokenizer, write_plan

GIB = 1 << 30


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("eval-inputs")
    model_dir, _ = make_tiny_model_dir(tmp, n_layers=2)
    return write_plan(tmp, model_dir)


def _eval(plan: Path, text: Path | str, *extra: str) -> list[str]:
    return ["eval", str(plan), "--text", str(text), "--context", "16", "--chunks", "2", "--greedy", "2", *extra]


def _one_line_refusal(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "unexpectedly" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, err
    return err


def test_a_300_mb_text_is_read_only_as_far_as_the_chunks_need(plan: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    with big.open("wb") as out:  # sparse: cheap to make, 300 MB to whoever reads it whole
        out.write((" ".join(SENTENCES) + "\n").encode() * 8)
        out.truncate(300 << 20)
    # A parent of its own reports the peak RSS of its one child (this process's children include others).
    peak = "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); " + (
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(done.returncode)"
    )
    argv = [sys.executable, "-c", peak, sys.executable, "-m", "llmplan"]
    done = subprocess.run([*argv, *_eval(plan, big, "--no-store", "--format", "json")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert '"chunks": 2' in done.stdout and "its first 1024 bytes" in done.stdout  # the head, and it says so
    rss = int(done.stderr.strip().splitlines()[-1]) * 1024
    print(f"eval of a 300 MB text: peak RSS {rss / (1 << 20):.0f} MiB")
    assert rss < GIB


def test_a_fifo_a_device_and_a_directory_are_refused_at_once(plan: Path, tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # no writer: a blocking open would hang for ever
    for path, said in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"), (tmp_path, "directory")):
        assert main(_eval(plan, path)) != 0
        _one_line_refusal(capsys, str(path), said)


def test_chunks_beyond_reason_are_refused_before_loading(plan: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "words.txt"
    text.write_text(" ".join(SENTENCES * 4), encoding="utf-8")
    assert main(["eval", str(plan), "--text", str(text), "--chunks", "1000000000"]) != 0
    _one_line_refusal(capsys, "--chunks 1000000000", "tokens to score")
    assert main(["eval", str(plan), "--chunks", "1000000000"]) != 0  # the default text too
    _one_line_refusal(capsys, "--chunks 1000000000")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hello", encoding="utf-8")
    assert main(["eval", str(plan), "--text", str(tiny), "--context", "16"]) != 0
    _one_line_refusal(capsys, "tiny.txt: 5 bytes", "--context")


def test_chunks_are_capped_by_what_the_text_holds(plan: Path, tmp_path: Path, capsys) -> None:
    text = tmp_path / "words.txt"
    text.write_text(" ".join(SENTENCES * 2), encoding="utf-8")
    argv = ["eval", str(plan), "--text", str(text), "--context", "16", "--chunks", "500", "--greedy", "2"]
    assert main([*argv, "--no-store", "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert "scoring those, not --chunks 500" in captured.err
    assert '"chunks": 500' not in captured.out


@pytest.fixture(scope="module")
def wide_and_narrow(tmp_path_factory: pytest.TempPathFactory, plan: Path) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("narrow")
    vocab = make_tokenizer(tmp / "tok-probe")
    model_dir, _ = make_tiny_llama(tmp, n_layers=2, vocab=vocab, hidden=32, heads=4, kv_heads=2)
    make_tokenizer(model_dir)
    return plan, write_plan(tmp, model_dir, name="tiny-narrow")


def test_eval_of_two_widths_is_one_line_naming_both(wide_and_narrow: tuple[Path, Path], tmp_path, capsys) -> None:
    wide, narrow = wide_and_narrow
    text = tmp_path / "words.txt"
    text.write_text(" ".join(SENTENCES * 4), encoding="utf-8")
    argv = _eval(wide, text, "--no-store")
    assert main([argv[0], str(wide), str(narrow), *argv[2:]]) != 0
    _one_line_refusal(capsys, str(narrow), "width 32", "width 64")


def test_compare_of_two_widths_is_one_line_before_the_other_is_measured(wide_and_narrow, tmp_path: Path) -> None:
    wide, narrow = wide_and_narrow
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")}
    env |= {"HOME": str(home), "LLMPLAN_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "llmplan", "compare", str(wide), str(narrow), "--picture", str(tmp_path / "p.svg")]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("compare:")]
    assert len(lines) == 1 and str(narrow) in lines[0] and "width 32" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and "tiny-narrow: load" not in done.stderr
    # matplotlib was imported (compare draws): its font cache is in llmplan's cache home, nothing under $HOME
    assert list((cache / "matplotlib").glob("fontlist*.json")), sorted(p.name for p in cache.rglob("*"))
    assert not [p for p in home.rglob("*") if "matplotlib" in str(p)]


def test_a_users_mplconfigdir_is_kept(tmp_path: Path) -> None:
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mine"), "LLMPLAN_CACHE": str(tmp_path / "cache")}
    code = "import llmplan.commands.report.common, matplotlib; print(matplotlib.get_cachedir())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == str(tmp_path / "mine"), done.stderr
