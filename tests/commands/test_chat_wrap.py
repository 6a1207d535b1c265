"""chat_wrap.WordWrap: streamed text broken at spaces within the width, whatever the pieces' boundaries."""

from __future__ import annotations

import io

import pytest

from llmplan.commands.chat.wrap import WordWrap, columns

TEXT = "The cache keeps keys and values so each new token is cheap; supercalifragilisticexpialidocious words too."


def wrapped(text: str, width: int, piece: int) -> str:
    out = io.StringIO()
    wrap = WordWrap(out, width)
    for start in range(0, len(text), piece):
        wrap.write(text[start : start + piece])
    wrap.end()
    return out.getvalue()


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_lines_fit_and_words_are_whole(piece: int) -> None:
    shown = wrapped(TEXT, 20, piece)
    lines = shown.split("\n")
    assert all(columns(line) <= 20 for line in lines) and len(lines) > 3
    # only the word wider than the line is cut; every other word is on one line
    for word in TEXT.split():
        if len(word) <= 20:
            assert any(word in line.split() for line in lines), word
    assert "".join(shown.split()) == "".join(TEXT.split())
    assert shown == wrapped(TEXT, 20, 1)  # the same whatever the stream's pieces


def test_newlines_kept_and_wide_characters_break_between_them() -> None:
    shown = wrapped("ab\n注意力机制看每个词言語モデル", 7, 2)
    lines = shown.split("\n")
    assert lines[0] == "ab" and all(columns(line) <= 7 for line in lines)
    assert "".join(lines[1:]) == "注意力机制看每个词言語モデル"


def test_no_width_writes_as_is() -> None:
    assert wrapped(TEXT, None, 5) == TEXT  # type: ignore[arg-type]
