"""`llmplan chat` fed through a pipe as a script would (#56): a line that is not UTF-8, a NUL in a /save path and
a /save onto a path it must refuse (someone else's file, a directory, a FIFO) are each one line naming the input;
the chat goes on and the conversation is still there to save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import write_serve_plan


def test_bad_lines_and_refused_saves_do_not_end_the_chat(tiny_model: Path, tmp_path: Path) -> None:
    plan = write_serve_plan(tmp_path, tiny_model, slots=1, max_new_tokens=4)
    theirs = tmp_path / "theirs.json"
    theirs.write_text("a file of the user's\n", encoding="utf-8")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    saved = tmp_path / "saved.json"
    typed = b"\n".join([
        b"hello", b"caf\xe9\xff there", b"/save " + str(tmp_path).encode() + b"/a\x00b.json",
        f"/save {theirs}".encode(), f"/save {tmp_path}".encode(), f"/save {fifo}".encode(),
        b"again", f"/save {saved}".encode(), b"/exit",
    ]) + b"\n"  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMPLAN_HOME": str(tmp_path / "home"), "TERM": "dumb"}
    done = subprocess.run(
        [sys.executable, "-m", "llmplan", "chat", str(plan)], input=typed, capture_output=True, env=env, timeout=300
    )
    out, err = done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")
    assert done.returncode == 0, out + err
    for said in (out, err):
        assert "Traceback" not in said and "unexpectedly" not in said, out + err
    errors = [line.split("you> ")[-1] for line in out.splitlines() if "error:" in line]
    assert len(errors) == 5, out
    assert "not UTF-8 text (byte 0xe9 at character 3); not sent" in errors[0]
    assert "NUL" in errors[1] and str(theirs) in errors[2] and str(tmp_path) in errors[3] and str(fifo) in errors[4]
    assert theirs.read_text(encoding="utf-8") == "a file of the user's\n"
    record = json.loads(saved.read_text(encoding="utf-8"))
    assert [m["content"] for m in record["messages"] if m["role"] == "user"] == ["hello", "again"]
