"""What the person types to `llmplan chat`: one message at a time, with line editing and history on a terminal.

On a terminal (stdin and stdout both ttys, TERM not "dumb") the line is read with prompt_toolkit: the arrow
keys move in the line and go through the history (Ctrl-R searches it), kept in `history_path()` across
sessions (in the data home, llmplan/data_home.py, never the working directory). Anywhere else (a pipe, a file, a dumb
terminal) lines are read with input(), so scripts can feed the chat.

A message spans several lines as Ollama's does: it starts with three double quotes and ends at the line that
ends with them (`\"\"\"` alone on the first line opens the block too); the quotes are not part of the message.
On a terminal, text pasted with line breaks is one message as well.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings

from llmplan.data_home import data_home

PROMPT, MORE = "you> ", "...  "
QUOTES = '"""'


def open_block(text: str) -> bool:
    """True while `text` is a \"\"\" block that has not been closed yet."""
    body = text.lstrip()
    return body.startswith(QUOTES) and not body[len(QUOTES) :].rstrip().endswith(QUOTES)


def message_of(text: str) -> str:
    """The message a finished input stands for: a \"\"\" block without its quotes; surrounding blanks dropped."""
    body = text.strip()
    if body.startswith(QUOTES) and len(body) >= 2 * len(QUOTES) and body.endswith(QUOTES):
        body = body[len(QUOTES) : -len(QUOTES)]
    return body.strip()


def history_path() -> Path:
    """The input history file, in the one data home (so $LLMPLAN_HOME moves it with the runs)."""
    return data_home() / "chat-history"


def interactive(stdin: Any = None, stdout: Any = None) -> bool:
    """Whether to edit lines with prompt_toolkit: both ends a terminal that can move the cursor."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    terminal = all(stream.isatty() for stream in (stdin, stdout))
    return terminal and os.environ.get("TERM", "") != "dumb"


class PlainReader:
    """Messages from input(): a \"\"\" block is read line by line after a continuation prompt."""

    def __init__(self, read_line: Callable[[str], str] = input) -> None:
        self.read_line = read_line
        if read_line is input and hasattr(sys.stdin, "reconfigure"):
            # bytes that are not UTF-8 come through as surrogates (the chat refuses that line) instead of an
            # exception from input() that would end the chat
            sys.stdin.reconfigure(errors="surrogateescape")

    def read(self) -> str:
        text = self.read_line(PROMPT)
        while open_block(text):
            text += "\n" + self.read_line(MORE)
        return message_of(text)


class EditingReader:
    """Messages from a prompt_toolkit session: line editing, history in a file, \"\"\" blocks edited whole."""

    def __init__(self, history: History, **session: Any) -> None:
        keys = KeyBindings()

        @keys.add("enter")
        def _enter(event: Any) -> None:  # inside an open block Enter starts a new line, else it sends
            buffer = event.current_buffer
            if open_block(buffer.text):
                buffer.insert_text("\n")
            else:
                buffer.validate_and_handle()

        self.session: PromptSession[str] = PromptSession(
            history=history,
            multiline=True,  # a block (or a paste) holds line breaks; Enter is bound above
            prompt_continuation=MORE,
            key_bindings=keys,
            **session,
        )

    def read(self) -> str:
        return message_of(self.session.prompt(PROMPT))


class KeptHistory(FileHistory):
    """A FileHistory that goes on in memory once its file can no longer be written (a full disk)."""

    def __init__(self, filename: Path, warn: Callable[[str], None]) -> None:
        super().__init__(filename)
        self.warn, self.broken = warn, False

    def store_string(self, string: str) -> None:
        if self.broken:
            return
        try:
            super().store_string(string)
        except OSError as bad:
            self.broken = True
            self.warn(f"note: {self.filename}: {bad.strerror}; the input history is no longer saved")


def open_history(path: Path, warn: Callable[[str], None]) -> History:
    """The history kept in `path` (made private to the user), or one for this session when it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))  # what one typed is private
        return KeptHistory(path, warn)
    except OSError as bad:
        warn(f"note: {path}: {bad.strerror}; the input history is kept for this session only")
        return InMemoryHistory()


def make_reader(warn: Callable[[str], None], history: Path | None = None) -> PlainReader | EditingReader:
    """The reader for this process's terminal."""
    if not interactive():
        return PlainReader()
    return EditingReader(open_history(history or history_path(), warn))
