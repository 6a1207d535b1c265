"""Deterministic beam search, step for step the algorithm of transformers' `generate(num_beams=N,
do_sample=False)` (>= 4.50 vectorized rewrite), so tokens and `sequences_scores` match it.

Per step: take the top K = max(2, 1 + len(eos_ids)) * num_beams continuations over all beams by summed
log-probability. Those ending in EOS or reaching max_new_tokens are *finished*: only if among the top
num_beams, scored sum / generated_length ** length_penalty (EOS counted in the length), and kept if in the
best num_beams finished so far. The best num_beams unfinished continue. Search stops when no running beam
can beat the worst finished one (the `early_stopping` heuristics below), when all continuations finish, or
at max_new_tokens. The cache holds one row per beam; rows are reordered in place after each step.

Why beam search is not a request kind of the engine loop (llm/generation/engine_loop.py), measured on SmolLM2-135M fp32,
2 CPU threads shared with other work, 4 beams, 256 prompt tokens, median of 32 steps, 3 runs: after every
step the beams take over each other's cache rows, and that reorder cost 9.5-29 ms against 43-48 ms for the
4-row decode pass itself (20-67 %). The loop's slot cache has no row copy at all (its slots are one request
each, with their own write pointer), and its post-step picks each row alone, where a beam step picks the
best 2N continuations over all N rows' logits together. As a request kind it would need both: a slot-to-slot
copy in the slot cache and a post-step that takes a request's rows at once; until then it runs here, a
static batch of its own over the whole cache (a served plan refuses num_beams > 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kv.cache import KVCache
from ..model.transformer import Transformer
from ..sampling.format_compiler import CompiledFormat
from ..sampling.token_mask import BeamMasks
from .ending import FinishReason, end_after_token
from .model_runner import ModelRunner

_NEG = -1.0e9  # transformers' "impossible" score; the same constant keeps tie-breaking identical


@dataclass
class Candidate:
    tokens: list[int]  # generated only, EOS included when finish_reason is "eos"
    score: float  # sum of token log-probs / len(tokens) ** length_penalty
    finish_reason: FinishReason


def beam_search(
    model: Transformer,
    cache: KVCache,
    prompt: list[int],
    *,
    num_beams: int,
    max_new_tokens: int,
    eos_ids: set[int],
    length_penalty: float = 1.0,
    num_return_sequences: int = 1,
    early_stopping: bool | Literal["never"] = False,
    runner: ModelRunner | None = None,
    grammar: CompiledFormat | None = None,
    allowed: list[int] | None = None,
) -> list[Candidate]:
    """The best `num_return_sequences` finished beams, best first. The cache needs num_beams rows.

    early_stopping: True stops once num_beams beams are finished; False stops when the best running beam,
    at its current length, cannot beat the worst finished one; "never" assumes (for length_penalty > 0)
    the running beam could still grow to max_new_tokens, i.e. searches on longer.
    runner: the model runner bound to `cache`'s memory; default: one built here.
    grammar: a format every beam obeys: each beam's logits are masked by its own matcher before they are
    scored (so scores are log-probs under the constraint), and only candidates that finished by EOS or at
    the length limit are returned (a grammar may allow fewer sequences than beams).
    allowed: with a grammar, extended by how many tokens the mask allowed the best running beam, per step.

    Kept apart from the engine loop, with the reason measured at the top of this module.
    """
    _check_search(cache, prompt, num_beams, max_new_tokens, num_return_sequences)
    runner = runner or ModelRunner(model, cache)
    device = model.device
    beams = _Beams(num_beams, max_new_tokens, eos_ids, length_penalty, early_stopping, device)
    masks = BeamMasks(grammar, num_beams) if grammar is not None else None
    with torch.inference_mode():
        logits = _prefill_every_beam(runner, cache, prompt, num_beams, device)
        for step in range(max_new_tokens):
            if masks is not None:
                logits = masks.apply(logits)
            beam_index = beams.advance(step, logits)
            if beam_index is None:
                break
            if masks is not None:
                alive = torch.isfinite(beams.running_scores).tolist()
                masks.follow(beam_index.tolist(), beams.running[:, step].tolist(), alive)
            cache.reorder(beam_index)
            if not cache.make_room(1):
                break
            logits = runner.static_decode(beams.running[:, step : step + 1], cache.next_positions(), cache)[:, -1]
    if masks is not None and allowed is not None:
        allowed.extend(masks.allowed)
    return beams.best(num_return_sequences, eos_ids, max_new_tokens, only_finished=masks is not None)


def _check_search(
    cache: KVCache, prompt: list[int], num_beams: int, max_new_tokens: int, num_return_sequences: int
) -> None:
    """ValueError for a search that cannot run: more sequences than beams, nothing to do, a cache too small."""
    if not 1 <= num_return_sequences <= num_beams:
        raise ValueError(f"num_return_sequences ({num_return_sequences}) must be in 1..num_beams ({num_beams})")
    if max_new_tokens < 1 or not prompt:
        raise ValueError("beam search needs a non-empty prompt and max_new_tokens >= 1")
    if cache.max_batch < num_beams:
        raise ValueError(f"the cache has {cache.max_batch} rows, beam search needs num_beams={num_beams}")
    if cache.max_tokens < len(prompt) + max_new_tokens - 1:
        raise ValueError(f"the cache ({cache.max_tokens} tokens) cannot hold prompt + max_new_tokens")


def _prefill_every_beam(
    runner: ModelRunner, cache: KVCache, prompt: list[int], num_beams: int, device: torch.device
) -> torch.Tensor:
    """The prompt run once, its cache rows copied to every beam: the last position's logits, one row a beam."""
    cache.reset(1)
    tokens = torch.tensor([prompt], device=device)
    positions = torch.arange(len(prompt), device=device).unsqueeze(0)
    logits = runner.torch_forward(tokens, positions, cache)[:, -1]
    cache.reorder(torch.zeros(num_beams, dtype=torch.long, device=device))  # copy the prompt to every beam
    return logits.expand(num_beams, -1)


