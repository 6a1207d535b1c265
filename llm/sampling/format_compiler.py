"""A format compiled against one tokenizer: a checked llguidance matcher to copy for each row, and the checks
every compiled format passes before any request uses it.

    compiled = compile_format(fmt, tokenizer, eos_ids, vocab)  # per (tokenizer, format): cached
    matcher = compiled.matcher()    # a fresh llguidance matcher for one row (token_mask.py uses it)

`first_refused` runs once per compiled format: a format whose first mask is empty (a literal that spells a
control token, which llguidance lets through as text and its matcher then refuses) is refused here, before
a request starts. `complete` replays an answer on a fresh matcher.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
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
    refused = first_refused(made)
    if refused is not None:
        name = tokenizer.decode(refused[:1], skip_special_tokens=False) if refused else None
        raise UnsupportedFormat(fmt.kind, name or fmt.kind, detail=no_token_left(refused, name))
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
    """The control tokens (other than EOS) a mask must not allow unless the matcher takes them. llguidance's
    mask allows a control token wherever a literal spells its text ("<|user|>" in a grammar, a schema's
    `const`, a choice), and its matcher then refuses the token: picked, it would end the answer in an error.
    A grammar that names the token as one (`<|user|>` in Lark) is taken, so it stays allowed. Usually no
    control bit is set, and the check is one gather over the few control ids."""

    def __init__(self, ids: tuple[int, ...]) -> None:
        self.ids = np.asarray(ids, dtype=np.int64)
        self._words, self._shifts = self.ids >> 5, (self.ids & 31).astype(np.uint32)

    def clear_refused(self, matcher: LLMatcher, bits: Tensor) -> list[int]:
        """Clear the allowed control tokens the matcher refuses; the ones cleared."""
        if not self.ids.size:
            return []
        words = bits.numpy().view(np.uint32)
        set_ = ((words[self._words] >> self._shifts) & 1).astype(bool)
        refused = [token for token in self.ids[set_].tolist() if matcher.validate_tokens([token]) == 0]
        for token in refused:
            words[token >> 5] &= ~np.uint32(1 << (token & 31))
        return refused


def no_token_left(refused: list[int], name: str | None = None) -> str:
    """Why a mask left nothing: usually a literal that spells a control token, which llguidance only lets
    the model write as that token (and then refuses)."""
    if not refused:
        return "the grammar allows no token"
    return (
        f"it spells the tokenizer's control token {refused[0]}{f' {name}' if name else ''}, which an answer "
        "cannot write as text; a Lark grammar may name it as a token (<|name|>)"
    )


def first_refused(compiled: CompiledFormat) -> list[int] | None:
    """None when a fresh matcher's first mask leaves a token; else the control tokens it had to clear
    (checked when a format is compiled, so a format that can never start is refused before any request)."""
    matcher = compiled.matcher()
    bits = torch.zeros((compiled.vocab + 31) // 32, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
    refused = ControlTokens(compiled.control_ids).clear_refused(matcher, bits)
    return None if matcher.is_error() or bits.any() else refused


def complete(compiled: CompiledFormat, tokens: list[int]) -> bool:
    """Whether these generated tokens (EOS included or not) make a whole answer of the format: a row cut by
    its length limit may stop mid-answer (its text may then not parse). Replayed on a fresh matcher."""
    matcher = compiled.matcher()
    for token in tokens:
        if matcher.is_stopped() or not matcher.consume_token(token):
            return bool(matcher.is_stopped()) and token in compiled.eos_ids
    return bool(matcher.is_accepting() or matcher.is_stopped())
