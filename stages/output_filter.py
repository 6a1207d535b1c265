"""`output.filter`: mask or reject completions that match a blocklist.

The blocklist is a UTF-8 file, one entry per line; blank lines and lines starting with `#` are
ignored. An entry `re:PATTERN` is a Python regular expression (case-insensitive); any other
entry is a literal word or phrase, matched case-insensitively — as a whole word when it is ASCII,
as a plain substring otherwise (CJK text has no word boundaries).

`action: mask` replaces every match with `***`; `action: reject` empties the text (and the beam
candidates' texts), sets `error: "rejected by filter"` and keeps `finish_reason`. Either way the
entries that matched are listed in `Completion.flagged`.

The stage edits the completions in place and writes no slot (a slot has one writer), so a plan
orders its sinks after it explicitly: `output.write` with `after: [filter]`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage

from .slots import InferenceContext
from .types import Completion

MASK = "***"
REJECTED = "rejected by filter"


class FilterParams(Params):
    blocklist: str = Field(description="file of words or `re:` patterns, one per line; # comments")
    action: Literal["mask", "reject"] = Field("mask", description="mask: replace matches with ***; reject: drop text")


@dataclass(frozen=True)
class Entry:
    label: str  # the line as written, for `flagged`
    pattern: re.Pattern[str]


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
                pattern = re.compile(source, re.IGNORECASE)
            except re.error as bad:
                raise StageFailure(f"{path}:{number}: bad regular expression {source!r}: {bad}") from None
            if pattern.match(""):
                raise StageFailure(f"{path}:{number}: regular expression {source!r} matches the empty string")
        else:
            word = re.escape(line)
            pattern = re.compile(rf"(?<!\w){word}(?!\w)" if line.isascii() else word, re.IGNORECASE)
        entries.append(Entry(line, pattern))
    return entries


def apply_filter(completion: Completion, entries: list[Entry], action: str) -> bool:
    """Mask or reject one completion in place; True when something matched."""
    texts = [completion.text, *(c.get("text", "") for c in completion.candidates)]
    hits = [e.label for e in entries if any(e.pattern.search(t) for t in texts)]
    if not hits:
        return False
    completion.flagged = list(dict.fromkeys([*completion.flagged, *hits]))
    if action == "reject":
        completion.text = ""
        for cand in completion.candidates:
            cand["text"] = ""
        completion.error = REJECTED
    else:
        completion.text = _mask(completion.text, entries)
        for cand in completion.candidates:
            cand["text"] = _mask(cand.get("text", ""), entries)
    return True


def _mask(text: str, entries: list[Entry]) -> str:
    for entry in entries:
        text = entry.pattern.sub(MASK, text)
    return text


class OutputFilter(Stage):
    """Mask or reject completions matching a blocklist (edits completions in place)."""

    name = "output.filter"
    phase = Phase.OUTPUT
    Params = FilterParams
    reads = ("completions",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.completions is not None
        entries = load_blocklist(params.blocklist)
        flagged = 0
        for completion in ctx.completions:
            if apply_filter(completion, entries, params.action):
                flagged += 1
                ctx.log.info("output_flagged", request=completion.request_id, entries=completion.flagged)
        ctx.metrics.set("entries", len(entries))
        ctx.metrics.set("flagged", flagged)

    def check(self, params: Any, deep: DeepCheck) -> None:
        try:
            load_blocklist(params.blocklist)
        except StageFailure as bad:
            deep.problem(str(bad), "blocklist")
