"""`output.filter`: mask or reject completions that match a blocklist — before anything is shown or kept.

The blocklist is a UTF-8 file, one entry per line; blank lines and lines starting with `#` are
ignored. An entry `re:PATTERN` is a Python regular expression (case-insensitive); any other entry
is a literal word or phrase. Matching is on normalized text (NFKD with combining marks stripped,
case folding, invisible and format characters removed, Unicode's confusables mapped to the ASCII
letters they pass for, whitespace folded; also with digits read as letters, and in display order
when bidi controls reorder the text: see `text_match.py`), so `ｓｅｃｒｅｔ`, `se\u200bcret`,
`𝐬𝐞𝐜𝐫𝐞𝐭`, `ѕесrеt`, `sécret`, `s̲e̲c̲r̲e̲t̲` and `s3cr3t` are all `secret`, and `STRASSE` is `straße`.
A literal is matched as a whole word when its normalized form is ASCII, as a substring otherwise
(CJK text has no word boundaries). The file is read bounded: a regular file of at most
`BLOCKLIST_BYTES`, at most `MAX_ENTRIES` entries of at most `MAX_ENTRY_CHARS` characters.

`action: mask` replaces every match with `***`; `action: reject` empties the text (and the beam
candidates' texts) and sets `error: "rejected by filter"`, keeping `finish_reason`. A flagged answer
keeps no token-level data — token ids, logprobs, top logprobs, alternatives, beam tokens — since the
ids spell what the text no longer says: not in JSON, `--json`, the results database (where it is also
never replayed from the cache), `generations.json`, the report, nor the server's `logprobs`. The
text of the generated ids is checked too (it may go on past a stop string the text was cut at).

An answer whose text is clean may still have been one token away from a blocked word: an alternative
token (top logprobs, the run's record of the best tokens at each step) that, after the text before
it, completes a match is withheld — dropped from `top_logprobs`, `token_logprobs` and
`generations.json` — and the answer is flagged.

`Result.flagged` says THAT something was withheld and how much (`"masked 2 blocklist matches"`,
`"3 alternative tokens withheld"`), never what: no entry of the blocklist is written anywhere, in the
results, the logs or the metrics.

Where the filter sits is forced, not left to the plan's order:
  * it `edits` the `completions` slot, so the graph runs it after `output.detokenize` and before
    every other reader of `completions` (`output.write`, `output.cache`, any plugin sink); a plan
    that asks for the opposite (`after: [write]`) is a cycle and is refused by validation;
  * text streamed during generation goes through it too: `prepare` (before any stage runs) wraps
    `ctx.stream` in a `StreamGuard`, which holds back only as many characters as a blocked entry
    could still need and masks (or, for reject, stops) the stream at a match;
  * `generations.json` (written by the generation stage) drops the token-level data of every
    generation the filter flags, and the alternatives it withholds: `prepare` leaves the matcher
    where `observe.finish_observing` finds it (`screen_generation`).
A blocklist that cannot be read or parsed stops the run in `prepare`, before the model is loaded.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from llmplan.bounded_read import NotRegularFileError, TooLargeError, read_limited
from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage
from llmplan.llm.text import (
    UNBOUNDED,
    ConfusablesMissing,
    Entry,
    Matcher,
    StreamGuard,
    confusables,
    literal_entry,
    normalize,
    regex_entry,
)

from .slots import InferenceContext
from .types import Result

MASK = "***"
REJECTED = "rejected by filter"
MATCHERS_KEY = "ext.output_filters"  # ctx.ext: the Matchers of the plan's filters (prepare puts them)
BLOCKLIST_BYTES = 4 << 20  # a blocklist is a list of words: 4 MiB is far more than any real one
MAX_ENTRIES = 20_000
MAX_ENTRY_CHARS = 1_000

Decode = Callable[[list[int]], str]


class FilterParams(Params):
    blocklist: str = Field(description="file of words or `re:` patterns, one per line; # comments")
    action: Literal["mask", "reject"] = Field("mask", description="mask: replace matches with ***; reject: drop text")


def read_blocklist(path: Path) -> str:
    """The blocklist's text, read bounded; anything but a small UTF-8 regular file is refused naming it."""
    advice = "point the filter's `blocklist` at a UTF-8 text file"
    try:
        data = read_limited(path, BLOCKLIST_BYTES, "blocklist")
    except FileNotFoundError:
        raise StageFailure(f"{path}: blocklist file not found") from None
    except IsADirectoryError:
        raise StageFailure(f"{path}: the blocklist is a directory, not a file; {advice}") from None
    except NotRegularFileError:
        raise StageFailure(
            f"{path}: the blocklist is not a regular file (a FIFO, socket or device); {advice}"
        ) from None
    except TooLargeError as big:
        raise StageFailure(
            f"{path}: the blocklist has more than {big.limit} bytes (at least {big.size}); a blocklist is a list of "
            f"words, at most {BLOCKLIST_BYTES >> 20} MiB"
        ) from None
    except OSError as bad:
        raise StageFailure(f"{path}: cannot read the blocklist ({bad.strerror or bad}); {advice}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise StageFailure(f"{path}: the blocklist is not UTF-8 text (byte {bad.start}); {advice}") from None


def load_blocklist(path: str | Path) -> list[Entry]:
    """Parse the blocklist; a bad line raises StageFailure naming `file:line`."""
    path = Path(path)
    lines = read_blocklist(path).splitlines()
    entries: list[Entry] = []
    try:
        confusables.load()
        for number, raw in enumerate(lines, start=1):
            entry = _entry(path, number, raw.strip())
            if entry is None:
                continue
            entries.append(entry)
            if len(entries) > MAX_ENTRIES:
                raise StageFailure(f"{path}:{number}: the blocklist has more than {MAX_ENTRIES} entries")
    except ConfusablesMissing as missing:
        raise StageFailure(f"{path}: {missing}") from None
    return entries


def _entry(path: Path, number: int, line: str) -> Entry | None:
    if not line or line.startswith("#"):
        return None
    if len(line) > MAX_ENTRY_CHARS:
        raise StageFailure(f"{path}:{number}: an entry of {len(line)} characters; at most {MAX_ENTRY_CHARS}")
    if line.startswith("re:"):
        source = line[3:].strip()
        if not source:
            raise StageFailure(f"{path}:{number}: empty regular expression after 're:'")
        try:
            entry = regex_entry(line, source)
        except re.error as bad:
            raise StageFailure(f"{path}:{number}: bad regular expression {source!r}: {bad}") from None
        if entry.folded.match(""):
            raise StageFailure(f"{path}:{number}: regular expression {source!r} matches the empty string")
        return entry
    entry = literal_entry(line)
    if not entry.width:
        raise StageFailure(f"{path}:{number}: {line!r} is empty once normalized (only invisible characters)")
    return entry


def decoder(tokenizer: Any) -> Decode | None:
    """Ids → text as a reader gets it (special tokens and out-of-range ids left out); None without a tokenizer."""
    if tokenizer is None:
        return None
    vocab = tokenizer.vocab_size

    def decode(ids: list[int]) -> str:
        return tokenizer.decode([int(i) for i in ids if 0 <= int(i) < vocab], skip_special_tokens=True)

    return decode


def withheld_alternatives(
    matcher: Matcher, tokens: list[int], steps: list[list[tuple[int, float]]] | None, decode: Decode
) -> list[set[int]]:
    """Per step, the alternative ids that, after the tokens before them, complete a match."""
    if not steps:
        return []
    bounded = matcher.hold < UNBOUNDED
    withheld: list[set[int]] = []
    for i, step in enumerate(steps):
        # Enough tokens before the step for the longest entry: doubled while their normalized text is shorter
        # (a byte-level token may be a fraction of a character, a cluster of marks many tokens).
        take = matcher.hold + 8 if bounded else i
        before_ids = list(tokens[max(0, i - take) : i])
        before = decode(before_ids)
        while bounded and take < i and len(normalize(before)) <= matcher.hold:
            take *= 2
            before_ids = list(tokens[max(0, i - take) : i])
            before = decode(before_ids)
        chosen = int(tokens[i]) if i < len(tokens) else None
        blocked: set[int] = set()
        for token, _ in step or []:
            if int(token) == chosen or int(token) in blocked:
                continue  # the chosen token is in the text, which was checked whole
            text = decode([*before_ids, int(token)])
            common = _common_prefix(before, text)
            if any(m.end > common for m in matcher.find(text, ending_after=common)):
                blocked.add(int(token))
        withheld.append(blocked)
    return withheld


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _steps(result: Result) -> list[list[tuple[int, float]]] | None:
    """Every alternative recorded per step: the run's record (a superset of top_logprobs) or top_logprobs."""
    if result.alternatives:
        return result.alternatives
    return result.top_logprobs


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('ch') else 's'}"


