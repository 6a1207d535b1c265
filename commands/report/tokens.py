"""Token labels a reader can read: decoded text with spaces/newlines visible, bytes of split characters."""

from __future__ import annotations

import codecs
import functools


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


def token_labels(ids: list[int], pieces: list[str] | None, tokens: list[str] | None) -> list[str]:
    """What a reader sees for each token: its text, spaces and newlines made visible.

    With a byte-level BPE (tokens spelled in GPT-2's byte alphabet) the bytes are decoded across
    tokens, so a character split over several tokens shows on the token that completes it and the
    tokens before show their bytes (<e6 b3>). Otherwise each token's own decoded piece is used.
    """
    table = _byte_decoder()
    if tokens and len(tokens) == len(ids) and all(t and all(c in table for c in t) for t in tokens):
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        labels = []
        for token in tokens:
            raw = bytes(table[c] for c in token)
            text = decoder.decode(raw)
            whole = text and "\ufffd" not in text  # U+FFFD: bytes that are no valid UTF-8 here
            labels.append(_visible(text) if whole else "<" + " ".join(f"{b:02x}" for b in raw) + ">")
        return labels
    if pieces and len(pieces) == len(ids):
        return [_visible(p) if p else f"#{i}" for p, i in zip(pieces, ids, strict=True)]
    return [f"#{i}" for i in ids]
