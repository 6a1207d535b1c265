"""chat_input: line editing, history kept across sessions, \"\"\" blocks; plain input() off a terminal."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from llmplan.commands.chat.input_lines import EditingReader, PlainReader, history_path, open_history

LEFT, UP = "\x1b[D", "\x1b[A"


def session_reads(history: Path, *typed: str) -> list[str]:
    notes: list[str] = []
    got: list[str] = []
    with create_pipe_input() as pipe:
        reader = EditingReader(open_history(history, notes.append), input=pipe, output=DummyOutput())
        for keys in typed:
            pipe.send_text(keys)
            got.append(reader.read())
    assert not notes
    return got


def test_editing_history_and_blocks(tmp_path: Path) -> None:
    history = tmp_path / "data" / "chat-history"
    typed = ['"""first\rsecond\r"""\r', f"wrld{LEFT * 3}o\r", f"{UP}\r"]
    assert session_reads(history, *typed) == ["first\nsecond", "world", "world"]
    assert stat.S_IMODE(history.stat().st_mode) == 0o600
    assert session_reads(history, f"{UP}\r") == ["world"]  # the next session recalls the last message


def test_unwritable_history_is_kept_in_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    notes: list[str] = []
    history = open_history(blocker / "chat-history", notes.append)
    assert len(notes) == 1 and "for this session only" in notes[0] and str(blocker) in notes[0]
    history.append_string("kept")
    assert list(history.load_history_strings()) == ["kept"]


def test_plain_reader_reads_a_block_line_by_line() -> None:
    lines = iter(['"""', "one", 'two"""', "  hello  "])
    prompts: list[str] = []
    reader = PlainReader(lambda prompt: prompts.append(prompt) or next(lines))
    assert reader.read() == "one\ntwo" and reader.read() == "hello"
    assert prompts == ["you> ", "...  ", "...  ", "you> "]


def test_history_lives_in_the_data_home(data_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The data home's own rules ($LLMPLAN_HOME first), not a second copy of them.
    assert history_path() == data_home / "chat-history"
    monkeypatch.delenv("LLMPLAN_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(data_home / "xdg"))
    assert history_path() == data_home / "xdg" / "llmplan" / "chat-history"
