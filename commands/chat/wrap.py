"""Streamed text broken at spaces so that no line passes the terminal's width (`llmplan chat`'s answers).

The answer arrives a few characters at a time, so a word is held back only while it could still fit on the
current line: once it ends it is placed there or on the next line; once it no longer fits, the line is ended
and the word is written as it comes (a word wider than the terminal is cut at the edge). A wide character
(CJK, 2 columns) is a word of its own, since those scripts break between characters and use no spaces, and
holding a whole sentence back would stall the stream. Spaces at a break are dropped.
"""

from __future__ import annotations

from typing import TextIO

from prompt_toolkit.utils import get_cwidth

TAB = 8


def columns(text: str) -> int:
    """Terminal columns of `text` (control characters count 0)."""
    return sum(max(0, get_cwidth(ch)) for ch in text)


class WordWrap:
    """Writes text to `out` wrapped at `width` columns (None: as it is)."""

    def __init__(self, out: TextIO, width: int | None) -> None:
        self.out, self.width = out, width if width is None else max(width, 2)
        self.col = 0  # columns already written on the current line
        self.spaces = ""  # whitespace after the last written word, written only if a word follows on this line
        self.word = ""  # the start of a word, held back while it may still fit on this line
        self.eager = False  # the current word began a line: its characters go out as they come

    def write(self, text: str) -> None:
        if self.width is None:
            self.out.write(text)
        else:
            for ch in text:
                self._char(ch)
        self.out.flush()

    def end(self) -> None:
        """The stream ended: write what is held back (trailing spaces are dropped)."""
        self._place()
        self.spaces = ""
        self.out.flush()

    def _char(self, ch: str) -> None:
        if ch == "\n":
            self._place()
            self.out.write("\n")
            self.col, self.spaces = 0, ""
        elif ch in " \t":
            self._place()
            self.spaces += ch if ch == " " else " " * (TAB - (self.col + len(self.spaces)) % TAB)
        elif get_cwidth(ch) > 1:  # a break is allowed before and after it
            self._place()
            self.word = ch
            self._place()
        elif self.eager:
            self._emit(ch)
        else:
            self.word += ch
            if self.col + len(self.spaces) + columns(self.word) > self.width:  # type: ignore[operator]
                self._new_line()
                word, self.word = self.word, ""
                self._emit(word)
                self.eager = True

    def _place(self) -> None:
        """Write the held-back word on this line if it fits, else on the next."""
        self.eager = False
        if not self.word:
            return
        word, self.word = self.word, ""
        if self.col + len(self.spaces) + columns(word) <= self.width:  # type: ignore[operator]
            self.out.write(self.spaces)
            self.col += len(self.spaces)
            self.spaces = ""
        else:
            self._new_line()
        self._emit(word)

    def _new_line(self) -> None:
        if self.col > 0:
            self.out.write("\n")
        self.col, self.spaces = 0, ""

    def _emit(self, text: str) -> None:
        """Write at the current column, cutting at the edge (a word wider than the line)."""
        for ch in text:
            wide = max(0, get_cwidth(ch))
            if self.col + wide > self.width:  # type: ignore[operator]
                self.out.write("\n")
                self.col = 0
            self.out.write(ch)
            self.col += wide
