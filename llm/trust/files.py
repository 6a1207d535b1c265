"""Reading the small files of a checkpoint (config, index, SHA256SUMS) with bounded, non-blocking reads.

A size limit is enforced on the bytes actually read (limit + 1 are asked for), never on `st_size`,
which is 0 for a FIFO or /dev/zero. Files are opened with O_NONBLOCK so a FIFO with no writer cannot
hang the open, and `fstat` of the open descriptor decides whether it is a regular file. Every failure
is a `FileProblem` whose message names the file and says what is wrong (no exception class names).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

from llmplan.bounded_read import NotRegularFileError, TooLargeError, read_limited

SMALL_FILE_LIMIT = 64 << 20  # config, index, SHA256SUMS, tokenizer files: far below this


class FileProblem(ValueError):
    """A file that cannot be used: missing, not a regular file, too large, unreadable; names the file."""


def describe_os_error(path: str | Path, error: OSError) -> str:
    if error.errno == errno.ELOOP:
        return f"{path}: symlink loop"
    if error.errno == errno.ENOENT:
        return f"{path}: file not found"
    if error.errno == errno.EISDIR:
        return f"{path}: is a directory, not a file"
    if error.errno == errno.EACCES:
        return f"{path}: permission denied"
    return f"{path}: cannot read ({error.strerror or error})"


def read_bytes_limited(path: str | Path, limit: int = SMALL_FILE_LIMIT) -> bytes:
    try:
        return read_limited(path, limit)
    except TooLargeError:
        raise FileProblem(f"{path}: larger than the {limit}-byte limit for this file; refused") from None
    except (NotRegularFileError, IsADirectoryError) as bad:  # the message names the file and says what it is
        raise FileProblem(str(bad)) from None
    except OSError as error:
        raise FileProblem(describe_os_error(path, error)) from None


def read_text_limited(path: str | Path, limit: int = SMALL_FILE_LIMIT) -> str:
    raw = read_bytes_limited(path, limit)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise FileProblem(f"{path}: not UTF-8 text ({bad.reason} at byte {bad.start})") from None


def read_json_limited(path: str | Path, limit: int = SMALL_FILE_LIMIT) -> Any:
    text = read_text_limited(path, limit)
    try:
        return json.loads(text)
    except json.JSONDecodeError as bad:
        raise FileProblem(f"{path}: not valid JSON ({bad.msg} at line {bad.lineno} column {bad.colno})") from None
    except RecursionError:
        raise FileProblem(f"{path}: JSON nested too deeply; refused") from None
    except ValueError as bad:  # Python's own limit: an integer of more than 4300 digits
        what = "a number with too many digits" if "digits" in str(bad) else "a value Python cannot read"
        raise FileProblem(f"{path}: holds {what}; refused") from None
