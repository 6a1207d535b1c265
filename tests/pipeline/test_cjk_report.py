"""Issue 57, pictures speak every language: a Chinese prompt's `run --report` on the bundled model, drawn on a
machine without a CJK font (the candidates hidden), labels every token readably: a character split over byte
tokens shows on the token that completes it (never `<e4 bb>`), as text the browser draws (never a `\\u4ecb`
escape), and the hover alternatives are text, not a row of U+FFFD."""

from __future__ import annotations

import html
import re
import warnings
from pathlib import Path

import pytest

from llmplan.commands.report import fonts
from llmplan.engine.cli import main

from .conftest import PLANS

PROMPT = "请介绍一下注意力机制。"
CJK = re.compile(r"[\u4e00-\u9fff]")


def svg_texts(path: Path) -> list[str]:
    return [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", path.read_text(encoding="utf-8"))]


def test_a_chinese_prompt_report_labels_its_tokens_readably(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fonts, "_candidates", lambda: [])  # no CJK font on the drawing machine
    run = ["run", str(PLANS / "llama-int8.yaml"), "--report", "--prompt", PROMPT, "--out", str(tmp_path / "run")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*run, "--set", "generate.max_new_tokens=6", "--set", "seed=0"]) == 0
    assert not [w for w in caught if "Glyph" in str(w.message)]  # matplotlib's missing glyphs: not the user's
    report = tmp_path / "run" / "report"
    for picture in ("attention.svg", "attention_decode.svg"):
        labels = svg_texts(report / picture)
        shown = "".join(label for label in labels if CJK.search(label))
        assert all(ch in shown for ch in PROMPT[:-1]), (picture, labels)  # every character, as itself
        assert not [label for label in labels if re.search(r"\\u[0-9a-f]{4}|<[0-9a-f]{2}( [0-9a-f]{2})*>", label)]
        assert "'Noto Sans CJK SC'" in (report / picture).read_text(encoding="utf-8")  # the browser's fallback
    page = (report / "index.html").read_text(encoding="utf-8")
    titles = [html.unescape(t) for t in re.findall(r'<span class="tok"[^>]*title="([^"]*)"', page)]
    assert titles and "most likely here:" in titles[0]
    assert not [t for t in titles if "\ufffd" in t]  # alternatives as text or bytes, never U+FFFD
    assert "left to your browser" in page
