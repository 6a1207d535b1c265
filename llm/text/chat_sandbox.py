"""The sandbox a model's chat template renders in: no code, no files, bounded in time and size.

A chat template ships with downloaded weights, so it is untrusted code. It runs in jinja2's
ImmutableSandboxedEnvironment (no attribute tricks, no mutating the caller's data, no imports or
includes), and under limits that hold whatever it does:
  * time: every Python line run during the render is traced and stopped past RENDER_SECONDS (a
    nested empty loop, a runaway macro, a slow filter on a huge string);
  * size: what one operation may build is checked *before* it runs where one step could allocate
    gigabytes (`*`, `%`, `str.format`, `replace`, `indent`, `wordwrap`, sizes passed to filters and
    methods, printing or joining containers), every result is checked after, and all the text one
    render builds is counted (MAX_TOTAL), so a loop of small steps cannot pile up memory either;
  * depth: macros, recursive loops and blocks nest at most MAX_CALL_DEPTH deep; nested values
    printed or serialised at most MAX_NESTING deep;
  * output: at most MAX_BUILT characters, of which at most MAX_OWN_OUTPUT the template's own (what
    it wrote, not the messages): a template cannot bury the user's prompt under its own text.
Messages go in as `UserText` (llm/text/user_text.py), and every operation here keeps track of which
characters came from them, so the caller can tell the template's markup from the user's text.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.runtime import BlockReference, LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .user_text import MAX_ITERATED, UserText, joined, spans_of, whole

MAX_REPEAT = 1 << 20  # longest string/list `*` may build, and the largest size passed to a filter or method
MAX_BUILT = 16 << 20  # longest string/list any one operation may build, and the rendered prompt
MAX_TOTAL = 64 << 20  # all the characters (and list items) one render may build
MAX_OWN_OUTPUT = 1 << 18  # characters of the template's own text in the rendered prompt
MAX_INT_BITS = 1 << 12  # largest integer template arithmetic may produce (well under str()'s digit limit)
MAX_CALL_DEPTH = 64  # macros calling macros, recursive loops, blocks
MAX_NESTING = 64  # nesting of a value that is printed or serialised
MAX_NODES = 100_000  # items in a value that is printed or serialised
MAX_STRFTIME_FORMAT = 64  # characters of a strftime_now format ("%d %B %Y" is 8)
MAX_JSON_INDENT = 16
RENDER_SECONDS = 2.0  # a chat template renders in milliseconds; this much means a loop bomb
MAX_TEMPLATE_CHARACTERS = 1 << 18  # the template's source (compiling is not under the time budget)


class TemplateRefused(SecurityError):
    """The template tried something unsafe or too large; the message says what, in words."""


class RenderTimeout(BaseException):
    """Past the time budget. A BaseException, so that no `except Exception` in library code swallows it."""


class ChatTemplate:
    """A compiled chat template; `render` returns the prompt as text with the messages' spans marked."""

    def __init__(self, source: str) -> None:
        self._compiled = _ChatEnvironment().from_string(source)  # TemplateError if it does not compile
        namespace = self._compiled.root_render_func.__globals__
        # The compiled module prints with `str(...)` and joins `a ~ b` with str_join: give both the checks.
        namespace["str"] = _printed
        namespace["str_join"] = namespace["markup_join"] = _str_join

    def render(self, messages: list[Any], add_generation_prompt: bool, **variables: Any) -> str:
        state = _STATE
        if getattr(state, "active", False):
            raise TemplateRefused("a chat template cannot render another one")
        state.active, state.built, state.depth = True, 0, 0
        try:
            with _time_budget(RENDER_SECONDS):
                chunks = self._compiled.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt, **variables
                )
                out: list[str] = []
                size = own = 0
                for chunk in chunks:
                    size += len(chunk)
                    own += len(chunk) - sum(b - a for a, b in spans_of(chunk))
                    if size > MAX_BUILT:
                        raise TemplateRefused(f"the rendered prompt is over {MAX_BUILT} characters")
                    if own > MAX_OWN_OUTPUT:
                        raise TemplateRefused(
                            f"the rendered prompt is over {MAX_OWN_OUTPUT} characters of the template's own text"
                        )
                    out.append(chunk)
            return joined(out)
        finally:
            state.active = False


