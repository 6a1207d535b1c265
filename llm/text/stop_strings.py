"""Stop strings: ending a sequence when its text contains one, and streaming text without ever showing one.

OpenAI and vLLM return the text before the stop string; a stream must then not show the stop string either,
even though its first characters arrive before anyone can know they begin it. `StopStringStream` holds back
exactly the tail of the text that could still grow into a stop string, and drops the stop string when it
completes, so what was streamed is always a prefix of the final text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

TAIL_TOKENS = 64  # a stop string is looked for in the decoded text of the last this-many generated tokens


def stop_checker(tokenizer: Any, stops: Sequence[str]) -> Callable[[list[int]], bool] | None:
    """generated ids -> whether their decoded tail holds a stop string (None without stop strings)."""
    if not stops:
        return None
    wanted = tuple(stops)

    def check(ids: list[int]) -> bool:
        tail = tokenizer.decode(ids[-TAIL_TOKENS:], skip_special_tokens=True)
        return any(s in tail for s in wanted)

    return check


class StopStringStream:
    """Passes text pieces to `emit`, holding back what may be the start of a stop string."""

    def __init__(self, emit: Callable[[str], None], stops: Sequence[str]) -> None:
        self.emit, self.stops = emit, tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def push(self, piece: str) -> None:
        if self.stopped or not piece:
            return
        if not self.stops:
            self.emit(piece)
            return
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            before, self.pending = self.pending[: min(hits)], ""
            if before:
                self.emit(before)
            return
        keep = self._open_tail()
        ready = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        if ready:
            self.emit(ready)

    def end(self) -> None:
        """The sequence ended without a stop string: what was held back is text after all."""
        if not self.stopped and self.pending:
            self.emit(self.pending)
        self.pending = ""

    def _open_tail(self) -> int:
        """Length of the longest end of `pending` that is the beginning of some stop string."""
        longest = min(len(self.pending), max(len(s) for s in self.stops) - 1)
        for size in range(longest, 0, -1):
            tail = self.pending[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