def apply_filter(completion: Result, entries: list[Entry] | Matcher, action: str, decode: Decode | None = None) -> bool:
    """Mask or reject one completion in place; True when something matched or was withheld.

    `decode` (ids → text) lets the filter check the generated ids themselves and the alternatives."""
    matcher = entries if isinstance(entries, Matcher) else Matcher(entries)
    shown = matcher.count(completion.text, *completion.candidate_texts)
    behind = 0
    if decode is not None:
        behind = matcher.count(decode(completion.tokens), *(decode(list(c.tokens)) for c in completion.candidates))
    if shown or behind:
        if action == "reject":
            note = f"rejected: {_plural(max(shown, behind), 'blocklist match')}"
            completion.text = ""
            completion.candidate_texts = ["" for _ in completion.candidate_texts]
            completion.rejected = REJECTED
        else:
            note = f"masked {_plural(shown, 'blocklist match')}" if shown else "token data withheld"
            completion.text = matcher.mask(completion.text, MASK)
            completion.candidate_texts = [matcher.mask(text, MASK) for text in completion.candidate_texts]
        completion.flagged = [*completion.flagged, note]
        _redact_tokens(completion)
        return True
    if decode is None:
        return False
    withheld = withheld_alternatives(matcher, completion.tokens, _steps(completion), decode)
    count = sum(len(ids) for ids in withheld)
    if not count:
        return False
    completion.flagged = [*completion.flagged, f"{_plural(count, 'alternative token')} withheld"]
    _drop_alternatives(completion, withheld)
    return True


