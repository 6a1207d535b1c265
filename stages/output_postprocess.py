"""`output.postprocess`: generated ids → the answer's ids (special, template and invalid ids removed).

Cleaning works on ids, not text, so that no string-level rule can mangle what the model wrote:
  * everything from the first EOS on is dropped (the EOS itself ends the answer);
  * BOS, PAD and every other special id (`tokenizer.special_ids`, which holds the chat-template
    markers such as `<|im_start|>`) are dropped wherever they appear;
  * ids outside [0, vocab_size) are dropped, listed in `Result.dropped_invalid`, and logged as a
    warning — a corrupted id must never crash the output phase;
  * a sequence cut by a length limit in the middle of a multi-byte character (an emoji spans up to
    four byte tokens) loses those last ≤3 tokens, so no U+FFFD ends the text.

`trim_to_sentence` (only for finish_reason "length", the case where a limit cut a sentence): the
ids are cut after the last complete sentence. It is done here, on ids, by decoding prefixes, so
that Result.ids and the text always agree. A sentence ends at `.`, `!` or `?` followed by
whitespace or the end of the text, or at `。`, `！`, `？` (CJK text has no space after them).
A text with no sentence end is left whole rather than emptied.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from pydantic import Field

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import Params, Phase, Stage
from llmplan.llm.text import Tokenizer

from .slots import InferenceContext
from .types import Result

_REPLACEMENT = "\ufffd"
# ASCII ends need following whitespace/end ("3.14", "e.g.x" are not ends); CJK ends do not.
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|[。！？]")


class PostprocessParams(Params):
    trim_to_sentence: bool = Field(
        False, description="when a sequence hit the length limit, cut it after its last complete sentence"
    )


class OutputPostprocess(Stage):
    """Remove special, chat-template and invalid ids from each generation (and each beam)."""

    name = "output.postprocess"
    phase = Phase.OUTPUT
    Params = PostprocessParams
    reads = ("generations", "tokenizer")
    writes = ("answers",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.generations is not None and ctx.tokenizer is not None
        tokenizer = ctx.tokenizer
        answers: list[Result] = []
        invalid_total = trimmed = 0
        for gen in ctx.generations:
            trim = params.trim_to_sentence and gen.finish_reason == "length"
            ids, dropped = clean_ids(gen.tokens, tokenizer)
            if trim:
                before = len(ids)
                ids = trim_to_sentence(ids, tokenizer)
                trimmed += before != len(ids)
            candidates = []
            for cand in gen.candidates:
                cand_ids, cand_dropped = clean_ids(cand.tokens, tokenizer)
                if params.trim_to_sentence and cand.finish_reason == "length":
                    cand_ids = trim_to_sentence(cand_ids, tokenizer)
                candidates.append(cand_ids)
                dropped += [i for i in cand_dropped if i not in dropped]
            if dropped:
                ctx.log.warning("invalid_token_ids", request=gen.request_id, ids=dropped[:20], count=len(dropped))
                invalid_total += len(dropped)
            answers.append(replace(gen, ids=ids, dropped_invalid=dropped, candidate_ids=candidates))
        ctx.answers = answers
        ctx.metrics.set("answers", len(answers))
        ctx.metrics.set("invalid_ids", invalid_total)
        ctx.metrics.set("trimmed", trimmed)


def clean_ids(tokens: list[int], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """(answer ids, dropped invalid ids): cut at EOS, drop special and out-of-range ids."""
    vocab = tokenizer.vocab_size
    special = set(tokenizer.special_ids)
    for named in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id):
        if named is not None:
            special.add(named)
    kept: list[int] = []
    dropped: list[int] = []
    for raw in tokens:
        token = int(raw)
        if not 0 <= token < vocab:
            dropped.append(token)
            continue
        if token == tokenizer.eos_id:
            break
        if token not in special:
            kept.append(token)
    return _drop_incomplete_tail(kept, tokenizer), dropped


def _drop_incomplete_tail(ids: list[int], tokenizer: Tokenizer) -> list[int]:
    """Remove up to 3 trailing tokens that are the start of an unfinished UTF-8 character."""
    if not ids or not _decode(tokenizer, ids).endswith(_REPLACEMENT):
        return ids
    for cut in range(1, min(3, len(ids) - 1) + 1):
        if not _decode(tokenizer, ids[:-cut]).endswith(_REPLACEMENT):
            return ids[:-cut]
    return ids  # a genuine U+FFFD (or garbage) the model wrote: keep it


def trim_to_sentence(ids: list[int], tokenizer: Tokenizer) -> list[int]:
    """The shortest prefix of `ids` whose text covers the last sentence end (see the module doc)."""
    if not ids:
        return ids
    text = _decode(tokenizer, ids)
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    for end in reversed(ends):
        if end >= len(text.rstrip()):
            return ids  # already ends on a sentence end
        target = text[:end]
        # Decoded prefix lengths only grow with k, so a binary search finds the first covering prefix.
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(_decode(tokenizer, ids[:mid])) >= end:
                hi = mid
            else:
                lo = mid + 1
        prefix = _decode(tokenizer, ids[:lo])
        # The covering token may carry whitespace past the end (". " or ".\n"), not more words.
        if prefix.startswith(target) and not prefix[end:].strip():
            return ids[:lo]
    return ids


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except ValueError as bad:  # TokenizerError; ids were range-checked, so this is a broken tokenizer
        raise StageFailure(f"tokenizer: cannot decode generated ids ({bad})") from None