_STATE = threading.local()  # the render running on this thread: characters built, call depth


def _count(value: Any) -> None:
    if not getattr(_STATE, "active", False):
        return
    if isinstance(value, (str, list, tuple, dict)):
        _STATE.built += len(value)
        if _STATE.built > MAX_TOTAL:
            raise TemplateRefused(f"the template built over {MAX_TOTAL} characters in all")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounded(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_BUILT:
        raise TemplateRefused(f"a value of {len(value)} items is too large")
    if _is_int(value) and value.bit_length() > MAX_INT_BITS:
        raise TemplateRefused("a number is too large")
    _count(value)
    return value


def measure(value: Any) -> int:
    """About how many characters `value` prints as; refused when too large, too many items or too deep.
    Iterative, and stops early: a list of a million references to one big string costs nothing here."""
    total = 0
    nodes = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise TemplateRefused(f"a value of over {MAX_NODES} items is too large to print")
        if depth > MAX_NESTING:
            raise TemplateRefused(f"a value nested over {MAX_NESTING} deep is too deep to print")
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, dict):
            stack += [(k, depth + 1) for k in item]
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack += [(v, depth + 1) for v in item]
        else:
            total += 24
        if total > MAX_BUILT:
            raise TemplateRefused(f"a value of over {MAX_BUILT} characters is too large to print")
    return total


def has_user_text(value: Any) -> bool:
    """Whether `value` holds a message's text anywhere (True past MAX_NODES items: err on the safe side)."""
    stack = [value]
    nodes = 0
    while stack:
        item = stack.pop()
        nodes += 1
        if isinstance(item, UserText) or nodes > MAX_NODES:
            return True
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack += list(item)
    return False


def _whole_of(value: Any) -> Any:
    """A result computed from a message's text is the user's text, all of it (strings and lists of them)."""
    if isinstance(value, str):
        return value if spans_of(value) == ((0, len(value)),) else whole(value)
    if isinstance(value, (list, tuple)):
        return type(value)(whole(v) if isinstance(v, str) else v for v in value)
    return value


def _printed(value: Any) -> str:
    """`str(value)` for output and `~`: strings as they are (spans kept), containers measured first."""
    if isinstance(value, str):
        return value
    measure(value)
    text = str(value)
    return _bounded(whole(text) if has_user_text(value) else text)


def _str_join(parts: Any) -> str:
    pieces = [_printed(p) for p in parts]
    if sum(len(p) for p in pieces) > MAX_BUILT:
        raise TemplateRefused(f"concatenation to over {MAX_BUILT} characters is too large")
    return _bounded(joined(pieces))


def _concat(parts: Any) -> str:
    """The output buffer of a macro, `{% set %}` block or filter block: spans kept."""
    return _bounded(joined(parts))


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")


def _check_percent(template: Any, values: Any) -> None:
    """`template % values` would build at most MAX_BUILT characters (widths and precisions included)."""
    if not isinstance(template, str):
        return
    args = values if isinstance(values, tuple) else (values,)
    size = len(template) + measure(values)
    for width, precision in _PERCENT_SPEC.findall(template):
        for number in (width, precision):
            if number == "*":
                size += max((abs(a) for a in args if _is_int(a)), default=0)
            elif number:
                size += int(number[:9])  # nine digits already mean over MAX_BUILT
    if size > MAX_BUILT:
        raise TemplateRefused("string formatting would build too large a string")