def _redact_tokens(completion: Result) -> None:
    # The ids (and their logprobs and alternatives) spell the text that was masked or rejected: keep none of
    # them. `redacted_tokens` hides the generation's (which `generations` still holds); the rest are new lists,
    # not edits in place: the same lists may still be held by `answers`.
    completion.redacted_tokens = completion.completion_tokens
    completion.ids, completion.token_logprobs = [], None
    completion.candidates = [replace(cand, tokens=[]) for cand in completion.candidates]
    completion.candidate_ids = [[] for _ in completion.candidate_ids]


def _drop_alternatives(completion: Result, withheld: list[set[int]]) -> None:
    # top_logprobs and alternatives leave out what `withheld` names (the generation keeps them for the record)
    before = completion.withheld or []
    steps = max(len(before), len(withheld))
    completion.withheld = [
        (before[i] if i < len(before) else set()) | (withheld[i] if i < len(withheld) else set()) for i in range(steps)
    ]
    if completion.token_logprobs is not None:
        completion.token_logprobs = [
            {
                **entry,
                "top_logprobs": [
                    a for a in entry["top_logprobs"] if i >= len(withheld) or int(a["id"]) not in withheld[i]
                ],
            }
            for i, entry in enumerate(completion.token_logprobs)
        ]


def screen_generation(ctx: InferenceContext, result: Result) -> tuple[bool, list[set[int]]]:
    """For the run's record (generations.json), before the filter stage runs: whether a filter of this plan
    (see `prepare`) flags the generated ids' text, and else the alternatives it withholds at each step."""
    matchers = ctx.ext.get(MATCHERS_KEY) or []
    decode = decoder(ctx.tokenizer)
    if not matchers or decode is None:
        return False, []
    texts = [decode(result.tokens), *(decode(list(c.tokens)) for c in result.candidates)]
    if any(m.count(*texts) for m in matchers):
        return True, []
    withheld: list[set[int]] = []
    for matcher in matchers:
        for i, ids in enumerate(withheld_alternatives(matcher, result.tokens, _steps(result), decode)):
            if i < len(withheld):
                withheld[i] |= ids
            else:
                withheld.append(set(ids))
    return False, withheld


class OutputFilter(Stage):
    """Mask or reject completions matching a blocklist, before every sink and in the stream."""

    name = "output.filter"
    phase = Phase.OUTPUT
    Params = FilterParams
    optional_reads = ("tokenizer",)
    edits = ("completions",)

    def prepare(self, ctx: InferenceContext, params: Any) -> None:
        matcher = Matcher(load_blocklist(params.blocklist))
        ctx.ext.setdefault(MATCHERS_KEY, []).append(matcher)
        ctx.ext[_own_key(params)] = matcher
        ctx.stream = StreamGuard(ctx.stream, matcher, params.action, MASK)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.completions is not None
        matcher = ctx.ext.get(_own_key(params)) or Matcher(load_blocklist(params.blocklist))
        decode = decoder(ctx.tokenizer)
        flagged = 0
        for completion in ctx.completions:
            if apply_filter(completion, matcher, params.action, decode):
                flagged += 1
                ctx.log.info("output_flagged", request=completion.request_id, withheld=completion.flagged)
        ctx.metrics.set("entries", len(matcher.entries))
        ctx.metrics.set("flagged", flagged)

    def check(self, params: Any, deep: DeepCheck) -> None:
        try:
            load_blocklist(params.blocklist)
        except StageFailure as bad:
            deep.problem(str(bad), "blocklist")


def _own_key(params: FilterParams) -> str:
    return f"{MATCHERS_KEY}.{params.blocklist}.{params.action}"
