"""The hostile corpus's shared checks: a clean refusal, a time bound, a memory bound, and a byte-for-byte
snapshot proving that nothing outside llmplan's own files changed.

Every case of tests/trust/test_hostile_*.py uses these, so "refused cleanly" means one thing everywhere:
a non-zero exit, the file or field named on stderr, no exception class name and no traceback, no hang
past the bound, no memory past the bound, and the user's files exactly as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import resource
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

EXCEPTION_NAME = re.compile(r"\b[A-Z]\w*(Error|Exception|Interrupt|Warning)\b|Traceback|\bFile \"/")
Snapshot = dict[str, tuple[str, int, str]]


def snapshot(*roots: Path) -> Snapshot:
    """Every entry under the roots (not following links): its kind, permission bits and content digest.

    FIFOs, sockets and devices are recorded by kind only: reading one could block or never end.
    """
    seen: Snapshot = {}
    for root in roots:
        root = Path(root)
        if not os.path.lexists(root):
            seen[str(root)] = ("absent", 0, "")
            continue
        for path in [root, *sorted(root.rglob("*"))] if root.is_dir() and not root.is_symlink() else [root]:
            info = os.lstat(path)
            mode = stat.S_IMODE(info.st_mode)
            if stat.S_ISLNK(info.st_mode):
                seen[str(path)] = ("link", mode, os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                seen[str(path)] = ("dir", mode, "")
            elif stat.S_ISREG(info.st_mode):
                seen[str(path)] = ("file", mode, hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                seen[str(path)] = ("special", mode, "")
    return seen


def assert_untouched(before: Snapshot, *roots: Path) -> None:
    """The roots hold exactly what they held: no entry added, removed, or changed by one byte."""
    after = snapshot(*roots)
    changed = sorted(set(before) ^ set(after) | {p for p in before.keys() & after.keys() if before[p] != after[p]})
    assert not changed, f"llmplan changed files it did not create: {changed[:10]}"


@contextlib.contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Fail the case (not the whole suite) if it runs past `seconds`: a hang is a finding, not a wait."""

    def expire(signum: int, frame: object) -> None:
        raise AssertionError(f"hung: over {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@contextlib.contextmanager
def memory_bound(mb: float) -> Iterator[None]:
    """The process's peak RSS grows by at most `mb` MiB inside the block (peaks are monotonic, so a case
    that allocated a huge buffer shows here even if it freed it again)."""
    start = peak_rss_mb()
    yield
    grown = peak_rss_mb() - start
    assert grown <= mb, f"peak memory grew by {grown:.0f} MiB (bound {mb} MiB)"


def assert_clean_message(stderr: str, names: Iterable[str] = ()) -> None:
    """stderr names what was wrong, and reads as a sentence: no exception class name, no traceback."""
    text = stderr.strip()
    assert text, "refused without saying why"
    assert not EXCEPTION_NAME.search(text), f"exception name or traceback in the message: {text[-600:]}"
    for name in names:
        assert name in text, f"{name!r} not named in: {text[-600:]}"


def refused(
    argv: Sequence[str],
    capsys: pytest.CaptureFixture[str],
    *,
    names: Iterable[str] = (),
    seconds: float = 60,
    memory_mb: float = 1024,
) -> str:
    """Run the command line in-process; it must refuse cleanly within the bounds. Returns what it said
    (stderr, then stdout: `validate` reports its findings on stdout)."""
    from llmplan.engine.cli import main

    capsys.readouterr()
    with time_bound(seconds), memory_bound(memory_mb):
        code = main(list(argv))
    out = capsys.readouterr()
    said = out.err + out.out
    assert code not in (0, None), f"accepted (exit 0): {said[-600:]}"
    assert_clean_message(said, names)
    return said


@dataclass
class Child:
    code: int
    stdout: str
    stderr: str


def run_child(
    argv: Sequence[str],
    *,
    seconds: float = 120,
    memory_mb: float = 3072,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdin: str | None = None,
) -> Child:
    """`python -m llmplan ARGV` in a child watched for time and memory.

    A watcher reads the child's RSS every 20 ms and kills it past `memory_mb` (before the kernel's OOM
    killer would take the machine's other work with it); past `seconds` it is killed and the case fails.
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "llmplan", *argv],
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    over = threading.Event()

    def watch() -> None:
        status = Path(f"/proc/{process.pid}/status")
        while process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                # an exited child not yet reaped (a zombie) has a status without VmRSS
                line = next((x for x in status.read_text().splitlines() if x.startswith("VmRSS:")), None)
                if line is not None and int(line.split()[1]) / 1024 > memory_mb:
                    over.set()
                    process.kill()
                    return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        stdout, stderr = process.communicate(stdin, timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise AssertionError(f"hung: over {seconds} s") from None
    watcher.join(1)
    assert not over.is_set(), f"killed past {memory_mb} MiB of memory"
    return Child(process.returncode, stdout, stderr)
