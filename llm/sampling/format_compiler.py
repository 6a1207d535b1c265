"""A format compiled against one tokenizer: a checked llguidance matcher to copy for each row, and the checks
every compiled format passes before any request uses it.

    compiled = compile_format(fmt, tokenizer, eos_ids, vocab)  # per (tokenizer, format): cached
    matcher = compiled.matcher()    # a fresh llguidance matcher for one row (token_mask.py uses it)

`rehearse` runs once per compiled format: a format whose first mask is empty (a literal that
spells a control token, which llguidance lets through as text and its matcher then refuses; or one that spells
the end token, which would end the answer short of its shape) or whose matcher fails within its first steps (a
lexer or parser limit: `a{1000000}`, a rule that only recurses, 20,000 alternatives) is refused here, before a
request starts. `complete` replays an answer on a fresh matcher.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from .constrained_format import OutputFormat, UnsupportedFormat, explain

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from ..text.tokenizer import Tokenizer


# --- compiling against a tokenizer ------------------------------------------------------------------------


@dataclass(eq=False)  # compared and hashed by identity: one per (tokenizer, format), cached
class CompiledFormat:
    """A format compiled for one tokenizer: a checked matcher to copy for each row (a copy is cheap; a
    matcher built from the grammar text rebuilds its lexer)."""

    format: OutputFormat
    vocab: int  # the logits' width (the model's vocabulary, which may exceed the tokenizer's)
    eos_ids: frozenset[int]
    _template: LLMatcher
    # The tokenizer's control tokens other than EOS, ascending: llguidance's mask may allow one where a literal
    # spells its text (e.g. "<|user|>"), which its matcher then refuses; llm/sampling/token_mask.py checks these.
    control_ids: tuple[int, ...] = ()

    def matcher(self) -> LLMatcher:
        return self._template.deep_copy()


_compile_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
MAX_COMPILED = 128  # per tokenizer, least recently used dropped


def compile_format(fmt: OutputFormat, tokenizer: Tokenizer, eos_ids: frozenset[int], vocab: int) -> CompiledFormat:
    """The format compiled against this tokenizer (cached per tokenizer and format); UnsupportedFormat when
    llguidance refuses it, which `check` would have found already for all but tokenizer-dependent limits."""
    fmt.check()
    key = (fmt, frozenset(eos_ids), vocab)
    with _compile_lock:
        per = _tokenizers.setdefault(tokenizer, {"compiled": OrderedDict()})
        compiled: OrderedDict[Any, CompiledFormat] = per["compiled"]
        if key in compiled:
            compiled.move_to_end(key)
            return compiled[key]
    ll = _ll_tokenizer(tokenizer, eos_ids, vocab)
    from llguidance import LLMatcher

    template = LLMatcher(ll, fmt.grammar(), log_level=0)
    if template.is_error():
        raise explain(fmt, template.get_error())
    made = CompiledFormat(fmt, vocab, frozenset(eos_ids), template, _control_ids(tokenizer, ll, eos_ids, vocab))
    problem = rehearse(made)
    if problem is not None:
        refused, why = problem
        name = tokenizer.decode(refused[:1], skip_special_tokens=False) if refused else None
        raise UnsupportedFormat(fmt.kind, name or fmt.kind, detail=why or no_token_left(refused, name, made.eos_ids))
    with _compile_lock:
        compiled[key] = made
        while len(compiled) > MAX_COMPILED:
            compiled.popitem(last=False)
    return made


def _control_ids(tokenizer: Tokenizer, ll: LLTokenizer, eos_ids: frozenset[int], vocab: int) -> tuple[int, ...]:
    """The tokens llguidance treats as special (its view, not the tokenizer's `special` flags: Qwen's
    `<tool_call>` is one of them), EOS aside: once per llguidance tokenizer (0.01-0.06 s a vocabulary)."""
    key = ("control", frozenset(eos_ids), vocab)
    with _compile_lock:
        per = _tokenizers.setdefault(tokenizer, {"compiled": OrderedDict()})
        if key in per:
            return per[key]  # type: ignore[no-any-return]
    found = tuple(i for i in range(min(ll.vocab_size, vocab)) if i not in eos_ids and ll.is_special_token(i))
    with _compile_lock:
        per[key] = found
    return found


def _ll_tokenizer(tokenizer: Tokenizer, eos_ids: frozenset[int], vocab: int) -> LLTokenizer:
    """llguidance's view of the tokenizer (about a second to build: once per tokenizer, EOS set, width)."""
    from llguidance import LLTokenizer

    key = ("ll", frozenset(eos_ids), vocab)
    with _compile_lock:
        per = _tokenizers.setdefault(tokenizer, {"compiled": OrderedDict()})
        if key in per:
            return per[key]  # type: ignore[no-any-return]
    eos = sorted(eos_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    if not eos:
        raise UnsupportedFormat("format", "eos", detail="a constrained answer needs an end-of-sequence token")
    made = LLTokenizer(tokenizer.to_json(), n_vocab=max(vocab, tokenizer.vocab_size), eos_token=eos)
    with _compile_lock:
        per[key] = made
    return made


class ControlTokens:
    """The control tokens a mask must not allow unless the matcher takes them. llguidance's mask allows a
    control token wherever a literal spells its text ("<|user|>" in a grammar, a schema's `const`, a choice),
    and its matcher then refuses the token: picked, it would end the answer in an error. A grammar that names
    the token as one (`<|user|>` in Lark) is taken, so it stays allowed. The end token is allowed only where
    the answer may end (the matcher accepts): allowed elsewhere it is a literal spelling it ("<|im_end|>" in a
    regex), and picked it would end the row with an answer the format does not hold. Usually no control bit is
    set, and the check is one gather over the few control ids."""

    def __init__(self, ids: tuple[int, ...], eos_ids: frozenset[int] = frozenset()) -> None:
        self.ids = np.asarray(ids, dtype=np.int64)
        self._words, self._shifts = self.ids >> 5, (self.ids & 31).astype(np.uint32)
        self.eos = np.asarray(sorted(eos_ids), dtype=np.int64)

    @classmethod
    def of(cls, compiled: CompiledFormat) -> ControlTokens:
        return cls(compiled.control_ids, compiled.eos_ids)

    def clear_refused(self, matcher: LLMatcher, bits: Tensor) -> list[int]:
        """Clear the allowed control tokens the matcher refuses (EOS where it may not end); the ones cleared."""
        words = bits.numpy().view(np.uint32)
        refused: list[int] = []
        if self.ids.size:
            set_ = ((words[self._words] >> self._shifts) & 1).astype(bool)
            refused = [token for token in self.ids[set_].tolist() if matcher.validate_tokens([token]) == 0]
        if self.eos.size and not matcher.is_accepting():
            set_ = ((words[self.eos >> 5] >> (self.eos & 31).astype(np.uint32)) & 1).astype(bool)
            refused += self.eos[set_].tolist()
        for token in refused:
            words[token >> 5] &= ~np.uint32(1 << (token & 31))
        return refused


def no_token_left(refused: list[int], name: str | None = None, eos_ids: frozenset[int] = frozenset()) -> str:
    """Why a mask left nothing: usually a literal that spells a control token, which llguidance only lets
    the model write as that token (and then refuses), or one that spells the end token."""
    if not refused:
        return "the grammar allows no token"
    named = f"{refused[0]}{f' {name}' if name else ''}"
    if refused[0] in eos_ids:
        return f"it spells the end token {named}, which ends the answer and cannot be written as text"
    return (
        f"it spells the tokenizer's control token {named}, which an answer cannot write as text; a Lark "
        "grammar may name it as a token (<|name|>)"
    )


# What `rehearse` tries: the states a few tokens in, breadth first (up to BRANCH tokens of each, spread over
# its mask, and up to STATES masks in all), then a walk of up to DEPTH steps along the longest tokens (the ids
# BPE merged last), where a lexer's counted repetitions blow up.
REHEARSAL_BRANCH = 8
REHEARSAL_STATES = 96
REHEARSAL_DEPTH = 32


def _step(matcher: LLMatcher, bits: Tensor, controls: ControlTokens) -> tuple[np.ndarray, list[int], str]:
    """One mask: (the allowed ids, the control tokens cleared, llguidance's error's first line or "")."""
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
    if matcher.is_error():
        return np.zeros(0, dtype=np.int64), [], _first_line(matcher.get_error())
    refused = controls.clear_refused(matcher, bits)
    allowed = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little").nonzero()[0]
    return allowed, refused, ""


def rehearse(compiled: CompiledFormat) -> tuple[list[int], str] | None:
    """None when a fresh matcher keeps going over its first steps; else (the control tokens cleared, why it
    cannot go on). Checked once per compiled format: llguidance builds its lexer and parser states lazily, so a
    limit (lexer states, items in a row, a rule that only recurses) shows only once tokens are taken; met here,
    the format is refused before any request instead of failing one mid-answer. A path that ends with no token
    left (a literal spelling a control token or the end token mid-answer) is refused too: the model could take
    it. A heuristic bound in time (a few hundred masks at most), not a proof: the mask still clears such tokens."""
    controls = ControlTokens.of(compiled)
    bits = torch.zeros((compiled.vocab + 31) // 32, dtype=torch.int32)
    queue, masks, ends = deque([compiled.matcher()]), 0, np.asarray(sorted(compiled.eos_ids), dtype=np.int64)
    while queue and masks < REHEARSAL_STATES:
        matcher = queue.popleft()
        allowed, refused, error = _step(matcher, bits, controls)
        masks += 1
        if error or not allowed.size:
            return refused, _cannot_hold(error)
        going = allowed[~np.isin(allowed, ends)]  # numpy: a JSON string's mask allows most of the vocabulary
        for token in [*going[:: max(1, going.size // REHEARSAL_BRANCH)][:REHEARSAL_BRANCH], *going[-1:]]:
            child = matcher.deep_copy()
            if not child.consume_token(int(token)):
                return [], _cannot_hold(_first_line(child.get_error()))
            queue.append(child)
    return _walk(compiled.matcher(), bits, controls, compiled.eos_ids)


def _walk(
    matcher: LLMatcher, bits: Tensor, controls: ControlTokens, ends: frozenset[int]
) -> tuple[list[int], str] | None:
    """The longest-token walk of `rehearse` (from a fresh matcher, consumed in place)."""
    for _ in range(REHEARSAL_DEPTH):
        allowed, refused, error = _step(matcher, bits, controls)
        if error or not allowed.size:
            return refused, _cannot_hold(error)
        going = [int(t) for t in allowed[::-1][:64] if int(t) not in ends]
        if not going or matcher.is_stopped():
            return None
        if not matcher.consume_token(going[0]):
            return [], _cannot_hold(_first_line(matcher.get_error()))
    return None


def _cannot_hold(error: str) -> str:
    return f"the matcher cannot hold it: {error}" if error else ""


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def complete(compiled: CompiledFormat, tokens: list[int]) -> bool:
    """Whether these generated tokens (EOS included or not) make a whole answer of the format: a row cut by
    its length limit may stop mid-answer (its text may then not parse). Replayed on a fresh matcher."""
    matcher = compiled.matcher()
    for token in tokens:
        if matcher.is_stopped() or not matcher.consume_token(token):
            return bool(matcher.is_stopped()) and token in compiled.eos_ids
    return bool(matcher.is_accepting() or matcher.is_stopped())
