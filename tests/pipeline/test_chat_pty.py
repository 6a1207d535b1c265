"""`llmplan chat` on the bundled model, driven through a pseudo-terminal as a person would type.

A real terminal matters here: Ctrl-C is the byte 0x03 turned into SIGINT by the terminal's line discipline,
and it must stop the answer being streamed, not the program.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import sqlite3
import subprocess
import sys
import termios
import time
from pathlib import Path

from .conftest import PLANS


class Terminal:
    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()

        def controlling_terminal() -> None:  # the pty becomes the child's terminal: ^C turns into SIGINT
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env, preexec_fn=controlling_terminal
        )
        os.close(slave)
        self.seen = ""

    def read_until(self, pattern: str, timeout: float = 60) -> str:
        """Everything read until `pattern` (a regex) appears after what was consumed before."""
        deadline = time.monotonic() + timeout
        start = len(self.seen)
        while not re.search(pattern, self.seen[start:]):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.seen[start:][-2000:]!r}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.seen += os.read(self.master, 65536).decode("utf-8", errors="replace")
                except OSError:  # the child closed the terminal
                    assert re.search(pattern, self.seen[start:]), self.seen[start:][-2000:]
        return self.seen[start:]

    def type(self, text: str) -> None:
        os.write(self.master, text.encode("utf-8"))

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.master)


def test_a_conversation_with_commands_ctrl_c_and_storage(tmp_path: Path, model_cache: Path, smollm2_dir: Path) -> None:
    env = {**os.environ, "LLMPLAN_CACHE": str(model_cache), "PYTHONUNBUFFERED": "1", "TERM": "dumb"}
    args = [sys.executable, "-m", "llmplan", "chat", str(PLANS / "llama-int8.yaml")]
    args += ["--set", "place.kv_cache.max_tokens=1024", "--set", "generate.max_new_tokens=600"]
    term = Terminal(args, tmp_path, env)
    try:
        term.read_until(r"you> ", timeout=120)
        term.type("/set temperature 0\n")
        assert "(temperature = 0)" in term.read_until(r"you> ")
        term.type("/set temperature 9000\n")
        assert "error: temperature" in term.read_until(r"you> ")  # the stage's own limit
        term.type("What is the capital of France? Answer in one word.\n")
        first = term.read_until(r"you> ")
        assert "Paris" in first
        term.type("/set ignore_eos true\n")
        term.read_until(r"you> ")
        term.type("Now tell me a very long story about a llama.\n")
        term.read_until(r"llama\.\r?\n")  # the terminal's echo of the line
        term.read_until(r"\w+ \w+ \w+ \w+")  # the answer is streaming
        started = time.monotonic()
        term.type("\x03")  # Ctrl-C
        stopped = term.read_until(r"you> ", timeout=30)
        assert "[stopped]" in stopped and time.monotonic() - started < 10
        term.type(f"/save {tmp_path / 'talk.json'}\n")
        assert "saved 2 turns" in term.read_until(r"you> ")
        term.type("/exit\n")
        term.read_until(r"released model")
        code = term.close()
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    assert code == 0 and "Traceback" not in term.seen
    saved = json.loads((tmp_path / "talk.json").read_text(encoding="utf-8"))
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
    assert "Paris" in saved["messages"][1]["content"] and saved["settings"]["temperature"] == 0
    with sqlite3.connect(tmp_path / "results.sqlite") as db:  # the data home (tests/conftest.py)
        stored = db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    assert stored >= 1  # the answered turn went through the plan's output.cache stage
