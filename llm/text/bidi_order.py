"""The order in which text is displayed when it carries explicit bidi controls (UAX #9, simplified).

`"\\u202eananab"` — a right-to-left override, then "ananab" — is displayed "banana". Removing the
controls (as the filter's normalization does) gives "ananab", which no blocklist entry matches; the
filter therefore also matches the text in the order it is shown. This implements the part of the
bidi algorithm that such a trick relies on: the explicit embeddings, overrides and isolates (X1–X8)
give each character a level, a character forced by an override takes the override's direction,
strong right-to-left letters and numbers raise their level (I1–I2, with neutrals left at their
embedding level), and each line is reversed from its highest level down to the lowest odd level (L2).
The paragraph direction comes from its first strong letter (P2–P3). Combining marks stay with their base.
Not implemented (they never reverse the letters of a Latin word): the weak and neutral rules W1–W7 and N1–N2,
and FSI's look-ahead (it is taken as LRI).
"""

from __future__ import annotations

import unicodedata

LRE, RLE, PDF, LRO, RLO = "\u202a", "\u202b", "\u202c", "\u202d", "\u202e"
LRI, RLI, FSI, PDI = "\u2066", "\u2067", "\u2068", "\u2069"
EXPLICIT = frozenset((LRE, RLE, PDF, LRO, RLO, LRI, RLI, FSI, PDI))
OPENING = frozenset((LRE, RLE, LRO, RLO, LRI, RLI, FSI))
ISOLATES = frozenset((LRI, RLI, FSI))
_MAX_DEPTH = 125  # UAX #9's max_depth: deeper embeddings are ignored
LINE_BREAKS = frozenset("\n\r\u2028\u2029\x1c\x1d\x1e\x85")  # paragraph separators (bidi class B)


def has_explicit_controls(text: str) -> bool:
    return any(ch in EXPLICIT for ch in text)


def display_order(text: str) -> list[int]:
    """Indices of `text` in the order they are displayed, left to right, the explicit controls left out."""
    order: list[int] = []
    start = 0
    for i, ch in enumerate(text):
        if ch in LINE_BREAKS:
            order += _line_order(text, start, i)
            order.append(i)
            start = i + 1
    return order + _line_order(text, start, len(text))


def _paragraph_level(text: str, start: int, end: int) -> int:
    isolates = 0
    for ch in text[start:end]:
        if ch in (LRI, RLI, FSI):
            isolates += 1
        elif ch == PDI:
            isolates = max(0, isolates - 1)
        elif not isolates:
            kind = unicodedata.bidirectional(ch)
            if kind == "L":
                return 0
            if kind in ("R", "AL"):
                return 1
    return 0


def _line_order(text: str, start: int, end: int) -> list[int]:
    base = _paragraph_level(text, start, end)
    # The stack of explicit levels: (level, override "L"/"R"/None, isolate?)
    stack: list[tuple[int, str | None, bool]] = [(base, None, False)]
    clusters: list[list[int]] = []  # a base character and the combining marks after it
    levels: list[int] = []
    for i in range(start, end):
        ch = text[i]
        level, override, _ = stack[-1]
        if ch in OPENING:
            rtl = ch in (RLE, RLO, RLI)  # FSI as LRI: a first-strong isolate never reverses Latin letters
            new = (level + 1) | 1 if rtl else (level + 2) & ~1
            if new <= _MAX_DEPTH:
                forced = "R" if ch == RLO else "L" if ch == LRO else None
                stack.append((new, forced, ch in (LRI, RLI, FSI)))
            continue
        if ch == PDF:
            if len(stack) > 1 and not stack[-1][2]:
                stack.pop()
            continue
        if ch == PDI:
            while len(stack) > 1 and not stack[-1][2]:
                stack.pop()
            if len(stack) > 1:
                stack.pop()
            continue
        if clusters and unicodedata.category(ch) in ("Mn", "Me"):
            clusters[-1].append(i)  # a mark is shown with its base
            continue
        kind = override or unicodedata.bidirectional(ch)
        if kind in ("R", "AL"):
            resolved = level + 1 if level % 2 == 0 else level
        elif kind == "L":
            resolved = level + 1 if level % 2 else level
        elif kind in ("EN", "AN"):
            resolved = level + 1 if level % 2 else (level + 2 if kind == "AN" else level)
        else:
            resolved = level  # neutrals keep their embedding level
        clusters.append([i])
        levels.append(resolved)
    return _reorder(clusters, levels)


def _reorder(clusters: list[list[int]], levels: list[int]) -> list[int]:
    """L2: from the highest level down to the lowest odd one, reverse every run at that level or higher."""
    odd = [level for level in levels if level % 2]
    if odd:
        for level in range(max(levels), min(odd) - 1, -1):
            i = 0
            while i < len(clusters):
                if levels[i] < level:
                    i += 1
                    continue
                j = i
                while j < len(clusters) and levels[j] >= level:
                    j += 1
                clusters[i:j] = clusters[i:j][::-1]
                levels[i:j] = levels[i:j][::-1]
                i = j
    return [index for cluster in clusters for index in cluster]
