"""Fonts for token labels: DejaVu Sans (matplotlib's default) has no CJK glyphs, so find one that does.

A system font covering the missing characters is looked up with fc-list (by language) and among the
fonts matplotlib sees; each candidate is checked glyph by glyph. With none, uncovered characters are
written as \\uXXXX escapes and the report says so.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

from llmplan.cache_home import settle_matplotlib_home

settle_matplotlib_home()  # before matplotlib's import: its font cache goes to llmplan's cache home, not $HOME

from matplotlib import font_manager  # noqa: E402
from matplotlib.ft2font import FT2Font  # noqa: E402

CJK_NAME = re.compile(r"cjk|wqy|wenquan|droidsansfallback|ipa[gp]|takao|unifont|sourcehan|notosans(sc|tc|jp|kr)", re.I)


@dataclass
class LabelFont:
    path: str | None  # None: the default font is enough, or nothing better was found
    escaped: bool  # some characters could not be drawn and are shown as \uXXXX
    note: str

    def properties(self) -> font_manager.FontProperties | None:
        """The found font first, DejaVu Sans for what it lacks (matplotlib's per-glyph fallback)."""
        if not self.path:
            return None
        font_manager.fontManager.addfont(self.path)
        name = font_manager.FontProperties(fname=self.path).get_name()
        return font_manager.FontProperties(family=[name, "DejaVu Sans"])


@functools.lru_cache(maxsize=16)
def _charmap(path: str) -> frozenset[int]:
    try:
        return frozenset(FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):
        return frozenset()


def _default_font() -> str:
    return font_manager.findfont(font_manager.FontProperties(family="DejaVu Sans"))


def _candidates() -> list[str]:
    found: list[str] = []
    if shutil.which("fc-list"):
        for lang in ("zh", "ja", "ko"):
            try:
                out = subprocess.run(
                    ["fc-list", f":lang={lang}", "file"], capture_output=True, text=True, timeout=10
                ).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            found += [line.split(":")[0].strip() for line in out.splitlines() if line.strip()]
    found += [p for p in font_manager.findSystemFonts() if CJK_NAME.search(p.replace("-", "").replace("_", ""))]
    regular = sorted(dict.fromkeys(found), key=lambda p: ("Regular" not in p, "Sans" not in p, p))
    return regular


def _visible(ch: str) -> bool:
    return not ch.isspace() and ch.isprintable()


def pick_font(texts: Iterable[str]) -> LabelFont:
    """A font that draws every character of `texts`, or the default one plus a note on what is escaped."""
    wanted = {ord(c) for text in texts for c in text if _visible(c)}
    missing = wanted - _charmap(_default_font())
    if not missing:
        return LabelFont(None, False, "")
    best, best_left = None, missing
    for path in _candidates():
        left = missing - _charmap(path)
        if len(left) < len(best_left):
            best, best_left = path, left
        if not left:
            break
    if best is not None and not best_left:
        return LabelFont(
            best,
            False,
            f"token labels drawn with {best.rsplit('/', 1)[-1]} (the default font lacks "
            f"{len(missing)} of their characters)",
        )
    escaped = sorted(best_left)
    sample = " ".join(f"U+{c:04X}" for c in escaped[:6])
    return LabelFont(
        best,
        True,
        f"no installed font has glyphs for {len(escaped)} characters of the token labels "
        f"({sample}{' …' if len(escaped) > 6 else ''}); they are shown as \\uXXXX escapes. "
        "Install a CJK font (Debian: fonts-noto-cjk) to see them.",
    )


def drawable(text: str, font: LabelFont) -> str:
    """`text` with the characters `font` cannot draw written as \\uXXXX."""
    if not font.escaped:
        return text
    have = _charmap(font.path or _default_font()) | _charmap(_default_font())
    return "".join(c if not _visible(c) or ord(c) in have else f"\\u{ord(c):04x}" for c in text)
