"""Deterministic beam search, step for step the algorithm of transformers' `generate(num_beams=N,
do_sample=False)` (>= 4.50 vectorized rewrite), so tokens and `sequences_scores` match it.

Per step: take the top K = max(2, 1 + len(eos_ids)) * num_beams continuations over all beams by summed
log-probability. Those ending in EOS or reaching max_new_tokens are *finished*: only if among the top
num_beams, scored sum / generated_length ** length_penalty (EOS counted in the length), and kept if in the
best num_beams finished so far. The best num_beams unfinished continue. Search stops when no running beam
can beat the worst finished one (the `early_stopping` heuristics below), when all continuations finish, or
at max_new_tokens. The cache holds one row per beam; rows are reordered in place after each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .fused_decode import decode_step
from .generate import FinishReason
from .kv_cache import KVCache
from .model import Transformer

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
) -> list[Candidate]:
    """The best `num_return_sequences` finished beams, best first. The cache needs num_beams rows.

    early_stopping: True stops once num_beams beams are finished; False stops when the best running beam,
    at its current length, cannot beat the worst finished one; "never" assumes (for length_penalty > 0)
    the running beam could still grow to max_new_tokens, i.e. searches on longer.
    """
    if not 1 <= num_return_sequences <= num_beams:
        raise ValueError(f"num_return_sequences ({num_return_sequences}) must be in 1..num_beams ({num_beams})")
    if max_new_tokens < 1 or not prompt:
        raise ValueError("beam search needs a non-empty prompt and max_new_tokens >= 1")
    if cache.max_batch < num_beams:
        raise ValueError(f"the cache has {cache.max_batch} rows, beam search needs num_beams={num_beams}")
    if cache.max_tokens < len(prompt) + max_new_tokens - 1:
        raise ValueError(f"the cache ({cache.max_tokens} tokens) cannot hold prompt + max_new_tokens")
    device = model.device
    nb, keep_k = num_beams, max(2, 1 + len(eos_ids)) * num_beams
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    top_mask = torch.arange(keep_k, device=device) < nb  # only these may become finished beams

    running = torch.zeros(nb, max_new_tokens, dtype=torch.long, device=device)
    running_scores = torch.full((nb,), _NEG, device=device)
    running_scores[0] = 0.0  # all beams start equal: only beam 0 may expand at first
    finished = torch.zeros(nb, max_new_tokens, dtype=torch.long, device=device)
    finished_len = torch.zeros(nb, dtype=torch.long, device=device)
    finished_scores = torch.full((nb,), _NEG, device=device)
    is_finished = torch.zeros(nb, dtype=torch.bool, device=device)
    improvable = True

    with torch.inference_mode():
        cache.reset(1)
        tokens = torch.tensor([prompt], device=device)
        positions = torch.arange(len(prompt), device=device).unsqueeze(0)
        logits = model(tokens, positions, cache, last_only=True)[:, -1]
        cache.reorder(torch.zeros(nb, dtype=torch.long, device=device))  # copy the prompt to every beam
        logits = logits.expand(nb, -1)
        vocab = logits.shape[-1]
        for step in range(max_new_tokens):
            log_probs = F.log_softmax(logits.float(), dim=-1) + running_scores[:, None]
            topk_scores, topk_index = log_probs.view(-1).topk(keep_k)
            source_beam, token = topk_index // vocab, topk_index % vocab
            topk_seqs = running[source_beam]
            topk_seqs[:, step] = token
            hits = torch.isin(token, eos) | (step + 1 >= max_new_tokens)

            # The best num_beams continuations that did not finish keep running.
            running_candidates = topk_scores + hits.float() * _NEG
            chosen = running_candidates.topk(nb).indices
            running, running_scores = topk_seqs[chosen], running_candidates[chosen]
            beam_index = source_beam[chosen]

            # Merge the newly finished (top num_beams only) into the best num_beams finished so far.
            just_finished = hits & top_mask
            scores = topk_scores / ((step + 1) ** length_penalty)
            if early_stopping is True and bool(is_finished.all()):
                scores = scores + _NEG
            if not improvable:
                scores = scores + _NEG
            scores = scores + (~just_finished).float() * _NEG
            merged = torch.cat((finished_scores, scores)).topk(nb).indices
            finished = torch.cat((finished, topk_seqs))[merged]
            finished_len = torch.cat((finished_len, torch.full((keep_k,), step + 1, device=device)))[merged]
            finished_scores = torch.cat((finished_scores, scores))[merged]
            is_finished = torch.cat((is_finished, just_finished))[merged]

            # Can a running beam still beat the worst finished one?
            generated = step + 1
            # "never" with a positive penalty: assume a running beam may still grow to the maximum length.
            best_len = max_new_tokens if early_stopping == "never" and length_penalty > 0.0 else generated
            best_running = running_scores[0] / (best_len**length_penalty)
            worst_finished = torch.where(is_finished, finished_scores.min(), _NEG)
            improvable = improvable and bool((best_running > worst_finished).any())
            all_done = early_stopping is True and bool(is_finished.all())
            if not improvable or all_done or bool(hits.all()) or generated == max_new_tokens:
                break

            cache.reorder(beam_index)
            if not cache.make_room(1):
                break
            logits = decode_step(model, running[:, step : step + 1], cache.next_positions(), cache)[:, -1]

    out = []
    for i in range(num_return_sequences):
        length = int(finished_len[i])
        seq = finished[i, :length].tolist()
        reason: FinishReason = "eos" if seq and seq[-1] in eos_ids else "length"
        out.append(Candidate(tokens=seq, score=float(finished_scores[i]), finish_reason=reason))
    return out
