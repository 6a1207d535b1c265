"""`output.filter`: mask or reject completions that match a blocklist — before anything is shown or kept.

The blocklist is a UTF-8 file, one entry per line; blank lines and lines starting with `#` are
ignored. An entry `re:PATTERN` is a Python regular expression (case-insensitive); any other entry
is a literal word or phrase. Matching is on normalized text (NFKC, case folding, invisible
characters removed, Latin lookalikes mapped, whitespace folded: see `text_match.py`), so
`ｓｅｃｒｅｔ`, `se\\u200bcret`, `𝐬𝐞𝐜𝐫𝐞𝐭` and `ѕесrеt` are all `secret`, and `STRASSE` is `straße`.
A literal is matched as a whole word when its normalized form is ASCII, as a substring otherwise
(CJK text has no word boundaries).

`action: mask` replaces every match with `***`; `action: reject` empties the text (and the beam
candidates' texts) and sets `error: "rejected by filter"`, keeping `finish_reason`. Either way the
entries that matched are listed in `Result.flagged`, and a flagged answer keeps no token-level
data — token ids, logprobs, top logprobs, beam tokens — since the ids spell what the text no longer
says: not in JSON, `--json`, the results database (where it is also never replayed from the cache),
nor in `generations.json`.

Where the filter sits is forced, not left to the plan's order:
  * it `edits` the `completions` slot, so the graph runs it after `output.detokenize` and before
    every other reader of `completions` (`output.write`, `output.cache`, any plugin sink); a plan
    that asks for the opposite (`after: [write]`) is a cycle and is refused by validation;
  * text streamed during generation goes through it too: `prepare` (before any stage runs) wraps
    `ctx.stream` in a `StreamGuard`, which holds back only as many characters as a blocked entry
    could still need and masks (or, for reject, stops) the stream at a match;
  * `generations.json` (written by the generation stage) drops the token-level data of every
    generation the filter flags: `prepare` leaves the matcher where `observe.finish_observing` finds it.
A blocklist that cannot be read or parsed stops the run in `prepare`, before the model is loaded.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage

from .slots import InferenceContext
from .text_match import Entry, Matcher, StreamGuard, literal_entry, regex_entry
from .types import Result

MASK = "***"
REJECTED = "rejected by filter"
MATCHERS_KEY = "ext.output_filters"  # ctx.ext: the Matchers of the plan's filters (prepare puts them)


class FilterParams(Params):
    blocklist: str = Field(description="file of words or `re:` patterns, one per line; # comments")
    action: Literal["mask", "reject"] = Field("mask", description="mask: replace matches with ***; reject: drop text")


def load_blocklist(path: str | Path) -> list[Entry]:
    """Parse the blocklist; a bad line raises StageFailure naming `file:line`."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise StageFailure(f"{path}: blocklist file not found") from None
    except (OSError, UnicodeDecodeError) as bad:
        raise StageFailure(f"{path}: cannot read the blocklist ({bad})") from None
    entries: list[Entry] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
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
        else:
            entry = literal_entry(line)
            if not entry.width:
                raise StageFailure(f"{path}:{number}: {line!r} is empty once normalized (only invisible characters)")
        entries.append(entry)
    return entries


def apply_filter(completion: Result, entries: list[Entry] | Matcher, action: str) -> bool:
    """Mask or reject one completion in place; True when something matched."""
    matcher = entries if isinstance(entries, Matcher) else Matcher(entries)
    hits = matcher.labels(completion.text, *completion.candidate_texts)
    if not hits:
        return False
    completion.flagged = list(dict.fromkeys([*completion.flagged, *hits]))
    if action == "reject":
        completion.text = ""
        completion.candidate_texts = ["" for _ in completion.candidate_texts]
        completion.error = REJECTED
    else:
        completion.text = matcher.mask(completion.text, MASK)
        completion.candidate_texts = [matcher.mask(text, MASK) for text in completion.candidate_texts]
    # The ids (and their logprobs) spell the text that was masked or rejected: keep none of them. New lists,
    # not edits in place: the same lists may still be held by the result in `generations` or `answers`.
    completion.redacted_tokens = completion.completion_tokens
    completion.tokens, completion.ids, completion.logprobs, completion.token_logprobs = [], [], [], None
    completion.candidates = [replace(cand, tokens=[]) for cand in completion.candidates]
    completion.candidate_ids = [[] for _ in completion.candidate_ids]
    return True


def flags(ctx: InferenceContext, *texts: str) -> bool:
    """Whether a filter of this plan (see `prepare`) matches any of `texts`."""
    return any(m.labels(*texts) for m in ctx.ext.get(MATCHERS_KEY) or [])


class OutputFilter(Stage):
    """Mask or reject completions matching a blocklist, before every sink and in the stream."""

    name = "output.filter"
    phase = Phase.OUTPUT
    Params = FilterParams
    edits = ("completions",)

    def prepare(self, ctx: InferenceContext, params: Any) -> None:
        matcher = Matcher(load_blocklist(params.blocklist))
        ctx.ext.setdefault(MATCHERS_KEY, []).append(matcher)
        ctx.ext[_own_key(params)] = matcher
        ctx.stream = StreamGuard(ctx.stream, matcher, params.action, MASK)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.completions is not None
        matcher = ctx.ext.get(_own_key(params)) or Matcher(load_blocklist(params.blocklist))
        flagged = 0
        for completion in ctx.completions:
            if apply_filter(completion, matcher, params.action):
                flagged += 1
                ctx.log.info("output_flagged", request=completion.request_id, entries=completion.flagged)
        ctx.metrics.set("entries", len(matcher.entries))
        ctx.metrics.set("flagged", flagged)

    def check(self, params: Any, deep: DeepCheck) -> None:
        try:
            load_blocklist(params.blocklist)
        except StageFailure as bad:
            deep.problem(str(bad), "blocklist")


def _own_key(params: FilterParams) -> str:
    return f"{MATCHERS_KEY}.{params.blocklist}.{params.action}"
