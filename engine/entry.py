"""The `llmplan` command's entry point: one way to end on Ctrl-C, whatever phase it hits.

Python turns SIGINT into KeyboardInterrupt wherever the main thread happens to be: in the middle of
importing torch (a 40-60 line traceback), in a stage (the runner turns it into a run that ran its
cleanup stages), in a cleanup stage itself, or while the interpreter shuts down with torch's native
worker threads and a shard-reader thread still alive (std::terminate: "terminate called without an
active exception", SIGABRT). So: the heavy imports happen inside the guard below, a second Ctrl-C
while the first is being handled is ignored, and an interrupted process leaves through os._exit
after flushing its streams, skipping the interpreter and C++ static teardown that aborted. Every
phase therefore ends the same way: one line "interrupted" on stderr, exit status 130.

Start-up (importing the command, its plugins and the stage plugins, parsing the arguments) runs with
Ctrl-C deferred: a KeyboardInterrupt raised inside torch's import is swallowed by torch itself (its C
code imports numpy and drops any error), so a Ctrl-C there used to be lost and the whole run went
on. The deferred Ctrl-C is acted on as soon as start-up is over, before the command does anything.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

INTERRUPTED = 130


def interrupted_exit(say: bool = True) -> None:
    """Leave with 130 (saying "interrupted" unless the command already did), skipping interpreter teardown."""
    with contextlib.suppress(ValueError):  # ValueError: not the main thread
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the exit itself
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing more to say on it
            stream.flush()
    if say:
        with contextlib.suppress(OSError):
            os.write(2, b"interrupted\n")
    os._exit(INTERRUPTED)


def main(argv: list[str] | None = None) -> int:
    pending: list[int] = []
    with contextlib.suppress(ValueError):  # not the main thread (embedded use): nothing to defer
        signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))

    def ready() -> None:
        """Start-up is over: Ctrl-C raises again, and one that came during start-up takes effect now."""
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if pending:
            raise KeyboardInterrupt

    try:
        from .cli import main as cli_main  # it loads the stage plugins (torch) after parsing, still deferred

        code = cli_main(argv, on_ready=ready)
    except KeyboardInterrupt:
        interrupted_exit()
    if code == INTERRUPTED:
        interrupted_exit(say=False)
    # The command has finished and said how: a Ctrl-C now would only turn its result into a
    # KeyboardInterrupt during interpreter teardown (a traceback and a killed-by-signal status).
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