def _check_format(template: str, args: Any, kwargs: Any) -> None:
    """`template.format(...)` would build at most MAX_BUILT characters (field widths included)."""
    size = len(template) + measure(args) + measure(kwargs)
    for field in _BRACE_FIELD.findall(template):
        size += sum(int(number[:9]) for number in re.findall(r"\d+", field.partition(":")[2]))
    if size > MAX_BUILT:
        raise TemplateRefused("str.format would build too large a string")


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        count = text.count(old) if old else len(text) + 1
        if len(text) + count * (len(new) - len(old)) > MAX_BUILT:
            raise TemplateRefused("replace would build too large a string")


def _check_sizes(what: str, values: Any) -> None:
    if any(_is_int(v) and abs(v) > MAX_REPEAT for v in values):
        raise TemplateRefused(f"{what}: a size over {MAX_REPEAT}")


def _check_lines(text: Any, per_line: Any, lines_every: int = 0) -> None:
    """`indent`/`wordwrap` add `per_line` to every line: refused before, not after, building it."""
    if not isinstance(text, str):
        return
    width = len(per_line) if isinstance(per_line, str) else per_line if _is_int(per_line) else 0
    lines = text.count("\n") + 1 + (len(text) // lines_every if lines_every else 0)
    if len(text) + lines * width > MAX_BUILT:
        raise TemplateRefused("indenting or wrapping would build too large a string")


# Filters that walk their argument item by item: a string is walked character by character.
_ITERATING = frozenset(
    {"list", "sort", "unique", "batch", "slice", "map", "select", "reject", "selectattr", "rejectattr",
     "groupby", "sum", "min", "max"}
)  # fmt: skip


def _checked_filter(name: str, function: Any) -> Any:
    """A filter whose arguments are checked before it runs and whose result is checked after; a string
    it builds from a message's text is the user's text."""

    @functools.wraps(function)  # keeps jinja's pass_context/pass_eval_context markers
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        plain = [a for a in args if not hasattr(a, "environment") and not hasattr(a, "autoescape")]
        subject, rest = (plain[0], plain[1:]) if plain else (None, [])
        _check_sizes(f"filter {name}", [*rest, *kwargs.values()])
        measure(plain)
        measure(kwargs)
        if name in _ITERATING and isinstance(subject, str) and len(subject) > MAX_ITERATED:
            raise TemplateRefused(f"filter {name}: walking a string of {len(subject)} characters is too much")
        if name == "replace" and len(plain) >= 3:
            _check_replace(str(subject), plain[1], plain[2])
        elif name == "format":
            _check_percent(subject, tuple(rest) or kwargs)
        elif name == "indent":
            _check_lines(subject, kwargs.get("width", rest[0] if rest else 4))
        elif name == "wordwrap":
            width = kwargs.get("width", rest[0] if rest else 79)
            wrap = kwargs.get("wrapstring", rest[2] if len(rest) > 2 else "\n")
            _check_lines(subject, wrap, max(int(width), 1) if _is_int(width) else 1)
        result = function(*args, **kwargs)
        if isinstance(result, str) and has_user_text([plain, kwargs]):
            result = _whole_of(result)
        return _bounded(result)

    return wrapper


def _join_filter(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    """jinja's `join`, which sees the user's text even in a generator (its own `str.join` drops it)."""
    from jinja2.filters import make_attrgetter

    if attribute is not None:
        value = map(make_attrgetter(eval_ctx.environment, attribute), value)
    separator = _printed(d)
    pieces: list[str] = []
    size = 0
    for index, item in enumerate(value):
        piece = _printed(item)
        size += len(piece) + (len(separator) if index else 0)
        if size > MAX_BUILT:
            raise TemplateRefused(f"join would build over {MAX_BUILT} characters")
        pieces += [separator, piece] if index else [piece]
    text = joined(pieces)
    # Joining a message's pieces is rewriting it (`content.split(' ') | join('</s>')`): all user text.
    return whole(text) if spans_of(text) else text


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
    # HF's override: Jinja's own tojson escapes HTML characters, which templates do not want.
    if indent is not None and (not _is_int(indent) or not 0 <= indent <= MAX_JSON_INDENT):
        raise TemplateRefused(f"tojson: indent must be 0 to {MAX_JSON_INDENT}")
    measure(value)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    # HF templates call this to reject e.g. a conversation that does not alternate roles.
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > MAX_STRFTIME_FORMAT:
        size = len(fmt) if isinstance(fmt, str) else "no"
        raise TemplateRefused(f"strftime_now: a format of {size} characters (at most {MAX_STRFTIME_FORMAT})")
    return datetime.now().strftime(fmt)


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, plus the checks of the module doc on operators, calls, filters and the output buffers."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})
    concat = staticmethod(_concat)

    def __init__(self) -> None:
        # trim_blocks/lstrip_blocks: the settings HF renders with, so whitespace matches theirs.
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.globals.pop("lipsum", None)  # a text generator no chat template needs
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.filters["tojson"] = _tojson
        for name, function in list(self.filters.items()):
            self.filters[name] = _checked_filter(name, function)
        self.filters["join"] = _checked_filter("join", _pass_eval_context(_join_filter))

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if isinstance(obj, str) and attr == "encode":  # bytes would carry a message's text unmarked
            return False
        return super().is_safe_attribute(obj, attr, value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and _is_int(right) and abs(right) > 64:
            raise TemplateRefused(f"exponent {right} is too large")
        if operator == "**" and _is_int(left) and _is_int(right) and left.bit_length() * abs(right) > MAX_INT_BITS:
            raise TemplateRefused("the power is too large a number")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                sized = isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                if sized and len(seq) * count > MAX_REPEAT:
                    raise TemplateRefused(f"repetition to {len(seq) * count} items is too large")
            if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateRefused("the product is too large a number")
        if operator == "%":
            _check_percent(left, right)
        sequences = isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple))
        if operator == "+" and sequences and len(left) + len(right) > MAX_BUILT:
            raise TemplateRefused(f"concatenation to {len(left) + len(right)} items is too large")
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, str) and not spans_of(result) and has_user_text([left, right]):
            result = whole(result)  # `'%s' % (content,)`: formatted from the user's text
        return _bounded(result)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox's str.format wrapper
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            name = getattr(target, "__name__", "?")
            _check_sizes(f"str.{name}", [*args, *kwargs.values()])
            if name == "replace" and len(args) >= 2:
                _check_replace(owner, args[0], args[1])
            elif name in ("format", "format_map"):
                _check_format(owner, args, kwargs)
            elif name == "join" and args:
                measure(args[0])
        depth = _STATE.depth = getattr(_STATE, "depth", 0) + 1
        try:
            if depth > MAX_CALL_DEPTH:
                raise TemplateRefused(f"macros or loops call each other over {MAX_CALL_DEPTH} deep")
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            _STATE.depth -= 1
        own_writing = isinstance(__obj, (Macro, LoopContext, BlockReference))  # spans kept by the buffers
        if not own_writing and has_user_text([owner, args, kwargs]):
            result = _whole_of(result)
        return _bounded(result)


def _pass_eval_context(function: Any) -> Any:
    from jinja2 import pass_eval_context

    return pass_eval_context(function)


@contextmanager
def _time_budget(seconds: float) -> Iterator[None]:
    """Trace every Python frame of the render and stop it past `seconds`: a line event fires on every
    loop iteration, so even an empty nested loop, or a filter grinding through a huge string, stops."""
    deadline = time.perf_counter() + seconds

    def local(frame: Any, event: str, arg: Any) -> Any:
        if time.perf_counter() > deadline:
            raise RenderTimeout
        return local

    def global_trace(frame: Any, event: str, arg: Any) -> Any:
        return local

    previous = sys.gettrace()
    sys.settrace(global_trace)
    try:
        yield
    finally:
        sys.settrace(previous)
