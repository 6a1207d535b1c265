"""One sentence for an exception nobody turned into a message: what went wrong, naming the file where one
is known, and what to do — never an exception class name (those are for `--debug` and traceback.txt).

Shared by every layer (the CLI's last-resort handler, the runner, the stages): a disk that fills up, a
file that is not UTF-8 or a number too long to convert can surface from anywhere.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from pathlib import PurePath
from types import TracebackType

_CLASS_NAME = re.compile(r"\b[A-Z]\w*(?:Error|Exception|Warning)\b")
_FILE_LOCALS = ("path", "filename", "file_path", "target", "out", "destination")
_MAX_SHOWN = 300  # characters of an exception's own message

# What to do about the common OS errors, by errno (strerror says what happened, not what to do).
_ERRNO_ADVICE = {
    errno.ENOSPC: "no space left on the device; free some space (or write elsewhere) and run again",
    errno.EDQUOT: "disk quota exceeded; free some space (or write elsewhere) and run again",
    errno.EACCES: "permission denied; check the file's permissions or choose another path",
    errno.EPERM: "operation not permitted; check the file's permissions or choose another path",
    errno.EROFS: "the file system is read-only; choose a writable path",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a part of the path is not a directory",
    errno.EISDIR: "is a directory, not a file",
    errno.EEXIST: "already exists",
    errno.EIO: "input/output error (a failing disk or a dropped network mount?)",
    errno.EMFILE: "too many open files; raise the limit (ulimit -n) or run fewer requests at once",
    errno.ENFILE: "the system has too many open files; try again later",
    errno.ENAMETOOLONG: "the file name is too long",
    errno.ELOOP: "too many levels of symbolic links",
    errno.EFBIG: "the file is too large for the file system",
    errno.ENOMEM: "out of memory; free memory, or use a smaller model, batch or KV cache",
    errno.EPIPE: "the reader of the output went away",
}


def plain_error(error: BaseException) -> str:
    """The sentence for `error` (see the module doc)."""
    where = file_of(error)
    prefix = f"{where}: " if where else ""
    if isinstance(error, OSError) and error.errno is not None:
        advice = _ERRNO_ADVICE.get(error.errno) or (error.strerror or os.strerror(error.errno)).lower()
        other = getattr(error, "filename2", None)
        return f"{prefix}{advice}" + (f" ({other})" if other else "")
    if isinstance(error, UnicodeDecodeError):
        return f"{prefix}not valid {error.encoding.upper()} text ({error.reason} at byte {error.start})"
    if isinstance(error, UnicodeEncodeError):
        return (
            f"{prefix}a character cannot be written as {error.encoding} ({error.reason}); "
            "set PYTHONIOENCODING=utf-8 or use a UTF-8 locale"
        )
    if isinstance(error, MemoryError) or "out of memory" in str(error).lower():
        return f"{prefix}out of memory; free memory, or use a smaller model, batch or KV cache"
    if isinstance(error, RecursionError):
        return f"{prefix}the input is nested too deeply to process; refused"
    text = error_detail(error)
    if isinstance(error, ValueError) and "digits" in text and "limit" in text.lower():
        return f"{prefix}a number with more than {_digit_limit()} digits is too long; use a shorter one"
    if isinstance(error, OverflowError):
        return f"{prefix}a number is too large ({text or 'overflow'})"
    if type(error).__name__ == "SafetensorError":  # safetensors' Rust errors: damaged or not a safetensors file
        return f"{prefix}not a readable safetensors file ({text or 'damaged'}); re-download or re-save it"
    return f"{prefix}failed unexpectedly ({text or 'no details'}); run with --debug for the traceback"


def file_of(error: BaseException) -> str | None:
    """The file the error is about: its own `filename`, else the innermost frame of its traceback that
    holds a path in a variable named like one (`path`, `filename`, `target`...)."""
    own = getattr(error, "filename", None)
    if isinstance(own, (str, PurePath)) and str(own):
        return str(own)
    frames: list[TracebackType] = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    for frame in reversed(frames):
        local = frame.tb_frame.f_locals
        for name in _FILE_LOCALS:
            value = local.get(name)
            if isinstance(value, PurePath) or (isinstance(value, str) and os.sep in value and len(value) < 4096):
                return str(value)
    return None


def error_detail(error: BaseException) -> str:
    """The exception's own message on one line, shortened, with class names put into words: for a
    parenthesis after a sentence that already says what failed ("not a readable GGUF file (...)")."""
    text = " ".join(str(error).split())
    if isinstance(error, KeyError) and len(error.args) == 1:
        text = f"missing key {error.args[0]!r}"
    text = _CLASS_NAME.sub("error", text)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 1] + "…"


def _digit_limit() -> int:
    return sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300
