"""Fonts for token labels: DejaVu Sans (matplotlib's default) has no CJK glyphs, so find one that does.

A system font covering the missing characters is looked up with fc-list (by language) and among the
fonts matplotlib sees; each candidate is checked glyph by glyph, and the one found measures the labels. Either
way the pictures' text stays text (SVG <text>, `svg.fonttype: none`) whose font-family names the font found,
then matplotlib's sans-serif families and the CJK fonts of the common systems (`CJK_FAMILIES`, added to
`font.sans-serif` by common.py): the browser that shows the page draws every character with its own fonts
where the drawing machine had none. A character is never written as a \\uXXXX escape.
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

# CJK fonts of the common systems (Linux, macOS, Windows), after matplotlib's own sans-serif families in every
# picture's font-family: what the reader's browser falls back to, glyph by glyph
CJK_FAMILIES = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Source Han Sans SC",
    "WenQuanYi Micro Hei",
    "PingFang SC",
    "Hiragino Sans",
    "Microsoft YaHei",
    "Malgun Gothic",
)
CJK_NAME = re.compile(r"cjk|wqy|wenquan|droidsansfallback|ipa[gp]|takao|unifont|sourcehan|notosans(sc|tc|jp|kr)", re.I)


@dataclass
class LabelFont:
    path: str | None  # None: the default font is enough, or nothing better was found
    browser: bool  # no installed font has some of the characters: the reader's browser draws them
    note: str

    def properties(self) -> font_manager.FontProperties | None:
        """The found font first, DejaVu Sans for what it lacks (matplotlib's per-glyph fallback), then the
        sans-serif families (CJK_FAMILIES among them) for the browser."""
        if not self.path:
            return None
        font_manager.fontManager.addfont(self.path)
        name = font_manager.FontProperties(fname=self.path).get_name()
        return font_manager.FontProperties(family=[name, "DejaVu Sans", "sans-serif"])


def with_cjk_fallbacks(families: list[str]) -> list[str]:
    """`families` (matplotlib's sans-serif ones), then CJK_FAMILIES: the browser's fallbacks in every picture."""
    return [*families, *(f for f in CJK_FAMILIES if f not in families)]


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
    """A font that draws every character of `texts`; with none, the best one found (or the default) and a note
    that the browser draws the rest."""
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
    left = sorted(best_left)
    sample = " ".join(f"U+{c:04X}" for c in left[:6])
    return LabelFont(
        best,
        True,
        f"no font on the machine that drew this page has {len(left)} characters of the token labels "
        f"({sample}{' …' if len(left) > 6 else ''}): they are left to your browser's fonts (their widths in "
        "the picture are estimated; a CJK font there, Debian: fonts-noto-cjk, lets the drawing measure them)",
    )
