"""Text in and out: the tokenizer, the sandboxed chat template, user text, stop strings, blocklist matching.

The names below are its public surface: code outside llm/ imports them from here. Each is imported
from its module on first use (llmplan/lazy_exports.py), so importing the package costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmplan.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .confusables import ConfusablesMissing
    from .text_match import UNBOUNDED, Entry, Matcher, StreamGuard, literal_entry, normalize, regex_entry
    from .tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer, TokenizerError

EXPORTS = {  # name -> the module that defines it
    "ConfusablesMissing": "confusables",
    "Entry": "text_match",
    "Matcher": "text_match",
    "StreamGuard": "text_match",
    "TOKENIZER_CONFIG_FILE": "tokenizer",
    "TOKENIZER_FILE": "tokenizer",
    "Tokenizer": "tokenizer",
    "TokenizerError": "tokenizer",
    "UNBOUNDED": "text_match",
    "literal_entry": "text_match",
    "normalize": "text_match",
    "regex_entry": "text_match",
}
__all__ = [
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "UNBOUNDED",
    "ConfusablesMissing",
    "Entry",
    "Matcher",
    "StreamGuard",
    "Tokenizer",
    "TokenizerError",
    "literal_entry",
    "normalize",
    "regex_entry",
]
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
