"""Token labels a reader can read, in every language: decoded text with spaces/newlines visible, a character
split over several byte tokens shown on the token that completes it.

With a byte-level BPE (tokens spelled in GPT-2's byte alphabet) the bytes are decoded across tokens: the token
that completes a character shows it (`介`), a token whose bytes only begin one shows `…` (its bytes continue in
the next token), and only bytes that never make a character (invalid UTF-8, or cut off at the end) show as
bytes (`<e5 af>`). The alternatives at a step are read the same way, after the bytes the chosen tokens before
it left pending.
"""

from __future__ import annotations

import codecs
import functools
from dataclasses import dataclass

CONTINUED = "…"  # a token whose bytes begin a character the next token completes


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character a byte-level BPE token uses -> the byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def _visible(text: str) -> str:
    text = text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "␣")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def _hex(raw: bytes) -> str:
    return "<" + " ".join(f"{b:02x}" for b in raw) + ">"


def token_bytes(token: str | None) -> bytes | None:
    """A byte-level BPE token's bytes (None: not spelled in GPT-2's byte alphabet)."""
    table = _byte_decoder()
    if not token or not all(c in table for c in token):
        return None
    return bytes(table[c] for c in token)


@dataclass(frozen=True)
class TokenText:
    label: str  # what a picture's axis shows: spaces made visible, `…` on a token that begins a character
    text: str  # what the answer shows: the characters this token completes ("" while a character is begun)
    pending: bytes  # the bytes of a begun character before this token (its alternatives continue them)


def _decoded(raws: list[bytes]) -> list[TokenText]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    found: list[TokenText] = []
    begun = 0  # the first token of the character now pending
    for i, raw in enumerate(raws):
        pending = decoder.getstate()[0]
        text = decoder.decode(raw)
        left = decoder.getstate()[0]
        if "\ufffd" in text:  # bytes that are no valid UTF-8 here: shown as bytes
            found.append(TokenText(_hex(raw), _hex(raw), pending))
        else:
            found.append(TokenText(_visible(text) + (CONTINUED if left else ""), text, pending))
        if not left:
            begun = i + 1
    if decoder.getstate()[0]:  # cut off at the end: those tokens' bytes never made a character
        for i in range(begun, len(raws)):
            text = found[i].text if found[i].text and "\ufffd" not in found[i].text else ""
            found[i] = TokenText(_visible(text) + _hex(raws[i][len(text.encode()) :]), text, found[i].pending)
    return found


def token_texts(ids: list[int], pieces: list[str] | None, tokens: list[str] | None) -> list[TokenText]:
    """Each token as a reader sees it: decoded across token boundaries where the tokens are byte-level BPE, else
    each token's own decoded piece, else its id."""
    raws = [token_bytes(t) for t in tokens] if tokens and len(tokens) == len(ids) else []
    if raws and all(r is not None for r in raws):
        return _decoded([r for r in raws if r is not None])
    if pieces and len(pieces) == len(ids):
        return [TokenText(_visible(p) if p else f"#{i}", p or "", b"") for p, i in zip(pieces, ids, strict=True)]
    return [TokenText(f"#{i}", f"#{i}", b"") for i in ids]


def token_labels(ids: list[int], pieces: list[str] | None, tokens: list[str] | None) -> list[str]:
    """What a picture's axis shows for each token (see the module's docstring)."""
    return [t.label for t in token_texts(ids, pieces, tokens)]


def alternative_text(token: str | None, piece: str, pending: bytes) -> str:
    """An alternative token as readable text, after the bytes of a character the tokens before it began: the
    characters it would complete, `…` where it would begin (or go on with) one, else its bytes."""
    raw = token_bytes(token)
    if raw is None:
        return _visible(piece)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.setstate((pending, 0))
    text = decoder.decode(raw)
    if "\ufffd" in text:
        return _hex(raw)
    left = decoder.getstate()[0]
    if left and not text:
        return _hex(raw) + CONTINUED  # only a character's first bytes: nothing to read yet but which bytes
    return _visible(text) + (CONTINUED if left else "")
