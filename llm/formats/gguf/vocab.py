"""A GGUF's tokenizer.ggml.* metadata -> a `tokenizers` tokenizer.json and tokenizer_config.json."""

from __future__ import annotations

from typing import Any

from ...model.config import MAX_POSITIONS
from .metadata import GGUFMetadata, fail, shown

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
    if kind == "gpt2":
        tok, tokens = _byte_level_bpe(meta)
        return tok.to_str(pretty=False), _tokenizer_config(meta, tokens, add_bos_default=False)
    if kind == "llama":
        tok, tokens = _sentencepiece_bpe(meta)
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        return tok.to_str(pretty=False), _tokenizer_config(meta, tokens, add_bos_default=True)
    raise fail(
        meta.path,
        f"tokenizer.ggml.model {shown(kind)} is not supported (supported: 'gpt2' byte-level BPE, "
        "'llama' SentencePiece)",
    )


_GEMMA = ("gemma", "gemma2", "gemma3")
SPACE = "\u2581"  # SentencePiece's visible space


def _sentencepiece_bpe(meta: GGUFMetadata) -> tuple[Any, list[str]]:
    """A SentencePiece-style BPE with byte fallback (`<0xNN>` tokens), built as transformers' GGUF converter
    builds it (its loader is this import's oracle):

    * merges come from the file or, where it has none (the usual case), are recovered from the vocabulary:
      every split of a token into two tokens is a merge, ranked by the token's score (Gemma: by its
      position in the file, which is its merge order; its scores are not);
    * Gemma files spell a token of spaces with real spaces; it is respelled with `▁` as its text is;
    * the space handling per family: Gemma turns spaces into `▁` and adds none in front; Phi-3 adds one
      in front of every piece of text; the others (Llama, Mistral) one in front of the text, as
      `tokenizer.ggml.add_space_prefix` says (default true).
    """
    from tokenizers import Tokenizer, decoders, models

    path = meta.path
    arch = meta.get("general.architecture")
    tokens, types = _tokens_and_types(meta)
    tokens, ranks = _respelled_and_ranked(meta, arch, tokens)
    # A respelled or repeated token keeps its last id, as transformers' vocabulary does.
    vocab = {token: i for i, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [_split_merge(meta, m) for m in meta.strings("tokenizer.ggml.merges")]
    else:
        merges = merges_from_ranks(vocab, ranks)
    unk = _token(meta, tokens, "unknown_token_id")
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, unk_token=unk)
    except Exception as bad:  # tokenizers raises a bare Exception (a merge of tokens not in the vocabulary)
        raise fail(path, f"tokenizer.ggml.merges: {bad}") from None
    tok = Tokenizer(bpe)
    pieces = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    _handle_spaces(tok, meta, arch, pieces)
    tok.decoder = decoders.Sequence(pieces)
    # user-defined tokens are matched whole only where their own spelling is a token (not a respelled one)
    _add_typed_tokens(
        tok,
        tokens,
        [
            k if k != USER_DEFINED or t in vocab else 1
            for t, k in zip(meta.strings("tokenizer.ggml.tokens"), types, strict=True)
        ],
    )
    bos = _token(meta, tokens, "bos_token_id")
    if meta.boolean("tokenizer.ggml.add_bos_token", True) and bos is not None:
        _prepend_bos(tok, bos, vocab[bos])
    return tok, tokens


def _respelled_and_ranked(meta: GGUFMetadata, arch: Any, tokens: list[str]) -> tuple[list[str], dict[str, float]]:
    """The tokens (Gemma's tokens of spaces respelled with `▁`) and each token's merge rank: its score, or
    for Gemma its position in the file (its merge order; its scores are not)."""
    if arch in _GEMMA:
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks: dict[str, float] = dict(zip(tokens, (-float(i) for i in range(len(tokens))), strict=True))
    else:
        scores = meta.numbers("tokenizer.ggml.scores")
        if scores is None:
            raise fail(meta.path, "metadata tokenizer.ggml.scores is missing (a SentencePiece vocabulary needs them)")
        if len(scores) != len(tokens):
            raise fail(meta.path, f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
        ranks = dict(zip(tokens, scores, strict=True))
    return tokens, ranks


def _handle_spaces(tok: Any, meta: GGUFMetadata, arch: Any, pieces: list[Any]) -> None:
    """The family's space handling on `tok`, and the decoder `pieces` that undo it: Gemma turns spaces into `▁`
    and adds none in front; Phi-3 adds one in front of every piece of text; the others one in front of the
    text, as `tokenizer.ggml.add_space_prefix` says (default true)."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    if arch in _GEMMA:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        pieces.append(decoders.Strip(content=" ", left=1))
    else:
        prefix = meta.boolean("tokenizer.ggml.add_space_prefix", True)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            pieces.append(decoders.Strip(content=" ", left=1))


def merges_from_ranks(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a BPE over `vocab` needs to build each token: every way to cut a token into two tokens,
    best-ranked token first; among one token's cuts the lower ids first, among equal ranks the longer
    left part, then the longer right part (transformers' `generate_merges` order, so the two agree)."""
    found: list[tuple[str, str, float]] = []
    for token, rank in ranks.items():
        cuts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        cuts.sort(key=lambda cut: (vocab[cut[0]], vocab[cut[1]]))
        found += [(left, right, rank) for left, right in cuts]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _split_merge(meta: GGUFMetadata, merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise fail(meta.path, f"tokenizer.ggml.merges: malformed merge {shown(merge)}")
    return left, right


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
    merges = [_split_merge(meta, m) for m in meta.strings("tokenizer.ggml.merges")]

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