class _Beams:
    """The running and the finished beams of one search, as transformers keeps them (tensors [beams, …])."""

    def __init__(
        self,
        nb: int,
        max_new_tokens: int,
        eos_ids: set[int],
        length_penalty: float,
        early_stopping: bool | Literal["never"],
        device: torch.device,
    ) -> None:
        self.nb, self.keep_k, self.max_new = nb, max(2, 1 + len(eos_ids)) * nb, max_new_tokens
        self.length_penalty, self.early_stopping, self.device = length_penalty, early_stopping, device
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
        self.top_mask = torch.arange(self.keep_k, device=device) < nb  # only these may become finished beams
        self.running = torch.zeros(nb, max_new_tokens, dtype=torch.long, device=device)
        self.running_scores = torch.full((nb,), _NEG, device=device)
        self.running_scores[0] = 0.0  # all beams start equal: only beam 0 may expand at first
        self.finished = torch.zeros(nb, max_new_tokens, dtype=torch.long, device=device)
        self.finished_len = torch.zeros(nb, dtype=torch.long, device=device)
        self.finished_scores = torch.full((nb,), _NEG, device=device)
        self.is_finished = torch.zeros(nb, dtype=torch.bool, device=device)
        self.improvable = True

    def advance(self, step: int, logits: Tensor) -> Tensor | None:
        """Extend the beams by one token from their logits [beams, V]; the rows the cache must take next
        (row i becomes old row index[i]), or None when the search is over."""
        nb, keep_k = self.nb, self.keep_k
        vocab = logits.shape[-1]
        log_probs = F.log_softmax(logits.float(), dim=-1) + self.running_scores[:, None]
        topk_scores, topk_index = log_probs.view(-1).topk(keep_k)
        source_beam, token = topk_index // vocab, topk_index % vocab
        topk_seqs = self.running[source_beam]
        topk_seqs[:, step] = token
        hits = torch.isin(token, self.eos) | (step + 1 >= self.max_new)

        # The best num_beams continuations that did not finish keep running.
        running_candidates = topk_scores + hits.float() * _NEG
        chosen = running_candidates.topk(nb).indices
        self.running, self.running_scores = topk_seqs[chosen], running_candidates[chosen]
        # A masked (-inf) candidate, or one of a start-up beam (_NEG), never finishes: a grammar may leave
        # fewer continuations than the top K (with a free vocabulary there are always more).
        real = topk_scores > _NEG / 2
        self._merge_finished(step, topk_seqs, topk_scores, hits & self.top_mask & real)

        # Can a running beam still beat the worst finished one?
        generated = step + 1
        # "never" with a positive penalty: assume a running beam may still grow to the maximum length.
        never = self.early_stopping == "never" and self.length_penalty > 0.0
        best_running = self.running_scores[0] / ((self.max_new if never else generated) ** self.length_penalty)
        worst_finished = torch.where(self.is_finished, self.finished_scores.min(), _NEG)
        self.improvable = self.improvable and bool((best_running > worst_finished).any())
        all_done = self.early_stopping is True and bool(self.is_finished.all())
        if not self.improvable or all_done or bool(hits.all()) or generated == self.max_new:
            return None
        return source_beam[chosen]

    def _merge_finished(self, step: int, seqs: Tensor, topk_scores: Tensor, just_finished: Tensor) -> None:
        """The newly finished (top num_beams only) merged into the best num_beams finished so far."""
        scores = topk_scores / ((step + 1) ** self.length_penalty)
        if self.early_stopping is True and bool(self.is_finished.all()):
            scores = scores + _NEG
        if not self.improvable:
            scores = scores + _NEG
        scores = scores + (~just_finished).float() * _NEG
        merged = torch.cat((self.finished_scores, scores)).topk(self.nb).indices
        self.finished = torch.cat((self.finished, seqs))[merged]
        lengths = torch.full((self.keep_k,), step + 1, device=self.device)
        self.finished_len = torch.cat((self.finished_len, lengths))[merged]
        self.finished_scores = torch.cat((self.finished_scores, scores))[merged]
        self.is_finished = torch.cat((self.is_finished, just_finished))[merged]

    def best(self, n: int, eos_ids: set[int], max_new_tokens: int, only_finished: bool = False) -> list[Candidate]:
        out = []
        rows = list(range(n))
        if only_finished:  # a grammar may allow fewer sequences than asked: only those found are returned
            real = (self.is_finished & (self.finished_scores > _NEG / 2)).tolist()
            found = [i for i in range(self.nb) if real[i]]
            rows = found[:n] or [0]
        for i in rows:
            seq = self.finished[i, : int(self.finished_len[i])].tolist()
            # A finished beam ended with EOS or at the length limit: the rules every loop ends rows by.
            reason = (end_after_token(seq[-1], seq, eos_ids, None, max_new_tokens) if seq else None) or "length"
            out.append(Candidate(tokens=seq, score=float(self.finished_scores[i]), finish_reason=reason))
        return out
