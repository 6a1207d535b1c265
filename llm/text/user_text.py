"""`UserText`: a string that remembers which of its characters a user wrote.

A chat template is code that came with the weights; it may move, cut or rewrite the messages it is
given. Only the characters the template wrote itself (its literals, `bos_token`...) may become
control tokens; every character that came from a message, or from an operation on one, is text.

So the messages go into the template as `UserText`: a `str` subclass carrying `[start, end)` spans
of user characters. Concatenation and slicing (`+`, `~`, `[a:b]`, `strip`, the template's output
buffers) keep the spans exact, so a normal template's own markup stays markup; every other
operation on user text (`replace`, `upper`, `split`, `format`...) marks its whole result as user
text, so a template cannot turn the user's "France" into `<|im_end|>`. What the template decides by
control flow (`{% if content == 'France' %}<|im_end|>{% endif %}`) is the template's own writing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

Spans = tuple[tuple[int, int], ...]
MAX_ITERATED = 1 << 16  # a template walking a message character by character: fine for a short one


class UserText(str):
    """`str` whose characters in `spans` came from a user (all of them, when built from a plain str)."""

    _user_spans: Spans  # a leading underscore: the sandbox lets no template read it

    def __new__(cls, text: object = "") -> UserText:
        made = super().__new__(cls, text)
        made._user_spans = ((0, len(made)),) if len(made) else ()
        return made

    # --- the operations that keep spans exact ---

    def __str__(self) -> str:
        return self  # `str(x)` in compiled templates must not drop the spans

    def __add__(self, other: object) -> Any:
        return joined((self, other)) if isinstance(other, str) else NotImplemented

    def __radd__(self, other: object) -> Any:
        return joined((other, self)) if isinstance(other, str) else NotImplemented

    def __getitem__(self, key: Any) -> str:
        piece = str.__getitem__(self, key)
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            return sliced(self, start, stop) if step == 1 else whole(piece)
        index = key + len(self) if key < 0 else key
        return whole(piece) if any(a <= index < b for a, b in self._user_spans) else piece

    def __iter__(self) -> Iterator[str]:
        if len(self) > MAX_ITERATED:
            raise ValueError(f"a message of {len(self)} characters is too long to walk character by character")
        return (self[i] for i in range(len(self)))

    def strip(self, chars: str | None = None) -> str:
        return self.lstrip(chars).rstrip(chars)

    def lstrip(self, chars: str | None = None) -> str:
        return sliced(self, len(self) - len(str.lstrip(self, chars)), len(self))

    def rstrip(self, chars: str | None = None) -> str:
        return sliced(self, 0, len(str.rstrip(self, chars)))

    def removeprefix(self, prefix: str) -> str:
        return sliced(self, len(prefix), len(self)) if str.startswith(self, prefix) else self

    def removesuffix(self, suffix: str) -> str:
        return sliced(self, 0, len(self) - len(suffix)) if suffix and str.endswith(self, suffix) else self

    # --- everything else that builds text from user text: the result is user text, all of it ---

    def __mul__(self, count: Any) -> Any:
        return _whole_of(str.__mul__(self, count))

    __rmul__ = __mul__

    def __mod__(self, values: Any) -> Any:
        return _whole_of(str.__mod__(self, values))

    def __rmod__(self, template: Any) -> Any:
        return _whole_of(str.__mod__(template, self)) if isinstance(template, str) else NotImplemented

    def __format__(self, spec: str) -> str:
        return whole(str.__format__(self, spec))

    def __reduce__(self) -> Any:  # pickles (and copies) as the text it is
        return (UserText, (str.__str__(self),))


def _tainting(name: str) -> Any:
    method = getattr(str, name)

    def tainted(self: UserText, *args: Any, **kwargs: Any) -> Any:
        return _whole_of(method(self, *args, **kwargs))

    tainted.__name__ = tainted.__qualname__ = name
    tainted.__doc__ = method.__doc__
    return tainted


for _name in (
    "capitalize", "casefold", "center", "expandtabs", "format", "format_map", "join", "ljust", "lower",
    "partition", "replace", "rjust", "rpartition", "rsplit", "split", "splitlines", "swapcase", "title",
    "translate", "upper", "zfill",
):  # fmt: skip
    setattr(UserText, _name, _tainting(_name))


def _whole_of(value: Any) -> Any:
    """A result built from user text: a string becomes user text, as does every string in a list/tuple."""
    if isinstance(value, str):
        return whole(value)
    if isinstance(value, list):
        return [whole(v) if isinstance(v, str) else v for v in value]
    if isinstance(value, tuple):
        return tuple(whole(v) if isinstance(v, str) else v for v in value)
    return value


def whole(text: str) -> str:
    """`text` with every character marked as the user's (an empty string has none to mark)."""
    if not text:
        return ""
    if isinstance(text, UserText) and text._user_spans == ((0, len(text)),):
        return text
    return UserText(str.__str__(text))


def with_spans(text: str, spans: Iterable[tuple[int, int]]) -> str:
    """Plain `text` with the given user spans: a plain `str` when there are none."""
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if start >= end:
            continue
        if merged and merged[-1][1] >= start:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    if not merged:
        return str.__str__(text)
    made = UserText(text)
    made._user_spans = tuple(merged)
    return made


def spans_of(text: str) -> Spans:
    return text._user_spans if isinstance(text, UserText) else ()


def sliced(text: str, start: int, stop: int) -> str:
    piece = str.__getitem__(text, slice(start, stop))
    spans = ((max(a, start) - start, min(b, stop) - start) for a, b in spans_of(text) if a < stop and b > start)
    return with_spans(piece, spans)


def joined(parts: Iterable[Any]) -> str:
    """`"".join(parts)`, the user spans of every part kept where they land."""
    pieces = list(parts)
    spans: list[tuple[int, int]] = []
    offset = 0
    for piece in pieces:
        spans += [(offset + a, offset + b) for a, b in spans_of(piece)]
        offset += len(piece)
    return with_spans("".join(pieces), spans)


ROLES = frozenset({"system", "user", "assistant", "tool"})


def as_user_message(message: Any) -> Any:
    """A chat message for the template: its content (and every other field) is user text; a known role
    stays plain, since templates build control tokens from it (`'<|' + message['role'] + '|>'`)."""
    if not isinstance(message, dict):
        return as_user_text(message)
    return {
        key: value if key == "role" and value in ROLES and type(value) is str else as_user_text(value)
        for key, value in message.items()
    }


def as_user_text(value: Any) -> Any:
    """Every string inside `value` (dicts, lists) as user text; dict keys are the caller's, kept plain."""
    if isinstance(value, str):
        return whole(value)
    if isinstance(value, dict):
        return {k: as_user_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(as_user_text(v) for v in value)
    return value
