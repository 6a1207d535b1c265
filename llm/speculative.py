"""Speculative decoding by prompt lookup: guess a row's next tokens from its own text, verify them in one pass.

At batch 1 a decode step reads every weight for one token; a pass over the last token and K guesses reads
them once for up to K + 1 tokens. Prompt lookup (Saxena 2023; llama.cpp's ngram modes, vLLM's n-gram
proposer, transformers' `prompt_lookup_num_tokens`) needs no second model: the guesses are the tokens that
followed the most recent earlier occurrence of the row's last n tokens (n from `ngram` down to 1) in the
prompt and output so far. Answers that quote their input (summaries, code edits, extraction) accept many.

Verification (`accept`) picks each position's token with the row's own picker, in order, and keeps going
while the pick equals the guess. For a deterministic proposal (a point mass on guess g) this is the standard
speculative rejection rule: the pick equals g with probability p(g) (accept), and otherwise it is a draw
from p conditioned on not being g, i.e. p with g removed and renormalised. Each emitted token is thus a
draw from the very distribution plain decoding draws from, with the same penalties (the picker sees the
accepted tokens before the next position), and greedy picks are the argmax either way: the same answers,
token for token. With a seeded picker the draws are even made in the same order as without speculation.

`Speculator` keeps one request's state: its n-gram index (grown by the tokens seen, never rebuilt), its
counters, and the back-off: where acceptance stays low it proposes fewer tokens, then pauses (a paused row
decodes as usual and costs nothing extra), and tries again after a pause that doubles while it keeps failing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from .generation import Pick

LOW_ACCEPTANCE = 0.25  # below this share of guesses accepted (smoothed), a row proposes fewer, then none
SMOOTHING = 0.3  # the weight of the newest verify step in the smoothed acceptance
FIRST_PAUSE, LONGEST_PAUSE = 8, 128  # decode steps without guessing after acceptance fell low


@dataclass
class NgramIndex:
    """For n = 1..ngram, the latest position where each n-gram of `seen` ended (among those before its end)."""

    ngram: int
    latest: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    indexed: int = 0  # n-grams ending at positions < indexed are in `latest`

    def __post_init__(self) -> None:
        self.latest = [{} for _ in range(self.ngram)]

    def guesses(self, seen: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of seen's longest matching suffix."""
        end = len(seen)
        # Index the n-grams that end before the current end (the suffix itself must match an earlier one).
        for stop in range(self.indexed, end):
            for n in range(1, min(self.ngram, stop) + 1):
                self.latest[n - 1][tuple(seen[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end)
        for n in range(min(self.ngram, end - 1), 0, -1):
            at = self.latest[n - 1].get(tuple(seen[end - n :]))
            if at is not None and at < end:
                return seen[at : at + k]
        return []


@dataclass
class Speculator:
    """One request's prompt lookup: proposes guesses, learns from how many were accepted, backs off."""

    tokens: int  # the most guesses a pass verifies (K)
    ngram: int  # the longest suffix matched (N)
    index: NgramIndex = field(init=False)
    guessed: int = 0  # guesses verified, over the request
    accepted: int = 0  # of those, accepted
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (generated before, guessed, accepted)
    rate: float = 1.0  # smoothed share of guesses accepted
    pause: int = 0  # decode steps left without guessing
    next_pause: int = FIRST_PAUSE

    def __post_init__(self) -> None:
        self.index = NgramIndex(self.ngram)

    @property
    def budget(self) -> int:
        """Guesses the next pass may verify: K while acceptance holds, fewer as it falls."""
        if self.pause:
            return 0
        return max(1, round(self.tokens * min(1.0, 2 * self.rate)))

    def propose(self, seen: list[int], room: int) -> list[int]:
        """Guesses for the row's next pass, at most `room` (what its cache, limit and the step allow)."""
        if self.pause:
            self.pause -= 1
            return []
        k = min(self.budget, room)
        return self.index.guesses(seen, k) if k > 0 else []

    def record(self, generated: int, guessed: int, accepted: int) -> None:
        """A verify step's outcome: counted, and the back-off updated."""
        self.guessed += guessed
        self.accepted += accepted
        self.steps.append((generated, guessed, accepted))
        self.rate = (1 - SMOOTHING) * self.rate + SMOOTHING * (accepted / guessed)
        if self.rate < LOW_ACCEPTANCE:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, LONGEST_PAUSE)
            self.rate = 0.5  # the retry starts at half the budget
        elif accepted == guessed:
            self.next_pause = FIRST_PAUSE


def accept(
    pick: Callable[[Tensor, list[int]], Pick],
    logits: Tensor,
    guesses: list[int],
    seen: list[int],
    deliver: Callable[[Pick], bool],
) -> int:
    """Verify `guesses` against logits [len(guesses) + 1, V] of the pass over the row's last token and them.

    Each position's token is picked (`pick(logits[i], seen)`, seen growing by each token delivered) and handed
    to `deliver`, which returns False once the row has ended; verification stops there, at the first pick
    that differs from its guess, or after the pick past the last guess. Returns the tokens delivered (at
    least 1): all but the last of them are accepted guesses."""
    delivered = 0
    for i in range(len(guesses) + 1):
        chosen = pick(logits[i], seen)
        delivered += 1
        if not deliver(chosen) or i == len(guesses) or chosen.token != guesses[i]:
            break
    return delivered
