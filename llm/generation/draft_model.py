"""Speculative decoding with a draft model: a smaller (or more quantized) model of the same vocabulary guesses
the next tokens greedily, the target verifies them all in one pass (llm/generation/speculative.py `accept`).

The guesses are point masses (the draft's argmax), so the verification rule that keeps prompt lookup's
answers exact keeps these exact too: greedy answers equal plain decoding token for token, sampled ones keep
its distribution, whatever the draft says. The draft only decides how many tokens a pass delivers.

`DraftModel` runs the draft over a slot cache of its own with the target's slots (target slot i is draft
slot i) and sizes. It keeps no per-request bookkeeping: before each use a slot is brought to the row's text
by what it already holds (`SlotCache.held`): the common prefix is kept, the rest fed in chunks. So a
request's prompt rides along with the target's prompt chunks (`follow`, the same step), rejected guesses
are cut off the next time the row drafts, a row that paused drafting catches up in one pass, and a slot a
new request inherits keeps the prefix they share (a chat's system prompt) as the target's slot does.

All the rows drafting in a step draft together: one flat pass of the draft per guess position.

How many guesses a row asks for is the request's side, `DraftGuesser` (llm/generation/speculative.py).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..kv.slot_cache import SlotCache
from .flat_batch import FlatBatch, Part
from .model_runner import ModelRunner
from .outputs import is_oom, release_memory

CHUNK = 512  # draft tokens fed per row per pass while catching up (a prompt rides in chunks like this)
MIN_CONFIDENCE = 0.25  # a guess the draft itself gives less probability than this is not made
SMOOTHING = 0.3  # the weight of a new measured draft step in its running average


class DraftModel:
    """The draft's model on a slot cache shaped like the target's."""

    def __init__(self, runner: ModelRunner, cache: SlotCache, vocab_size: int) -> None:
        self.runner, self.cache = runner, cache
        self.vocab_size = vocab_size  # the target's: a draft token past it is not a guess
        self.step_s: float | None = None  # recent seconds of a one-token-per-row draft pass
        self.steps = 0  # draft passes run

    @property
    def slots(self) -> int:
        return self.cache.slots

    def follow(self, rows: list[tuple[int, list[int]]]) -> None:
        """Bring each (slot, text) to hold the K/V of all of `text` (a prompt chunk the target just ran); out of
        memory, it is left behind (it catches up when the row next drafts)."""
        try:
            self._catch_up(rows, want=False)
        except RuntimeError as err:
            if not is_oom(err):
                raise
            release_memory(self.cache.device)

    def propose(self, rows: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """For each (slot, seen, most): up to `most` greedy draft tokens following `seen`; fewer where the draft
        is unsure of the next one or it falls outside the target's vocabulary. Out of memory: the guesses made
        so far (speculation is an option: the rows decode on without it)."""
        out: list[list[int]] = [[] for _ in rows]
        try:
            self._propose(rows, out)
        except RuntimeError as err:
            if not is_oom(err):
                raise
            release_memory(self.cache.device)
        return out

    def _propose(self, rows: list[tuple[int, list[int], int]], out: list[list[int]]) -> None:
        live = [i for i, (_, _, most) in enumerate(rows) if most > 0]
        if not live:
            return
        logits = self._catch_up([(rows[i][0], rows[i][1]) for i in live], want=True)
        while True:
            assert logits is not None
            picked = self._picks(logits)
            going = []
            for i, token in zip(live, picked, strict=True):
                if token is None:
                    continue
                out[i].append(token)
                if len(out[i]) < rows[i][2]:
                    going.append(i)
            if not going:
                return
            live = going
            logits = self._pass([Part(rows[i][0], 0, [out[i][-1]], True) for i in live], timed=True)

    def _picks(self, logits: Tensor) -> list[int | None]:
        """Each row's argmax, or None where the draft gives it less than MIN_CONFIDENCE or the target has no
        such token."""
        probs = logits.float().softmax(-1)
        best, token = probs.max(-1)
        return [
            t if p >= MIN_CONFIDENCE and t < self.vocab_size else None
            for p, t in zip(best.tolist(), token.tolist(), strict=True)
        ]

    def _catch_up(self, rows: list[tuple[int, list[int]]], *, want: bool) -> Tensor | None:
        """Feed each slot what it lacks of its text; with `want`, the logits after each text's last token
        (so at least that token is fed again when the slot holds it all), in the order of `rows`."""
        cache, todo = self.cache, []
        for i, (slot, text) in enumerate(rows):
            keep = min(cache.common_prefix(slot, text), len(text) - 1 if want else len(text))
            if not cache.can_resume(slot, keep):  # a sliding layer's ring moved past it: start over
                keep = 0
            cache.truncate(slot, keep)
            todo.append((i, keep))
        ended: list[int] = []  # row indices in the order their logits come
        pieces: list[Tensor] = []
        while todo:
            parts, later, ending = [], [], []
            for i, at in todo:
                slot, text = rows[i]
                n = min(len(text) - at, CHUNK, cache.max_write)
                last = at + n == len(text)
                if n:
                    parts.append(Part(slot, 0, text[at : at + n], last and want))
                    ending += [i] if last and want else []
                if not last:
                    later.append((i, at + n))
            if parts:
                out = self._pass(parts, timed=False)
                if ending:
                    pieces.append(out)
                    ended += ending
            todo = later
        if not want:
            return None
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if ended == sorted(ended):
            return flat
        back = torch.empty_like(flat)
        back[torch.tensor(ended)] = flat
        return back

    def _pass(self, parts: list[Part], *, timed: bool) -> Tensor:
        cache = self.cache
        slots = [p.row for p in parts]
        starts = cache.claim(slots, [p.tokens for p in parts])
        parts = [Part(p.row, s, p.tokens, p.logits) for p, s in zip(parts, starts, strict=True)]
        began = time.perf_counter()
        try:
            with torch.inference_mode():
                logits = self.runner.forward(FlatBatch(parts), cache)
        except BaseException:
            cache.unclaim(slots, starts)
            raise
        self.steps += 1
        if timed:
            seconds = time.perf_counter() - began
            self.step_s = seconds if self.step_s is None else (1 - SMOOTHING) * self.step_s + SMOOTHING * seconds
        return logits
