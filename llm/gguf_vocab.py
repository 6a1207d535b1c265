"""A GGUF's tokenizer.ggml.* metadata -> a `tokenizers` tokenizer.json and tokenizer_config.json."""

from __future__ import annotations

from typing import Any

from .config import MAX_POSITIONS
from .gguf_metadata import GGUFMetadata, fail, shown

# llama.cpp's token types (llama_token_type / gguf TokenType)
CONTROL, USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> how text is split before byte-level BPE. These mirror llama.cpp's
# llama-vocab.cpp regexes for the same names (and each model's original tokenizer.json).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: llama3's, but every digit its own pre-token
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
PRE_TOKENIZERS: dict[str, str] = {
    # "\p{N}" first, then the GPT-2 regex: every digit is its own pre-token
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "codeshell": "digits+gpt2",
    # the GPT-2 regex alone
    "gpt2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    # llama3's regex (digits in runs of up to three)
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    # Qwen2's (Qwen2, 2.5 and 3; DeepSeek-R1's Qwen distills)
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
}
# llama.cpp sets ignore_merges for llama3-style vocabularies: a word found whole in the vocab
# is one token even when the merges would not build it.
_IGNORE_MERGES = {"llama3"}


def hf_tokenizer(meta: GGUFMetadata) -> tuple[str, dict[str, Any]]:
    """tokenizer.json (as text) and tokenizer_config.json for the file's vocabulary."""
    kind = meta.text("tokenizer.ggml.model")
    if kind != "gpt2":
        raise fail(meta.path, f"tokenizer.ggml.model {shown(kind)} is not supported (only byte-level BPE 'gpt2')")
    tok, tokens = _byte_level_bpe(meta)
    return tok.to_str(pretty=False), _tokenizer_config(meta, tokens, add_bos_default=False)


def _byte_level_bpe(meta: GGUFMetadata) -> tuple[Any, list[str]]:
    """A byte-level BPE from tokenizer.ggml.tokens / merges, split as tokenizer.ggml.pre says."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    path = meta.path
    pre = meta.text("tokenizer.ggml.pre", "gpt2")  # files older than the key were GPT-2 style
    style = PRE_TOKENIZERS.get(pre)
    if style is None:
        supported = ", ".join(PRE_TOKENIZERS)
        raise fail(path, f"tokenizer.ggml.pre {shown(pre)} is unsupported (supported: {supported})")
    tokens, types = _tokens_and_types(meta)
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise fail(path, "tokenizer.ggml.tokens has duplicate entries")
    merges: list[tuple[str, str]] = []
    for merge in meta.strings("tokenizer.ggml.merges"):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise fail(path, f"tokenizer.ggml.merges: malformed merge {shown(merge)}")
        merges.append((left, right))

    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=style in _IGNORE_MERGES)
    except Exception as bad:  # tokenizers raises a bare Exception (a merge of tokens not in the vocabulary)
        raise fail(path, f"tokenizer.ggml.merges: {bad}") from None
    tok = Tokenizer(bpe)
    if style == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[style]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    _add_typed_tokens(tok, tokens, types)
    bos = _token(meta, tokens, "bos_token_id")
    if meta.boolean("tokenizer.ggml.add_bos_token", False) and bos is not None:
        _prepend_bos(tok, bos, vocab[bos])
    else:
        from tokenizers import processors

        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, tokens


def _tokens_and_types(meta: GGUFMetadata) -> tuple[list[str], list[int]]:
    tokens = meta.strings("tokenizer.ggml.tokens")
    types = meta.integers("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise fail(meta.path, f"token_type has {len(types)} entries for {len(tokens)} tokens")
    return tokens, types


def _add_typed_tokens(tok: Any, tokens: list[str], types: list[int]) -> None:
    """Control tokens are matched whole and are special (skippable on decode); user-defined ones are matched
    whole but are ordinary text."""
    from tokenizers import AddedToken

    typed = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == USER_DEFINED])


def _prepend_bos(tok: Any, bos: str, bos_id: int) -> None:
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )


def _token(meta: GGUFMetadata, tokens: list[str], key: str) -> str | None:
    index = meta.integer(f"tokenizer.ggml.{key}", None)
    if index is None:
        return None
    if not 0 <= index < len(tokens):
        raise fail(meta.path, f"tokenizer.ggml.{key} {index} is outside the vocabulary")
    return tokens[index]


def _tokenizer_config(meta: GGUFMetadata, tokens: list[str], add_bos_default: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(meta, tokens, "bos_token_id"),
        "eos_token": _token(meta, tokens, "eos_token_id"),
        "unk_token": _token(meta, tokens, "unknown_token_id"),
        "pad_token": _token(meta, tokens, "padding_token_id"),
        "add_bos_token": meta.boolean("tokenizer.ggml.add_bos_token", add_bos_default),
        "add_eos_token": meta.boolean("tokenizer.ggml.add_eos_token", False),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.integer(
            f"{meta.get('general.architecture')}.context_length", 2048, low=1, high=MAX_POSITIONS
        ),
    }
    template = meta.text("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config
