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
counters, and how many guesses pay. A pass over 1 + k inputs costs more than a one-token step (`PassCosts`:
measured on the passes the loop runs, a prior until then), and guess i is accepted only if guesses 1..i-1
were, so with a per-guess acceptance p the pass delivers 1 + p + .. + p^k tokens on average. Each pass takes
the k (0 .. K) that delivers the most tokens per unit of cost; k = 0 is a plain step. p is kept per length of
the suffix that matched (a 3-gram match is copied text far more often than a 1-gram one), decayed so it
follows the answer from quoting to free text and back, and it is learnt on plain steps too: the guess a row
did not make is checked against the token it then picked, for free, so a row stops guessing the moment its
matches stop being right and resumes the moment they are right again.

`DraftGuesser` is the same for a request whose guesses come from a draft model (llm/generation/draft_model.py): how many
guesses a pass should ask of the draft, priced the same way with the draft's own steps added to the cost,
and acceptance learnt from the guesses verified. A draft's guess is never free to check, so a row that
stopped drafting drifts back toward the prior over its plain steps and tries again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from ..sampling.picks import Pick

ROW_COST = 0.15  # prior: each input past the first adds this share of a one-token pass (a 2-row pass ≈ 1.14x)
COST_SMOOTHING = 0.2  # the weight of a new measured pass of several inputs in PassCosts
ONE_SMOOTHING = 0.3  # the weight of a new one-input pass in its recent average
RELAX = 0.02  # per one-input pass, the share of the way a measured cost moves back toward the prior
MARGIN = 1.15  # a pass with guesses must promise this many times a plain step's tokens per second
DECAY = 0.9  # per observation, the weight left to older ones in a match length's acceptance
# (accepted, tested) a match length starts from: p = 0.25, outweighed by a few observations. Cautious, since
# the checks on plain steps learn p for free: a row guesses once its matches have shown they are right.
PRIOR = (0.5, 2.0)
DRAFT_COST_PRIOR = 0.3  # a draft step against a one-input target pass, until both are measured
DRAFT_PRIOR = (1.6, 2.0)  # (accepted, tested) a drafting request starts from: p = 0.8 (a draft is chosen to agree)
DRAFT_RELAX = 0.05  # per plain step of a row that drafted nothing, the share of the way p moves to the prior


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
        return self.match(seen, k)[1]

    def match(self, seen: list[int], k: int) -> tuple[int, list[int]]:
        """(n, guesses): the length of seen's longest suffix that occurred before (0: none) and up to k tokens
        that followed its latest occurrence."""
        end = len(seen)
        # Index the n-grams that end before the current end (the suffix itself must match an earlier one).
        for stop in range(self.indexed, end):
            for n in range(1, min(self.ngram, stop) + 1):
                self.latest[n - 1][tuple(seen[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end)
        for n in range(min(self.ngram, end - 1), 0, -1):
            at = self.latest[n - 1].get(tuple(seen[end - n :]))
            if at is not None and at < end:
                return n, seen[at : at + k]
        return 0, []


@dataclass
class PassCosts:
    """What a decode pass (no prompt chunk) costs by its inputs, as a multiple of a one-input pass; shared by
    the requests of a model, measured on the passes its loops run.

    A busy machine (this one is shared) slows passes by whole multiples from one second to the next, so a pass
    of w inputs is compared with the one-input passes just before it (a fast-moving average), never with an
    old absolute time, and one comparison moves the estimate by a bounded step. A width that looked costly is
    not written off for good: every one-input pass relaxes the estimates a little back toward the prior
    (1 + ROW_COST per input past the first), so a width is tried again after a while."""

    one: float | None = None  # recent seconds of a one-input pass
    ratio: dict[int, float] = field(default_factory=dict)  # inputs -> measured multiple of a one-input pass
    samples: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def prior(inputs: int) -> float:
        return 1 + ROW_COST * (inputs - 1)

    def add(self, inputs: int, seconds: float) -> None:
        if inputs == 1:
            self.one = seconds if self.one is None else (1 - ONE_SMOOTHING) * self.one + ONE_SMOOTHING * seconds
            for w, r in self.ratio.items():
                self.ratio[w] = r + RELAX * (self.prior(w) - r)
            return
        if self.one is None:
            return
        old, n = self.cost(inputs), self.samples.get(inputs, 0)
        seen = min(max(seconds / self.one, old / 2, 1.0), 2 * old)  # a pass caught by a busy moment moves it 2x at most
        weight = max(COST_SMOOTHING, 1 / (n + 2))  # the first passes of a width outweigh its prior fast
        self.ratio[inputs], self.samples[inputs] = (1 - weight) * old + weight * seen, n + 1

    def cost(self, inputs: int) -> float:
        return 1.0 if inputs <= 1 else self.ratio.get(inputs, self.prior(inputs))

    def relative(self, base: int, k: int) -> float:
        """What k more inputs cost on a pass of `base` inputs, as a multiple of that pass."""
        return self.cost(base + k) / self.cost(base) if k else 1.0


def best_guesses(p: float, most: int, cost: Callable[[int], float]) -> int:
    """The k in 0..most with the most tokens delivered per unit of pass cost, for a per-guess acceptance p;
    0 unless some k beats a plain step by MARGIN (p is an estimate from a few guesses, made just when recent
    ones were right, so it runs high: at a 5 % margin free-form answers lost up to 9 % on such guesses, at
    15 % none lost, benchmarks/speculative-decode.md)."""
    best, best_rate, delivered, term = 0, MARGIN, 1.0, 1.0
    for k in range(1, most + 1):
        term *= p
        delivered += term
        rate = delivered / cost(k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class Speculator:
    """One request's prompt lookup: proposes guesses, learns how often each match length is right."""

    tokens: int  # the most guesses a pass verifies (K)
    ngram: int  # the longest suffix matched (N)
    index: NgramIndex = field(init=False)
    guessed: int = 0  # guesses verified, over the request
    accepted: int = 0  # of those, accepted
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (generated before, guessed, accepted)
    # per match length n (index n - 1): decayed (accepted, tested) guesses, made or only checked
    seen_right: list[list[float]] = field(init=False)
    _matched: int = 0  # the match length of the guesses out for verification
    _unmade: tuple[int, int] | None = None  # (match length, first guess) of a guess not made this step
    checked: int = 0  # guesses checked on plain steps (not made)

    def __post_init__(self) -> None:
        self.index = NgramIndex(self.ngram)
        self.seen_right = [list(PRIOR) for _ in range(self.ngram)]

    def acceptance(self, n: int) -> float:
        """The estimated share of guesses accepted after a match of length n."""
        right, tested = self.seen_right[n - 1]
        return right / tested

    def propose(self, seen: list[int], room: int, cost: Callable[[int], float] | None = None) -> list[int]:
        """Guesses for the row's next pass, at most `room` (what its cache, limit and the step allow); `cost(k)`:
        that pass with k guesses against one without (default: the prior)."""
        self._unmade = None
        n, guesses = self.index.match(seen, min(self.tokens, room)) if room > 0 else (0, [])
        if not guesses:
            return []
        price = cost if cost is not None else (lambda k: 1 + ROW_COST * k)
        k = best_guesses(self.acceptance(n), len(guesses), price)
        if k == 0:
            self._unmade = (n, guesses[0])  # checked against the token this step picks
            return []
        self._matched = n
        return guesses[:k]

    def _learn(self, n: int, right: float, tested: float) -> None:
        stats, keep = self.seen_right[n - 1], DECAY**tested
        stats[0], stats[1] = keep * stats[0] + right, keep * stats[1] + tested

    def observe(self, token: int) -> None:
        """The token a plain step picked: the guess not made (if any) was right or wrong."""
        if self._unmade is not None:
            n, guess = self._unmade
            self._unmade = None
            self.checked += 1
            self._learn(n, float(token == guess), 1.0)

    def record(self, generated: int, guessed: int, accepted: int) -> None:
        """A verify step's outcome: counted, and the acceptance of its match length updated (the guesses
        tested: those accepted and the first rejected one; the ones after it say nothing)."""
        self.guessed += guessed
        self.accepted += accepted
        self.steps.append((generated, guessed, accepted))
        self._learn(self._matched, accepted, accepted + (accepted < guessed))


@dataclass
class DraftGuesser:
    """One request's drafting: how many guesses to ask of the draft, and how often they were right."""

    tokens: int  # the most guesses a pass verifies (K)
    guessed: int = 0
    accepted: int = 0
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (generated before, guessed, accepted)
    seen_right: list[float] = field(default_factory=lambda: list(DRAFT_PRIOR))  # decayed (accepted, tested)
    checked: int = 0  # kept 0: a draft's guess is never free to check (the prompt-lookup field's twin)

    def acceptance(self) -> float:
        return self.seen_right[0] / self.seen_right[1]

    def plan(self, room: int, cost: Callable[[int], float], draft_cost: float) -> int:
        """Guesses to ask for: the k in 0..min(K, room) with the most tokens per unit of cost, where a pass
        with k guesses costs `cost(k)` (the target's, against a pass without them) plus k draft steps of
        `draft_cost` each (in the same unit)."""
        most = min(self.tokens, room)
        return best_guesses(self.acceptance(), most, lambda k: cost(k) + k * draft_cost) if most > 0 else 0

    def observe(self, token: int) -> None:
        """A plain step: the row made no guess; its estimate drifts back toward the prior, to try again."""
        right, tested = self.seen_right
        prior = DRAFT_PRIOR[0] / DRAFT_PRIOR[1]
        self.seen_right[0] = right + DRAFT_RELAX * (prior * tested - right)

    def record(self, generated: int, guessed: int, accepted: int) -> None:
        self.guessed += guessed
        self.accepted += accepted
        self.steps.append((generated, guessed, accepted))
        tested = accepted + (accepted < guessed)  # the guesses after the first rejected one say nothing
        keep = DECAY**tested
        self.seen_right[0] = keep * self.seen_right[0] + accepted
        self.seen_right[1] = keep * self.seen_right[1] + tested


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
