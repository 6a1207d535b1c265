"""Blocklist matching over normalized text, for whole texts and for a stream of pieces.

Text is matched after normalization, so that a blocked word cannot pass by being spelled with
characters that look or read the same. Per cluster (a character with its combining marks):

  1. default-ignorable code points and format characters are removed (zero-width space, soft hyphen,
     ZWJ/ZWNJ, word joiner, BOM, the bidi marks, embeddings, overrides and isolates, variation
     selectors, tag characters, Hangul fillers: Unicode's Default_Ignorable_Code_Point set, listed in
     `_IGNORABLE`, and every character of general category Cf);
  2. NFKD (fullwidth letters, mathematical bold/italic/script letters, circled letters, ligatures, the
     long s, NBSP and the other compatibility spaces), then the combining marks are stripped: all of
     them on a Latin, Greek, Cyrillic or Armenian letter, a digit or a symbol (`banána`, `b̲a̲n̲a̲n̲a̲`),
     only the generic diacritics and the optional Hebrew and Arabic points elsewhere (a kana's dakuten
     or a Devanagari vowel sign changes the word: `ば` is not `は`); NFC puts back what is left;
  3. lookalikes become the ASCII letter they are drawn like: Unicode's confusables (UTS #39, see
     `confusables.py`: Cyrillic `Ь` and `а`, Latin alpha `ɑ`, Greek, Cherokee, mathematical letters ...),
     after a small table of our own (`_CONFUSABLES`: letters UTS #39 maps to another prototype, such as
     the Latin small capitals). ASCII itself is left alone ("corn" is not "com");
  4. case folding (so `STRASSE`, `Straße` and `STRAẞE` all become `strasse`), and steps 2–3 again;
  5. every run of whitespace becomes one space (so "launch\u00a0 code" is "launch code").

A literal entry is normalized the same way and matched as a substring of the normalized text —
as a whole word when its normalized form is ASCII (no word character just before or after). A
`re:` entry is searched case-insensitively in the normalized text and in the original text.

Besides that normalized text, two more views are matched:
  * digits and symbols read as letters (`b4n4n4`, `$h1t`, `h3ll0`): the normalized text with
    `_LEET` applied, once with `1` as `l` and once as `i`. A match there counts only when at least as
    many of its characters are letters as were digits or symbols: "A55" or "101" are not words;
  * when the text carries explicit bidi controls, the text in the order it is displayed
    (`bidi_order.py`): `"\u202eananab"` is shown, and matched, as "banana".

Every normalized character remembers the span of its cluster in the original text, so a match
found in normalized text masks the exact original characters (ignorables inside it included).

`StreamGuard` applies the same matcher to text that arrives piece by piece. It lets a character
out only when no match can still start at or before it: it holds back as many normalized
characters as the longest entry can span, plus one (the whole-word check looks one character
ahead). A regular expression with no upper bound on its length (`re:bad.*word`) makes the guard
hold everything until the stream ends: a bounded hold could let such a match out half-printed.
An explicit bidi embedding, override or isolate that is still open holds the stream from that
control on until it is closed (or the line or the stream ends): what follows may be displayed in
another order.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from .bidi_order import ISOLATES, LINE_BREAKS, OPENING, PDF, PDI, display_order, has_explicit_controls
from .confusables import ascii_lookalike

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

# Combining marks stripped whatever letter carries them: the generic diacritics (Combining Diacritical
# Marks and their supplements and extensions, the marks for symbols, the half marks) and the optional
# Hebrew and Arabic points. Other scripts' marks are stripped only from a Latin-like base (`_LATIN_LIKE`).
_GENERIC_MARKS = (
    (0x0300, 0x036F),
    (0x0483, 0x0489),
    (0x0591, 0x05C7),
    (0x0610, 0x061A),
    (0x064B, 0x065F),
    (0x0670, 0x0670),
    (0x06D6, 0x06ED),
    (0x1AB0, 0x1AFF),
    (0x1DC0, 0x1DFF),
    (0x20D0, 0x20FF),
    (0xFE20, 0xFE2F),
)
# Bases whose every mark is decoration: Latin, IPA, Greek, Cyrillic, Armenian; phonetic extensions, Latin and
# Greek extended; punctuation and symbols; Latin extended C/D/E, Cyrillic extended B; halfwidth and fullwidth.
_LATIN_LIKE = (
    (0x0000, 0x058F),
    (0x1D00, 0x1FFF),
    (0x2000, 0x2BFF),
    (0x2C60, 0x2C7F),
    (0xA640, 0xA69F),
    (0xA720, 0xA7FF),
    (0xAB30, 0xAB6F),
    (0xFF00, 0xFFEF),
    (0x1D400, 0x1D7FF),
)


def _in(ranges: tuple[tuple[int, int], ...], ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in ranges)


# Letters drawn like Latin ones that UTS #39 maps to a prototype of their own (the small capitals), or to a
# lower-case prototype where the capital is meant (Cyrillic capitals): applied first, before case folding.
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
# Digits and symbols written for letters. `1` is an l or an i: the two tables are both tried.
_LEET = {"0": "o", "3": "e", "4": "a", "5": "s", "6": "g", "7": "t", "8": "b", "9": "g", "@": "a", "$": "s"}
_LEET_L = str.maketrans({**_LEET, "1": "l", "|": "l", "!": "i", "€": "e"})
_LEET_I = str.maketrans({**_LEET, "1": "i", "|": "l", "!": "i", "€": "e"})
_LEET_CHARS = frozenset("013456789@$|!€")
UNBOUNDED = 1 << 30  # "no upper bound" for a regular expression's match length
_LONG_REGEX = 4096  # a pattern that may match more than this is treated as unbounded


def _strip_marks(text: str) -> str:
    """Combining marks off (see `_GENERIC_MARKS`); `text` is one decomposed cluster."""
    base = next((ch for ch in text if unicodedata.category(ch) not in ("Mn", "Me", "Mc")), None)
    every = base is None or _in(_LATIN_LIKE, base)
    return "".join(
        ch for ch in text if unicodedata.category(ch) not in ("Mn", "Me") or not (every or _in(_GENERIC_MARKS, ch))
    )


def _lookalikes(text: str) -> str:
    text = text.translate(_CONFUSABLES)
    return "".join(ascii_lookalike(ch) or ch for ch in text)


def _plain(text: str) -> str:
    """Decomposed, marks stripped, recomposed, lookalikes mapped."""
    return _lookalikes(unicodedata.normalize("NFC", _strip_marks(unicodedata.normalize("NFKD", text))))


@functools.lru_cache(maxsize=1 << 16)
def _fold_cluster(cluster: str) -> str:
    kept = "".join(ch for ch in cluster if ch not in _IGNORABLE and unicodedata.category(ch) != "Cf")
    if not kept:
        return ""
    text = _plain(_plain(kept).casefold()).casefold()
    return unicodedata.normalize("NFKC", text)


def _is_mark(ch: str) -> bool:
    return unicodedata.category(ch) in ("Mn", "Me", "Mc") and ch not in _IGNORABLE


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
        while j < n and _is_mark(text[j]):
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
    label: str  # the line as written (kept in memory only: nothing the filter writes names an entry)
    folded: re.Pattern[str]  # searched in the normalized text
    raw: re.Pattern[str] | None  # regexes only: also searched in the original text
    width: int  # the most normalized characters a match can span (UNBOUNDED: no limit)
    word: str | None = None  # literals: the normalized form


def literal_entry(label: str) -> Entry:
    word = normalize(label)
    return Entry(label, _literal_pattern([word]), None, len(word), word)


def _literal_pattern(words: list[str]) -> re.Pattern[str]:
    """Every start of any of `words` (longest first), as group 1 inside a look-ahead, so that overlapping
    matches are all found; whole words for ASCII words ("class" must not mask "classic"), substrings
    otherwise (CJK has no word boundaries)."""
    ascii_words = sorted({w for w in words if w and w.isascii()}, key=len, reverse=True)
    other = sorted({w for w in words if w and not w.isascii()}, key=len, reverse=True)
    parts = []
    if ascii_words:
        parts.append(r"(?<!\w)(?:" + "|".join(map(re.escape, ascii_words)) + r")(?!\w)")
    if other:
        parts.append("(?:" + "|".join(map(re.escape, other)) + ")")
    return re.compile("(?=(" + "|".join(parts) + "))" if parts else r"(?!x)x")


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


class Matcher:
    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        words = [e.word for e in entries if e.word is not None]
        self.literals = _literal_pattern(words)  # all literal entries in one pattern
        self.regexes = [e for e in entries if e.word is None]
        widest = max((e.width for e in entries), default=0)
        self.hold = UNBOUNDED if widest >= UNBOUNDED else widest + 1  # +1: the whole-word look-ahead

    def _search(self, text: str, literals_only: bool = False, pos: int = 0) -> list[tuple[int, int]]:
        """Spans [start, end) of normalized `text` that an entry matches, starting at `pos` or later (the
        whole-word look-behind still sees the character before `pos`)."""
        found = [(m.start(1), m.end(1)) for m in self.literals.finditer(text, pos) if m.end(1) > m.start(1)]
        if not literals_only:
            for entry in self.regexes:
                found += [(m.start(), m.end()) for m in entry.folded.finditer(text, pos) if m.end() > m.start()]
        return found

    def find(
        self, text: str, offset: int = 0, folded: Folded | None = None, ending_after: int | None = None
    ) -> list[Match]:
        """Every match, as spans of the original `text` (shifted by `offset`), sorted by start.

        `ending_after` (a position in `text`): only matches that end after it are needed, so the normalized
        text is searched from where such a match can start (a text grown by a few characters is cheap)."""
        folded = folded if folded is not None else fold(text, offset)
        pos = 0
        if ending_after is not None and self.hold < UNBOUNDED:
            first = next((k for k, end in enumerate(folded.ends) if end - offset > ending_after), len(folded.ends))
            pos = max(0, first - self.hold)
        found = [Match(folded.starts[s], folded.ends[e - 1]) for s, e in self._search(folded.text, pos=pos)]
        for entry in self.regexes:
            assert entry.raw is not None
            found += [
                Match(m.start() + offset, m.end() + offset) for m in entry.raw.finditer(text) if m.end() > m.start()
            ]
        if any(ch in _LEET_CHARS for ch in folded.text):
            for table in (_LEET_L, _LEET_I):
                leet = folded.text.translate(table)
                for s, e in self._search(leet, literals_only=True, pos=pos):
                    swapped = sum(1 for k in range(s, e) if leet[k] != folded.text[k])
                    if 2 * swapped <= e - s:  # at least as many letters as digits or symbols read as letters
                        found.append(Match(folded.starts[s], folded.ends[e - 1]))
        if has_explicit_controls(text):
            order = display_order(text)
            shown = fold("".join(text[i] for i in order))
            for s, e in self._search(shown.text):
                positions = [order[k] for k in range(shown.starts[s], shown.ends[e - 1])]
                found.append(Match(min(positions) + offset, max(positions) + 1 + offset))
        return sorted(set(found), key=lambda x: (x.start, x.end))

    def count(self, *texts: str) -> int:
        """How many separate places of `texts` an entry matches (overlapping matches count once)."""
        return sum(len(merge(self.find(t))) for t in texts)

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
        self.matches = 0  # matches seen in the stream
        self._reset()

    def _reset(self) -> None:
        self.text = ""
        self.done = 0  # original text before this position is decided (shown or dropped)
        self.stopped = False
        self._scanned = 0  # the explicit bidi controls of text before this position are in `_open`
        self._open: list[tuple[str, int]] = []  # explicit embeddings, overrides, isolates not yet closed

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

    def _first_open_control(self) -> int | None:
        """Where the outermost explicit bidi control still open starts (None: none is open)."""
        for i in range(self._scanned, len(self.text)):
            ch = self.text[i]
            if ch in OPENING:
                self._open.append((ch, i))
            elif ch == PDF and self._open and self._open[-1][0] not in ISOLATES:
                self._open.pop()
            elif ch == PDI:
                while self._open and self._open[-1][0] not in ISOLATES:
                    self._open.pop()
                if self._open:
                    self._open.pop()
            elif ch in LINE_BREAKS:
                self._open.clear()  # a paragraph ends every embedding
        self._scanned = len(self.text)
        return self._open[0][1] if self._open else None

    def _release(self, final: bool) -> None:
        start = self.done
        while start > 0 and (self.done - start < self._CONTEXT or _is_mark(self.text[start])):
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
            opened = self._first_open_control()
            if opened is not None:
                limit = min(limit, opened)  # what follows an open override may yet be shown reversed
            if limit <= self.done:
                return
        spans = [m for m in self.matcher.find(window, start, folded) if self.done <= m.start < limit]
        if spans:
            self.matches += len(merge(spans))
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
