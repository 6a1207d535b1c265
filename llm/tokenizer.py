"""Text <-> token ids for an HF-format model dir: `tokenizer.json` + `tokenizer_config.json`.

Three pieces, each small:
  * `Tokenizer`: encode/decode through the `tokenizers` library, special-token ids, BOS policy;
  * `apply_chat_template`: the model's Jinja chat template, rendered in a sandbox, since a
    template ships with downloaded weights and must not be able to run code or read files —
    nor hang or eat memory: a time budget (checked on every line the compiled template runs),
    a cap on the size of what it builds (`*`, `+`, `%`, `~`, filters, string methods, integers)
    and on the rendered output;
  * `StreamDecoder`: incremental detokenization that never emits half a character.

User text never becomes control tokens. `encode(text, special=False)` encodes `<|im_end|>` in
the text as the characters it is made of. `encode_chat` gets the template's special tokens
from the template alone: every special-token string (and the marker characters themselves)
inside the messages is replaced by a private-use marker character before rendering, so after
rendering the only special-token strings in the output are the ones the template wrote. The
output is split at those (exactly where the `tokenizers` library splits at added tokens, so a
normal chat gets the very ids of a plain encode), the markers between them are turned back into
the user's text, and that text is encoded without special-token parsing.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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
_MAX_BUILT = 16 << 20  # longest string/list any other template operation may build, and the output
_MAX_INT_BITS = 1 << 14  # largest integer (in bits) template arithmetic may produce
_RENDER_SECONDS = 2.0  # a chat template renders in milliseconds; this much means a loop bomb
_MARK_BASE = 0x10F000  # private-use plane 16: markers for special-token strings inside messages
_MARK_LIMIT = 0xFFE


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
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, add_bos: bool | None = False
    ) -> tuple[str, list[int]]:
        """(the rendered prompt, its ids): control tokens only where the template wrote them (module doc)."""
        marks = self._special_pattern
        escaper = re.compile((f"{marks.pattern}|" if marks is not None else "") + _MARK_CLASS)
        table: dict[str, str] = {}

        def escape(value: Any) -> Any:
            if isinstance(value, str):
                return escaper.sub(lambda m: _mark(table, m.group()), value)
            if isinstance(value, dict):
                return {k: escape(v) for k, v in value.items()}
            if isinstance(value, list):
                return [escape(v) for v in value]
            return value

        rendered = self.apply_chat_template([escape(m) for m in messages], add_generation_prompt)
        back = {mark: text for text, mark in table.items()}
        pieces = marks.split(rendered) if marks is not None else [rendered]
        found = marks.findall(rendered) if marks is not None else []
        ids: list[int] = []
        shown: list[str] = []
        strip_start = False
        for index, piece in enumerate(pieces):
            text = _MARK_RE.sub(lambda m: back.get(m.group(), m.group()), piece)
            shown.append(text)
            special = found[index] if index < len(found) else None
            token = self._specials[special] if special is not None else None
            # An added token's lstrip/rstrip eats the whitespace beside it, as the library does.
            body = text.lstrip() if strip_start else text
            body = body.rstrip() if token is not None and token.lstrip else body
            if body:
                ids += self.encode(body, add_bos=False, special=False)
            if special is not None:
                ids.append(int(self._backend.token_to_id(special)))
                shown.append(special)
                strip_start = bool(token.rstrip)
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return "".join(shown), ids

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
            compiled = _chat_environment().from_string(template)
        except TemplateError as bad:
            raise TokenizerError(f"{self._source}: chat_template does not compile ({_one_line(bad)})") from None
        # `a ~ b` compiles to a call of the module's str_join/markup_join: give it the size check.
        namespace = compiled.root_render_func.__globals__
        for name in ("str_join", "markup_join"):
            if name in namespace:
                namespace[name] = _checked(namespace[name])
        return compiled

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` the way HF's apply_chat_template(tokenize=False) does."""
        specials = {key: self._token_text(key) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
        try:
            compiled = self._compiled_template
            with _time_budget(_RENDER_SECONDS):
                chunks = compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, **specials)
                out: list[str] = []
                size = 0
                for chunk in chunks:
                    size += len(chunk)
                    if size > _MAX_BUILT:
                        raise SecurityError(f"the rendered prompt is over {_MAX_BUILT} characters")
                    out.append(chunk)
            return "".join(out)
        except _OverBudget:
            raise TokenizerError(f"chat template ran longer than {_RENDER_SECONDS:g} s (a runaway loop?)") from None
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
    """The sandbox, plus caps on what one operation may build: `*`, `**`, `+`, `%` on strings, lists
    and integers are checked before they run (they could allocate gigabytes in one step, where the
    time budget cannot interrupt), calls and filters after, and string methods whose integer
    argument is a size (`center`, `ljust`, `zfill`…) before."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise SecurityError(f"exponent {right} is too large")
        if operator == "**" and _is_int(left) and _is_int(right) and left.bit_length() * abs(right) > _MAX_INT_BITS:
            raise SecurityError("the power is too large a number")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                sized = isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                if sized and len(seq) * count > _MAX_REPEAT:
                    raise SecurityError(f"repetition to {len(seq) * count} items is too large")
            if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                raise SecurityError("the product is too large a number")
        if operator == "%" and isinstance(left, str):
            values = right if isinstance(right, tuple) else (right,)
            widths = sum(int(w) for w in _PERCENT_WIDTH.findall(left))
            if len(left) + widths + sum(len(v) for v in values if isinstance(v, str)) > _MAX_BUILT:
                raise SecurityError("string formatting would build too large a string")
        sequences = isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple))
        if operator == "+" and sequences and len(left) + len(right) > _MAX_BUILT:
            raise SecurityError(f"concatenation to {len(left) + len(right)} items is too large")
        return _bounded(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(__obj, "__self__", None).__class__ is str:
            sizes = [a for a in (*args, *kwargs.values()) if _is_int(a)]
            if any(abs(a) > _MAX_BUILT for a in sizes):
                raise SecurityError(f"str.{getattr(__obj, '__name__', '?')}: a size over {_MAX_BUILT}")
            if getattr(__obj, "__name__", "") == "replace" and len(args) >= 2:
                _check_replace(__obj.__self__, args[0], args[1])
        return _bounded(super().call(__context, __obj, *args, **kwargs))


_PERCENT_WIDTH = re.compile(r"%[-+ #0]*(\d+)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounded(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > _MAX_BUILT:
        raise SecurityError(f"a value of {len(value)} items is too large")
    if _is_int(value) and value.bit_length() > _MAX_INT_BITS:
        raise SecurityError("a number is too large")
    return value


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        count = text.count(old) if old else len(text) + 1
        if len(text) + count * (len(new) - len(old)) > _MAX_BUILT:
            raise SecurityError("replace would build too large a string")


def _checked(function: Any) -> Any:
    """A filter (or join helper) whose result is size-checked; `replace` is also checked before."""

    @functools.wraps(function)  # keeps jinja's pass_context/pass_eval_context markers
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        plain = [a for a in args if not hasattr(a, "environment") and not hasattr(a, "autoescape")]
        if getattr(function, "__name__", "") == "do_replace" and len(plain) >= 3:
            _check_replace(str(plain[0]), plain[1], plain[2])
        if any(_is_int(a) and abs(a) > _MAX_BUILT for a in (*plain[1:], *kwargs.values())):
            raise SecurityError(f"filter {getattr(function, '__name__', '?')}: a size over {_MAX_BUILT}")
        return _bounded(function(*args, **kwargs))

    return wrapper


class _OverBudget(Exception):
    pass


@contextmanager
def _time_budget(seconds: float) -> Iterator[None]:
    """Trace the compiled template's frames (file "<template>") and stop them past `seconds`.

    A line event fires on every loop iteration, so even an empty nested loop is interrupted; other
    frames are not traced (the global trace function returns None for them).
    """
    deadline = time.perf_counter() + seconds

    def local(frame: Any, event: str, arg: Any) -> Any:
        if time.perf_counter() > deadline:
            raise _OverBudget
        return local

    def global_trace(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(global_trace)
    try:
        yield
    finally:
        sys.settrace(previous)


_MARK_CLASS = f"[{chr(_MARK_BASE)}-{chr(_MARK_BASE + _MARK_LIMIT)}]"
_MARK_RE = re.compile(_MARK_CLASS)


def _mark(table: dict[str, str], text: str) -> str:
    """The marker character standing for `text` (a special-token string or a marker the user typed)."""
    if text not in table:
        if len(table) > _MARK_LIMIT:
            raise TokenizerError("too many distinct special-token strings in the messages")
        table[text] = chr(_MARK_BASE + len(table))
    return table[text]


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
    for name, function in list(env.filters.items()):
        env.filters[name] = _checked(function)
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
