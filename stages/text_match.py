"""Blocklist matching over normalized text, for whole texts and for a stream of pieces.

Text is matched after normalization, so that a blocked word cannot pass by being spelled with
characters that look or read the same. Per cluster (a character with its combining marks):

  1. default-ignorable code points are removed (zero-width space, soft hyphen, ZWJ/ZWNJ, word
     joiner, BOM, bidi marks, variation selectors, tag characters, Hangul fillers — the Unicode
     Default_Ignorable_Code_Point set, listed in `_IGNORABLE`);
  2. NFKC (fullwidth letters, mathematical bold/italic/script letters, circled letters, ligatures,
     the long s, NBSP and the other compatibility spaces);
  3. Latin lookalikes are mapped (`_CONFUSABLES`: the Cyrillic, Greek and Armenian letters that are
     drawn like a Latin letter, dotless i/j, the Latin small capitals). This is a small table of
     single letters, not Unicode's whole confusables.txt: no digit-for-letter ("s3cret") rules;
  4. case folding (so `STRASSE`, `Straße` and `STRAẞE` all become `strasse`), then NFKC again;
  5. every run of whitespace becomes one space (so "launch\\u00a0 code" is "launch code").

A literal entry is normalized the same way and matched as a substring of the normalized text —
as a whole word when its normalized form is ASCII (no word character just before or after). A
`re:` entry is searched case-insensitively in the normalized text and in the original text.

Every normalized character remembers the span of its cluster in the original text, so a match
found in normalized text masks the exact original characters (ignorables inside it included).

`StreamGuard` applies the same matcher to text that arrives piece by piece. It lets a character
out only when no match can still start at or before it: it holds back as many normalized
characters as the longest entry can span, plus one (the whole-word check looks one character
ahead). A regular expression with no upper bound on its length (`re:bad.*word`) makes the guard
hold everything until the stream ends: a bounded hold could let such a match out half-printed.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

# Unicode 15 DerivedCoreProperties.txt, Default_Ignorable_Code_Point.
_IGNORABLE_RANGES = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
_IGNORABLE = frozenset(chr(c) for lo, hi in _IGNORABLE_RANGES for c in range(lo, hi + 1))

# Letters drawn like Latin ones (applied after NFKC, before case folding, so each case maps to its
# own lookalike: Greek capital eta is an H, small eta is not mapped).
_CONFUSABLES = str.maketrans(
    {
        # Cyrillic capitals and smalls
        **dict(zip("АВЕЅІЈКМНОРСТУХԚԜҮҺӀ", "ABESIJKMHOPCTYXQWYHI", strict=True)),
        **dict(zip("аеѕіјорсухһԁԛԝӏү", "aesijopcyxhdqwly", strict=True)),
        # Greek capitals and smalls
        **dict(zip("ΑΒΕΖΗΙΚΜΝΟΡΤΥΧϜ", "ABEZHIKMNOPTYXF", strict=True)),
        **dict(zip("αεικνορυχϲϳ", "aeikvopuxcj", strict=True)),
        # Armenian
        **dict(zip("օսհոզ", "ouhnq", strict=True)),
        # dotless i/j, Latin small capitals
        **dict(zip("ıȷ", "ij", strict=True)),
        **dict(zip("ᴀʙᴄᴅᴇꜰɢʜɪᴊᴋʟᴍɴᴏᴘʀꜱᴛᴜᴠᴡʏᴢ", "abcdefghijklmnoprstuvwyz", strict=True)),
    }
)
UNBOUNDED = 1 << 30  # "no upper bound" for a regular expression's match length
_LONG_REGEX = 4096  # a pattern that may match more than this is treated as unbounded


def _fold_cluster(cluster: str) -> str:
    kept = "".join(ch for ch in cluster if ch not in _IGNORABLE)
    if not kept:
        return ""
    text = unicodedata.normalize("NFKC", kept).translate(_CONFUSABLES)
    return unicodedata.normalize("NFKC", text.casefold())


@dataclass
class Folded:
    """Normalized text and, per normalized character, the original span [start, end) it came from."""

    text: str
    starts: list[int]
    ends: list[int]


def fold(text: str, offset: int = 0) -> Folded:
    """Normalize `text` (see the module doc); spans are positions in `text` plus `offset`."""
    out: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    space = False
    i, n = 0, len(text)
    while i < n:
        j = i + 1
        while j < n and unicodedata.combining(text[j]) and text[j] not in _IGNORABLE:
            j += 1
        for ch in _fold_cluster(text[i:j]):
            if ch.isspace():
                if space:
                    continue
                ch, space = " ", True
            else:
                space = False
            out.append(ch)
            starts.append(i + offset)
            ends.append(j + offset)
        i = j
    return Folded("".join(out), starts, ends)


def normalize(text: str) -> str:
    return fold(text).text


@dataclass(frozen=True)
class Entry:
    label: str  # the line as written, for `flagged`
    folded: re.Pattern[str]  # searched in the normalized text
    raw: re.Pattern[str] | None  # regexes only: also searched in the original text
    width: int  # the most normalized characters a match can span (UNBOUNDED: no limit)


def literal_entry(label: str) -> Entry:
    word = normalize(label)
    escaped = re.escape(word)
    # Whole words for ASCII entries ("class" must not mask "classic"); CJK has no word boundaries.
    pattern = re.compile(rf"(?<!\w){escaped}(?!\w)" if word.isascii() else escaped)
    return Entry(label, pattern, None, len(word))


def regex_entry(label: str, source: str) -> Entry:
    """`source` must compile (re.error otherwise)."""
    pattern = re.compile(source, re.IGNORECASE)
    width = regex_width(source)
    return Entry(label, pattern, pattern, width)


def regex_width(source: str) -> int:
    try:
        from re import _parser  # the parser behind re.compile; its getwidth() bounds a match's length

        hi = int(_parser.parse(source, re.IGNORECASE).getwidth()[1])
    except Exception:  # an unknown parser version: assume the worst, hold everything
        return UNBOUNDED
    return UNBOUNDED if hi > _LONG_REGEX else hi


@dataclass(frozen=True)
class Match:
    start: int  # original text positions
    end: int
    label: str


class Matcher:
    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        widest = max((e.width for e in entries), default=0)
        self.hold = UNBOUNDED if widest >= UNBOUNDED else widest + 1  # +1: the whole-word look-ahead

    def find(self, text: str, offset: int = 0, folded: Folded | None = None) -> list[Match]:
        """Every match, as spans of the original `text` (shifted by `offset`), sorted by start."""
        folded = folded if folded is not None else fold(text, offset)
        found: list[Match] = []
        for entry in self.entries:
            for m in entry.folded.finditer(folded.text):
                if m.end() > m.start():
                    found.append(Match(folded.starts[m.start()], folded.ends[m.end() - 1], entry.label))
            if entry.raw is not None:
                for m in entry.raw.finditer(text):
                    if m.end() > m.start():
                        found.append(Match(m.start() + offset, m.end() + offset, entry.label))
        return sorted(found, key=lambda x: (x.start, x.end))

    def labels(self, *texts: str) -> list[str]:
        """The entries that match any of `texts`, in blocklist order."""
        hit = {m.label for t in texts for m in self.find(t)}
        return [e.label for e in self.entries if e.label in hit]

    def mask(self, text: str, replacement: str) -> str:
        return apply_masks(text, self.find(text), replacement)


def merge(spans: list[Match]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for m in spans:
        if merged and m.start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], m.end))
        else:
            merged.append((m.start, m.end))
    return merged


def apply_masks(text: str, spans: list[Match], replacement: str, offset: int = 0) -> str:
    """`text` (which starts at original position `offset`) with each merged span replaced."""
    out, at = [], offset
    for start, end in merge(spans):
        out.append(text[at - offset : start - offset])
        out.append(replacement)
        at = end
    out.append(text[at - offset :])
    return "".join(out)


class StreamGuard:
    """A stream wrapper: pieces in, only text that no blocked entry can still match out.

    `action` mask: a match is printed as `replacement`; reject: the stream stops at the first match
    (what came before it was already shown; nothing of the match or after it is). `end()` lets out
    what was held back, at the end of the streaming stage; the guard then starts afresh.
    """

    _CONTEXT = 16  # original characters re-normalized before the decided position (look-behind)

    def __init__(self, sink: Callable[[str], None], matcher: Matcher, action: str, replacement: str) -> None:
        self.sink = sink
        self.matcher = matcher
        self.action = action
        self.replacement = replacement
        self.matched: list[str] = []  # labels seen in the stream (for the log)
        self._reset()

    def _reset(self) -> None:
        self.text = ""
        self.done = 0  # original text before this position is decided (shown or dropped)
        self.stopped = False

    def __call__(self, piece: str) -> None:
        if not piece or self.stopped:
            self.text += piece
            return
        self.text += piece
        self._release(final=False)

    def end(self) -> None:
        if self.text and not self.stopped:
            self._release(final=True)
        self._reset()
        inner = getattr(self.sink, "end", None)  # a second filter's guard, wrapped by this one
        if callable(inner):
            inner()

    def _release(self, final: bool) -> None:
        start = self.done
        while start > 0 and (self.done - start < self._CONTEXT or unicodedata.combining(self.text[start])):
            start -= 1
        window = self.text[start:]
        folded = fold(window, start)
        if final:
            limit = len(self.text)
        elif self.matcher.hold >= UNBOUNDED:
            return
        else:
            safe = len(folded.text) - self.matcher.hold
            # Everything before the cluster of the first normalized character still held.
            limit = folded.starts[safe] if safe > 0 else start
            if limit <= self.done:
                return
        spans = [m for m in self.matcher.find(window, start, folded) if self.done <= m.start < limit]
        if spans:
            self.matched += [m.label for m in spans if m.label not in self.matched]
            if self.action == "reject":
                self._emit(self.text[self.done : spans[0].start])
                self.stopped = True
                return
            # A match running past the limit waits whole for the next piece: masks never split.
            while any(m.end > limit for m in spans):
                limit = min(m.start for m in spans if m.end > limit)
                spans = [m for m in spans if m.start < limit]
        if limit <= self.done:
            return
        self._emit(apply_masks(self.text[self.done : limit], spans, self.replacement, self.done))
        self.done = limit

    def _emit(self, text: str) -> None:
        if text:
            self.sink(text)
