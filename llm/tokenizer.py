"""Text <-> token ids for an HF-format model dir: `tokenizer.json` + `tokenizer_config.json`.

Three pieces, each small:
  * `Tokenizer`: encode/decode through the `tokenizers` library, special-token ids, BOS policy;
  * `apply_chat_template`: the model's Jinja chat template, rendered in a sandbox, since a
    template ships with downloaded weights and must not be able to run code or read files;
  * `StreamDecoder`: incremental detokenization that never emits half a character.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence
_MAX_REPEAT = 1 << 20  # longest string/list a template may build with `*` (guards memory)


class TokenizerError(ValueError):
    """Unreadable tokenizer files, out-of-range ids, or a chat template that fails or misbehaves."""


class Tokenizer:
    def __init__(self, backend: Any, config: dict[str, Any] | None = None, source: str = "<memory>") -> None:
        self._backend = backend  # a tokenizers.Tokenizer
        self._config = config or {}
        self._source = source
        self._vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._special_id("bos_token")
        self.eos_id = self._special_id("eos_token")
        self.pad_id = self._special_id("pad_token")
        self.unk_id = self._special_id("unk_token")
        self.add_bos_token = bool(self._config.get("add_bos_token", False))
        added = backend.get_added_tokens_decoder()
        named = {self.bos_id, self.eos_id, self.pad_id, self.unk_id} - {None}
        self.special_ids: set[int] = {i for i, tok in added.items() if tok.special} | named

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"{path}: file not found")
        try:
            backend = Backend.from_file(str(path))
        except Exception as bad:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"{path}: not a valid tokenizers file ({_one_line(bad)})") from None
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as bad:
                raise TokenizerError(f"{config_path}: not valid JSON ({_one_line(bad)})") from None
            if not isinstance(config, dict):
                raise TokenizerError(f"{config_path}: expected a JSON object")
        return cls(backend, config, source=str(model_dir))

    def _special_id(self, key: str) -> int | None:
        value = self._config.get(key)
        if isinstance(value, dict):  # HF also writes {"content": "<s>", "lstrip": false, ...}
            value = value.get("content")
        if not value:
            return None
        index = self._backend.token_to_id(value)
        if index is None:
            raise TokenizerError(f"{self._source}: {key} {value!r} is not in the vocabulary")
        return int(index)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. "<|im_start|>") map to their ids."""
        # add_special_tokens=False: BOS is our decision, not tokenizer.json's post-processor's.
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        bad = next((i for i in ids if not 0 <= i < self._vocab_size), None)
        if bad is not None:  # tokenizers would silently drop it
            raise TokenizerError(f"token id {bad} is outside the vocabulary (size {self._vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, index: int) -> str:
        token = self._backend.id_to_token(index) if 0 <= index < self._vocab_size else None
        if token is None:
            raise TokenizerError(f"token id {index} is outside the vocabulary (size {self._vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        index = self._backend.token_to_id(token)
        return None if index is None else int(index)

    # --- chat template ---

    @property
    def chat_template(self) -> str | None:
        template = self._config.get("chat_template")
        if isinstance(template, list):  # HF's named-template form: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @cached_property
    def _compiled_template(self) -> Any:
        template = self.chat_template
        if template is None:
            raise TokenizerError(f"{self._source}: the tokenizer has no chat_template")
        try:
            return _chat_environment().from_string(template)
        except TemplateError as bad:
            raise TokenizerError(f"{self._source}: chat_template does not compile ({_one_line(bad)})") from None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` the way HF's apply_chat_template(tokenize=False) does."""
        specials = {key: self._token_text(key) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **specials
            )
        except SecurityError as bad:
            raise TokenizerError(f"chat template tried an unsafe operation: {_one_line(bad)}") from None
        except TokenizerError:
            raise
        except Exception as bad:  # TemplateError, raise_exception(), TypeError from bad data...
            raise TokenizerError(f"chat template failed: {type(bad).__name__}: {_one_line(bad)}") from None

    def _token_text(self, key: str) -> str | None:
        value = self._config.get(key)
        return value.get("content") if isinstance(value, dict) else value


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, plus a cap on `*`/`**` so a template cannot allocate gigabytes in one expression."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise SecurityError(f"exponent {right} is too large")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                sized = isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                if sized and len(seq) * count > _MAX_REPEAT:
                    raise SecurityError(f"repetition to {len(seq) * count} items is too large")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    # HF templates call this to reject e.g. a conversation that does not alternate roles.
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
    # HF's override: Jinja's own tojson escapes HTML characters, which templates do not want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _chat_environment() -> _ChatEnvironment:
    # trim_blocks/lstrip_blocks: the settings HF renders with, so whitespace matches theirs.
    env = _ChatEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


class StreamDecoder:
    """Token ids in, complete text out: decodes a sliding window and holds back a trailing U+FFFD.

    Byte-level tokens can end in the middle of a UTF-8 character (an emoji spans up to four byte
    tokens). Decoding the window [prefix, end) and comparing it with [prefix, read) yields the new
    text; while it ends in U+FFFD the character is incomplete, so nothing is emitted yet. The prefix
    gives the decoder context (e.g. leading-space rules) so the delta is the same as in a full decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # everything before this has been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        delta = self._delta()
        if not delta or delta.endswith(_REPLACEMENT):
            return ""
        # Slide the window: the tokens just emitted become the next push's context; older ones go.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return delta

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """Emit whatever is held back (at end of generation), even an incomplete character."""
        delta = self._delta()
        self._ids, self._prefix, self._read = [], 0, 0
        return delta

    def _delta(self) -> str:
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        after = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        return after[len(before) :] if len(after) > len(before) else ""
