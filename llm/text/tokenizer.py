"""Text <-> token ids for an HF-format model dir: `tokenizer.json` + `tokenizer_config.json`.

Three pieces, each small:
  * `Tokenizer`: encode/decode through the `tokenizers` library, special-token ids, BOS policy;
  * `apply_chat_template`: the model's Jinja chat template, rendered in the sandbox of
    llm/text/chat_sandbox.py (no code, no files, bounded in time and size), since a template ships
    with downloaded weights; a refusal is one line naming tokenizer_config.json;
  * `StreamDecoder`: incremental detokenization that never emits half a character.

User text never becomes control tokens. `encode(text, special=False)` encodes `<|im_end|>` in
the text as the characters it is made of. `encode_chat` renders the messages as `UserText`
(llm/text/user_text.py), so the rendered prompt knows which characters came from a message, however
the template moved or rewrote them. Only special-token strings made entirely of the template's
own characters become control tokens; the prompt is split at those (exactly where the
`tokenizers` library splits at added tokens, so a normal chat gets the very ids of a plain
encode) and everything between is encoded without special-token parsing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import SecurityError

from ..trust.files import FileProblem, read_json_limited, read_text_limited
from .chat_sandbox import MAX_TEMPLATE_CHARACTERS, RENDER_SECONDS, ChatTemplate, RenderTimeout
from .user_text import as_user_message, as_user_text, spans_of

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


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
        try:  # bounded and regular files only: a FIFO, a device or a huge file is refused, never read
            text = read_text_limited(path)
        except FileProblem as bad:
            raise TokenizerError(str(bad)) from None
        try:
            backend = Backend.from_str(text)
        except Exception as bad:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"{path}: not a valid tokenizers file ({_one_line(bad)})") from None
        # Not optional: without it there is no chat template and no BOS/EOS, and a chat would be sent
        # as raw text with nothing to stop generation: answers that look fine and are not.
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        try:
            config = read_json_limited(config_path)
        except FileProblem as bad:
            raise TokenizerError(f"{bad} (the tokenizer needs it for its special tokens and chat template)") from None
        if not isinstance(config, dict):
            raise TokenizerError(f"{config_path}: expected a JSON object")
        tokenizer = cls(backend, config, source=str(model_dir))
        tokenizer.chat_template  # noqa: B018 - a malformed chat_template is refused when the files are read
        return tokenizer

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

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`. special=True (the `tokenizers` default, for text a plan author or the
        template wrote): "<|im_start|>" in the text maps to its id; special=False (for anything a user
        wrote): it is encoded as the characters it is made of, never as a control token."""
        # add_special_tokens=False: BOS is our decision, not tokenizer.json's post-processor's.
        if special:
            ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        else:
            with self._literal():
                ids = self._backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    @contextmanager
    def _literal(self) -> Iterator[None]:
        before = self._backend.encode_special_tokens
        self._backend.encode_special_tokens = True  # special-token strings are plain text
        try:
            yield
        finally:
            self._backend.encode_special_tokens = before

    @cached_property
    def _specials(self) -> dict[str, Any]:
        """Special added tokens by their text (the strings a template writes to make control tokens)."""
        return {tok.content: tok for tok in self._backend.get_added_tokens_decoder().values() if tok.special}

    @cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        texts = sorted(self._specials, key=len, reverse=True)  # longest first, as the library matches
        return re.compile("|".join(re.escape(t) for t in texts)) if texts else None

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_bos: bool | None = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """(the rendered prompt, its ids): control tokens only where the template wrote them (module doc).
        `tools`: the template's `tools` variable (OpenAI's function definitions), user text like the messages."""
        given = {"tools": as_user_text(tools)} if tools else {}
        rendered = self._render([as_user_message(m) for m in messages], add_generation_prompt, **given)
        text = str.__str__(rendered)
        ids: list[int] = []
        position = 0
        strip_start = False
        for start, end, special in self._template_specials(text, spans_of(rendered)):
            token = self._specials[special]
            # An added token's lstrip/rstrip eats the whitespace beside it, as the library does.
            body = text[position:start].lstrip() if strip_start else text[position:start]
            body = body.rstrip() if token.lstrip else body
            if body:
                ids += self.encode(body, add_bos=False, special=False)
            ids.append(int(self._backend.token_to_id(special)))
            position, strip_start = end, bool(token.rstrip)
        tail = text[position:].lstrip() if strip_start else text[position:]
        if tail:
            ids += self.encode(tail, add_bos=False, special=False)
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return text, ids

    def _template_specials(self, text: str, user: tuple[tuple[int, int], ...]) -> Iterator[tuple[int, int, str]]:
        """(start, end, text) of every special-token string made of the template's own characters only:
        one that touches a character from a message (even if the template moved or rewrote it) is text."""
        marks = self._special_pattern
        if marks is None:
            return
        own_start = 0
        for user_start, user_end in (*user, (len(text), len(text))):
            for found in marks.finditer(text, own_start, user_start):
                yield found.start(), found.end(), found.group()
            own_start = user_end

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (llguidance builds its own view of the vocabulary from it)."""
        return str(self._backend.to_str())

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
        if "chat_template" not in self._config or self._config["chat_template"] is None:
            return None
        template = self._config["chat_template"]
        if isinstance(template, list):  # HF's named-template form: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if template is None:
                raise TokenizerError(f"{self._template_file}: chat_template lists no template named 'default'")
        if not isinstance(template, str):
            # Never silently no template: the prompt would go to the model without its chat markup.
            raise TokenizerError(f"{self._template_file}: chat_template must be a string (a Jinja template)")
        if len(template) > MAX_TEMPLATE_CHARACTERS:
            raise TokenizerError(
                f"{self._template_file}: chat_template is {len(template)} characters; "
                f"the limit is {MAX_TEMPLATE_CHARACTERS} (a real one is a few thousand)"
            )
        return template

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def check_chat_template(self) -> None:
        """Compile the chat template now (load time), so a broken or hostile one is refused before any work."""
        if self.has_chat_template:
            self._compiled_template  # noqa: B018 - compiling is the check

    @cached_property
    def _compiled_template(self) -> ChatTemplate:
        template = self.chat_template
        if template is None:
            raise TokenizerError(f"{self._source}: the tokenizer has no chat_template")
        try:
            return ChatTemplate(template)
        except TemplateError as bad:
            raise TokenizerError(f"{self._template_file}: chat_template does not compile ({_one_line(bad)})") from None
        except RecursionError:
            raise TokenizerError(f"{self._template_file}: chat_template nests too deeply to compile") from None

    @property
    def _template_file(self) -> str:
        return f"{self._source}/{TOKENIZER_CONFIG_FILE}" if self._source != "<memory>" else "chat_template"

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` the way HF's apply_chat_template(tokenize=False) does."""
        return str.__str__(self._render(messages, add_generation_prompt))

    def _render(self, messages: list[Any], add_generation_prompt: bool, **variables: Any) -> str:
        """The rendered prompt, spans of the messages' text kept (llm/text/user_text.py); refusals name the file."""
        specials = {key: self._token_text(key) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
        where = self._template_file
        try:
            return self._compiled_template.render(messages, add_generation_prompt, **specials, **variables)
        except RenderTimeout:
            raise TokenizerError(
                f"{where}: the chat template ran longer than {RENDER_SECONDS:g} s (a runaway loop?); "
                "fix or remove its chat_template"
            ) from None
        except SecurityError as bad:
            raise TokenizerError(f"{where}: the chat template tried an unsafe operation: {_one_line(bad)}") from None
        except TokenizerError:
            raise
        except RecursionError:
            raise TokenizerError(f"{where}: the chat template nests too deeply") from None
        except MemoryError:
            raise TokenizerError(f"{where}: the chat template ran out of memory") from None
        except Exception as bad:  # TemplateError, raise_exception(), TypeError from bad data...
            raise TokenizerError(f"{where}: the chat template failed: {_one_line(bad)}") from None

    def _token_text(self, key: str) -> str | None:
        value = self._config.get(key)
        return value.get("content") if isinstance(value, dict) else value


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:500]


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
