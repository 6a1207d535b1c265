"""The output filter, attacked: lookalike spellings of a blocked word on every channel that carries generated
text, the blocklist file read bounded, and benign twins that must pass untouched.

The model is the real tiny Llama run through the real stages, server and sinks; only its next-token
distribution is scripted (`ScriptedModel` replaces the logits the sampler sees), so that it says exactly the
hostile text, with exactly the alternatives, a model prompted into mischief could produce. Each case then
searches everything the run or the server put out — decoded JSON, HTML unescaped, every file of the run
directory, the results database — normalized the way the filter normalizes, and asserts that the blocked
word is on no channel.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import os
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from llmplan.llm.sampling import chain as sampling
from llmplan.llm.text import Matcher, Tokenizer, literal_entry, normalize
from llmplan.llm.text.text_match import _LEET_I, _LEET_L
from llmplan.stages.output_filter import load_blocklist
from tests.stages.tiny_run import load_stages, make_tiny_model_dir
from tests.trust.hostile import assert_untouched, memory_bound, refused, snapshot, time_bound

# A lookalike family: how an attacker (or a model told to) writes a blocked word so that it reads the same.
# Each family spells its own word, so that the cases of one run are told apart by the word they look for.
FAMILIES: dict[str, tuple[str, str]] = {
    "plain": ("banana", "banana"),
    "capitals": ("cherry", "CHERRY"),
    "combining-low-line": ("lemon", "l\u0332e\u0332m\u0332o\u0332n\u0332"),
    "stacked-marks": ("mango", "m\u0336\u0301a\u0353\u033dn\u0337g\u0334o\u0300"),
    "accents": ("papaya", "pap\u00e1y\u00e0"),
    # six marks on every letter: a character is a dozen byte tokens, far more than the word's length
    "zalgo": ("pecan", "".join(ch + "\u0300\u0301\u0316\u0317\u0336\u0353" for ch in "pecan")),
    "latin-alpha": ("guava", "gu\u0251v\u0251"),
    "cyrillic": ("peach", "\u0440\u0435\u0430\u0441h"),
    "cyrillic-soft-sign": ("bagel", "\u042c\u0430g\u0435l"),
    "greek": ("apricot", "\u03b1\u03c1r\u03b9c\u03bft"),
    "cherokee": ("steak", "\u13da\u13a2\u13ac\u13aa\u13e6"),
    "fullwidth": ("plum", "\uff50\uff4c\uff55\uff4d"),
    "math-bold": ("grape", "\U0001d420\U0001d42b\U0001d41a\U0001d429\U0001d41e"),
    "digits": ("tomato", "t0m4t0"),
    "symbols": ("raisin", "r@i$in"),
    "right-to-left-override": ("olive", "\u202eevilo\u202c"),
    "isolate-then-override": ("walnut", "\u2067\u202etunlaw\u202c\u2069"),
    "bidi-marks": ("quince", "qu\u200ein\u200fc\u061ce"),
    "zero-width": ("lime", "li\u200bm\u200de"),
    "tag-characters": ("melon", "me\U000e0041lo\U000e007fn"),
    "variation-selectors": ("kiwi", "k\ufe0fi\ufe0ew\ufe00i"),
}
WORDS = sorted({word for word, _ in FAMILIES.values()})
NAMES = list(FAMILIES)
# Text that must pass: it resembles a blocked word only in ways that are not lookalikes.
BENIGN: dict[str, tuple[str, str]] = {
    "plural": ("pears and more", "pear"),
    "d-is-not-cl": ("a clear day", "dear"),
    "m-is-not-rn": ("corn bread", "com"),
    "i-is-not-l": ("they bail out", "ball"),
    "part-number": ("the Galaxy A55 phone", "ass"),
    "a-number": ("page 101 of the book", "lol"),
    "dakuten": ("ばかり", "はか"),
    "devanagari-vowel-sign": ("किताब", "कत"),
    "classic": ("a classic tale", "class"),
}
_CONTROLS = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"


def found_words(text: str, words: list[str] = WORDS) -> set[str]:
    """The words of `words` that `text` spells, normalized the way the filter normalizes (every view it
    matches: the normalized text, digits read as letters, the display order of bidi controls)."""
    matcher = Matcher([literal_entry(w) for w in words])
    found = set()
    for match in matcher.find(text):
        piece = normalize(text[match.start : match.end])
        readings = {piece, piece[::-1], *(piece.translate(t) for t in (_LEET_L, _LEET_I))}
        found |= {w for w in words if any(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", r) for r in readings)}
    return found


def strings_of(value: Any) -> Iterator[str]:
    """Every string inside decoded JSON (keys too), and what a run of token strings spells when joined:
    a list of strings (`pieces`, legacy `tokens`) and the `token`s of a list of logprob entries."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from strings_of(item)
    elif isinstance(value, list | tuple):
        if value and all(isinstance(item, str) for item in value):
            yield "".join(value)
        if value and all(isinstance(item, dict) and isinstance(item.get("token"), str) for item in value):
            yield "".join(item["token"] for item in value)
        for item in value:
            yield from strings_of(item)


def readable(path: Path) -> str:
    """A file's text as a reader gets it: JSON decoded to its strings, HTML unescaped, JSONL line by line."""
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        return "\n".join(strings_of(json.loads(raw)))
    if path.suffix == ".jsonl":
        return "\n".join(s for line in raw.splitlines() if line.strip() for s in strings_of(json.loads(line)))
    if path.suffix in (".html", ".htm", ".svg"):
        return html.unescape(raw)
    return raw


def database_text(db: Path) -> str:
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT * FROM results").fetchall()
    return "\n".join(str(value) for row in rows for value in row)


# --- the scripted model ---------------------------------------------------------------------------------


class ScriptedModel:
    """What the model says, per request: the prompt names a case (`case NAME`), the case's script gives the
    token to pick at each step and the alternatives ranked just below it. The sampler, the scheduler, the
    stages and the server are the real ones; the logits they see are the script's."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.scripts: dict[str, tuple[list[int], dict[int, list[int]]]] = {}
        self.eos = 2

    def add(self, case: str, answer: list[int], alternatives: dict[int, list[int]] | None = None) -> None:
        self.scripts[case] = (answer, alternatives or {})

    def logits(self, picker: Any, row: torch.Tensor, seen: list[int]) -> torch.Tensor:
        if not hasattr(picker, "_script"):
            prompt = self.tokenizer.decode(seen, skip_special_tokens=True)
            found = re.search(r"case ([\w-]+)", prompt)
            picker._script = self.scripts.get(found.group(1)) if found else None
        script = picker._script
        if script is None:
            return row
        answer, alternatives = script
        step = len(seen) - picker.prompt_len
        scripted = torch.full_like(row, -30.0)
        scripted[answer[step] if step < len(answer) else self.eos] = 10.0
        for rank, token in enumerate(alternatives.get(step, [])):
            scripted[token] = 9.0 - rank
        return scripted


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir, _ = make_tiny_model_dir(tmp_path_factory.mktemp("filter-model"), n_layers=1)
    return model_dir


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def scripted(tokenizer: Tokenizer) -> Iterator[ScriptedModel]:
    model = ScriptedModel(tokenizer)
    original = sampling.Picker.__call__

    def call(self: Any, logits_row: torch.Tensor, seen: list[int]) -> Any:
        if self.prompt_len is None:
            self.prompt_len = len(seen)
        return original(self, model.logits(self, logits_row, seen), seen)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling.Picker, "__call__", call)
        yield model


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    tokens = tokenizer.encode(text, add_bos=False, special=False)
    assert tokenizer.decode(tokens) == text, "the tokenizer must spell the hostile text exactly"
    return tokens


@pytest.fixture(scope="module")
def blocklist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("blocklist") / "block.txt"
    entries = [*WORDS, *sorted({entry for _, entry in BENIGN.values()})]
    path.write_text("# the words this deployment never shows\n" + "\n".join(entries) + "\n", encoding="utf-8")
    return path


def plan_dict(
    model_dir: Path, blocklist: Path, prompts: Path | None, tmp: Path, *, action: str = "mask", **generate: Any
) -> dict[str, Any]:
    """The filtered plan; without `prompts` a served one (chat messages, the terminal its only sink)."""
    prompt = (
        {"prompts_file": str(prompts)} if prompts is not None else {"messages": [{"role": "user", "content": "hi"}]}
    )
    sinks: list[Any] = ["terminal"]
    if prompts is not None:
        sinks += [{"json": str(tmp / "out.json")}, {"markdown": str(tmp / "out.md")}]
    return {
        "name": "hostile-filter",
        "device": "cpu",
        "seed": 0,
        "threads": 1,
        "observe": {"memory_interval_ms": 0},
        "stages": [
            *load_stages(model_dir, place={"max_batch": 4, "kv_cache": {"max_tokens": 160}}),
            {"id": "prompt", "uses": "compute.tokenize", "with": prompt},
            {
                "id": "generate",
                "uses": "compute.generate",
                "with": {
                    "max_new_tokens": 96,
                    "temperature": 0,
                    "serving_defaults": ["temperature"],  # served requests greedy too (#28: API defaults else)
                    "stream": False,
                    "logprobs": 5,
                    **generate,
                },
            },
            {"id": "clean", "uses": "output.postprocess"},
            {"id": "text", "uses": "output.detokenize"},
            {"id": "filter", "uses": "output.filter", "with": {"blocklist": str(blocklist), "action": action}},
            {"id": "write", "uses": "output.write", "with": {"to": sinks}},
            *(
                [{"id": "store", "uses": "output.cache", "with": {"db": str(tmp / "results.sqlite")}}]
                if prompts
                else []
            ),
        ],
    }


@dataclass
class Run:
    """One CLI run of the filtered plan: what it printed and wrote, and the words found anywhere in it."""

    tmp: Path
    run_dir: Path
    stdout: str
    stderr: str
    results: dict[str, dict[str, Any]]
    everything: str
    found: set[str]

    def record(self, request_id: str) -> dict[str, Any]:
        records = json.loads((self.run_dir / "generations.json").read_text(encoding="utf-8"))
        return next(r for r in records if r["request_id"] == request_id)


def run_plan(tmp: Path, plan: dict[str, Any], requests: list[str], *extra: str) -> Run:
    """`llmplan run PLAN --json` in-process; one request per id, each saying `case ID`."""
    from llmplan.engine.cli import main

    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": r, "text": f"Say it: case {r}."}) + "\n" for r in requests))
    path = tmp / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, allow_unicode=True, sort_keys=False), encoding="utf-8")
    run_dir = tmp / "run"
    out, err = io.StringIO(), io.StringIO()
    with time_bound(120), memory_bound(1024), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", str(path), "--out", str(run_dir), "--json", *extra])
    assert code == 0, err.getvalue()[-2000:]
    results = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    texts = [out.getvalue(), err.getvalue(), database_text(tmp / "results.sqlite"), report_html(run_dir)]
    texts += [readable(p) for p in sorted([*run_dir.rglob("*"), tmp / "out.json", tmp / "out.md"]) if p.is_file()]
    everything = "\n".join(texts)
    return Run(tmp, run_dir, out.getvalue(), err.getvalue(), results, everything, found_words(everything))


def report_html(run_dir: Path) -> str:
    """The report's generation view (the tokens' hover text: the alternatives) built from the run directory."""
    from llmplan.commands.report.figures_generation import draw_generation
    from llmplan.commands.report.run_data import RunData

    figures = draw_generation(RunData.load(run_dir), run_dir)
    return html.unescape("".join(f.html or "" for f in figures))


def assert_withheld(case: str, found: set[str], *texts: str) -> None:
    """The family's word is nowhere (normalized), nor its hostile spelling as written."""
    word, spelling = FAMILIES[case]
    assert word in found_words(f"x {spelling} y"), "the check itself must see the hostile spelling"
    assert word not in found, f"{word!r} got out"
    visible = spelling.strip(_CONTROLS)
    for text in texts:
        assert visible not in text, f"the hostile spelling {spelling!r} got out"


def completing_split(tokenizer: Tokenizer, spelling: str) -> tuple[list[int], int]:
    """The spelling's tokens up to the one that completes the word (which do not spell it), and that token."""
    tokens = ids(tokenizer, spelling)
    word = next(w for w, s in FAMILIES.values() if s == spelling)
    for end in range(1, len(tokens) + 1):
        if word in found_words(tokenizer.decode(tokens[:end]), [word]):
            return tokens[: end - 1], tokens[end - 1]
    raise AssertionError(f"{spelling!r} never spells {word!r}")


# --- 1. the stage's text, on every channel of a run -----------------------------------------------------


@pytest.fixture(scope="module")
def masked_run(scripted, tokenizer, model_dir, blocklist, tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("masked")
    for name, (_, spelling) in FAMILIES.items():
        scripted.add(f"run-{name}", ids(tokenizer, f"Here: {spelling}, then more."))
    for name, (text, _) in BENIGN.items():
        scripted.add(f"ok-{name}", ids(tokenizer, text))
    requests = [*(f"run-{n}" for n in NAMES), *(f"ok-{n}" for n in BENIGN)]
    return run_plan(tmp, plan_dict(model_dir, blocklist, tmp / "prompts.jsonl", tmp), requests)


@pytest.mark.parametrize("case", NAMES)
def test_a_blocked_answer_is_withheld_on_every_channel_of_a_run(case, masked_run):
    result = masked_run.results[f"run-{case}"]
    shown = "".join(ch for ch in result["text"] if ch not in _CONTROLS)  # a mask inside an override keeps it
    assert shown == "Here: ***, then more." and result["tokens"] == [] and result["token_logprobs"] is None
    assert result["flagged"] == ["masked 1 blocklist match"]  # that something was withheld, not what
    assert masked_run.record(f"run-{case}")["redacted"] is True
    assert_withheld(case, masked_run.found, masked_run.everything)


# --- 2. the alternatives of a clean answer: top_logprobs, token_logprobs, generations.json, the report ------


@pytest.fixture(scope="module")
def alternatives_run(scripted, tokenizer, model_dir, blocklist, tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("alternatives")
    nice = ids(tokenizer, " nice.")
    for name, (_, spelling) in FAMILIES.items():
        before, completing = completing_split(tokenizer, spelling)
        lead = ids(tokenizer, "Here: ")
        scripted.add(f"alt-{name}", [*lead, *before, *nice], {len(lead) + len(before): [completing]})
    harmless = ids(tokenizer, "Here: ")
    scripted.add("alt-harmless", [*harmless, *nice], {len(harmless): ids(tokenizer, "x")})
    requests = [*(f"alt-{n}" for n in NAMES), "alt-harmless"]
    return run_plan(tmp, plan_dict(model_dir, blocklist, tmp / "prompts.jsonl", tmp), requests)


@pytest.mark.parametrize("case", NAMES)
def test_an_alternative_that_completes_a_blocked_word_is_withheld(case, alternatives_run, tokenizer):
    _, spelling = FAMILIES[case]
    before, completing = completing_split(tokenizer, spelling)
    result = alternatives_run.results[f"alt-{case}"]
    assert result["text"] == "Here: " + tokenizer.decode(before) + " nice."  # the answer itself is clean: kept
    assert result["flagged"] == ["1 alternative token withheld"] and result["tokens"]
    at = len(ids(tokenizer, "Here: ")) + len(before)  # the step whose alternative completes the word
    offered = [a["id"] for a in result["token_logprobs"][at]["top_logprobs"]]
    record = alternatives_run.record(f"alt-{case}")
    assert completing not in offered, (offered, completing, result["token_logprobs"][at])
    assert completing not in [alt[0] for alt in record["alternatives"][at]] and record["withheld_alternatives"] == 1
    assert_withheld(case, alternatives_run.found, alternatives_run.everything)


def test_harmless_alternatives_are_kept(alternatives_run, tokenizer):
    result = alternatives_run.results["alt-harmless"]
    assert result["flagged"] == [] and ids(tokenizer, "x")[0] in [
        a["id"] for step in result["token_logprobs"] for a in step["top_logprobs"]
    ]


@pytest.mark.parametrize("case", list(BENIGN))
def test_a_benign_twin_passes_whole_with_its_tokens(case, masked_run):
    text, entry = BENIGN[case]
    assert Matcher(load_blocklist(masked_run_blocklist(masked_run))).count(text) == 0
    assert Matcher([literal_entry(entry)]).count(text) == 0
    result = masked_run.results[f"ok-{case}"]
    assert result["text"] == text and result["flagged"] == [] and result["tokens"] and result["token_logprobs"]
    assert masked_run.record(f"ok-{case}").get("redacted") is None


def masked_run_blocklist(run: Run) -> Path:
    plan = yaml.safe_load((run.tmp / "plan.yaml").read_text(encoding="utf-8"))
    return Path(next(s for s in plan["stages"] if s["id"] == "filter")["with"]["blocklist"])


# --- 3. beam candidates ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def beam_run(scripted, tokenizer, model_dir, blocklist, tmp_path_factory) -> Iterator[Run]:
    from llmplan.llm.generation import Candidate, request_runner

    tmp = tmp_path_factory.mktemp("beams")
    beams = {
        name: [
            Candidate([*ids(tokenizer, "A fine day."), 2], -0.5, "eos"),
            Candidate([*ids(tokenizer, f"Here: {spelling}."), 2], -0.7, "eos"),
            Candidate([*ids(tokenizer, "Another day."), 2], -0.9, "eos"),
        ]
        for name, (_, spelling) in FAMILIES.items()
    }

    def scripted_beams(model: Any, cache: Any, prompt: list[int], **settings: Any) -> list[Any]:
        case = re.search(r"case beam-([\w-]+)", tokenizer.decode(prompt, skip_special_tokens=True))
        assert case is not None and settings["num_return_sequences"] == 3
        return beams[case.group(1)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(request_runner, "beam_search", scripted_beams)
        plan = plan_dict(model_dir, blocklist, tmp / "prompts.jsonl", tmp, num_beams=3, num_return_sequences=3)
        next(s for s in plan["stages"] if s["id"] == "generate")["with"]["logprobs"] = 0
        yield run_plan(tmp, plan, [f"beam-{n}" for n in NAMES])


@pytest.mark.parametrize("case", NAMES)
def test_a_beam_candidate_that_spells_a_blocked_word_is_withheld(case, beam_run):
    result = beam_run.results[f"beam-{case}"]
    assert [c["text"] for c in result["candidates"]] == ["A fine day.", "Here: ***.", "Another day."] or all(
        "***" in c["text"] or c["text"] in ("A fine day.", "Another day.") for c in result["candidates"]
    )
    assert all(c["tokens"] == [] for c in result["candidates"]) and result["tokens"] == []
    assert result["flagged"] == ["masked 1 blocklist match"]
    assert_withheld(case, beam_run.found, beam_run.everything)


# --- 4. the stream, piece by piece as generation delivers it ---------------------------------------------


def token_pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """The text as generation streams it: the real stream decoder's output, token by token."""
    from llmplan.llm.text.tokenizer import StreamDecoder

    decoder = StreamDecoder(tokenizer, skip_special_tokens=True)
    pieces = [decoder.push(token) for token in ids(tokenizer, text)]
    return [*pieces, decoder.flush()]


@pytest.mark.parametrize("action", ["mask", "reject"])
@pytest.mark.parametrize("case", NAMES)
def test_the_stream_never_shows_a_blocked_word(case, action, tokenizer, blocklist):
    from llmplan.llm.text import StreamGuard

    _, spelling = FAMILIES[case]
    shown: list[str] = []
    guard = StreamGuard(shown.append, Matcher(load_blocklist(blocklist)), action, "***")
    with time_bound(10):
        for piece in token_pieces(tokenizer, f"Here: {spelling}, then more."):
            guard(piece)
            assert_withheld(case, found_words("".join(shown)), "".join(shown))  # at no moment, not only at the end
        guard.end()
    text = "".join(shown)
    assert text.startswith("Here: ") and ("***" in text) == (action == "mask")
    assert_withheld(case, found_words(text), text)


# --- 5. served: chat and legacy completions, whole and streamed, with logprobs and top_logprobs ------------


@pytest.fixture(scope="module")
def served(scripted, tokenizer, model_dir, blocklist, tmp_path_factory) -> Iterator[Any]:
    from llmplan.commands.serve.app import ServerSettings
    from tests.commands.conftest import LiveServer

    tmp = tmp_path_factory.mktemp("served")
    for name, (_, spelling) in FAMILIES.items():
        scripted.add(f"srv-{name}", ids(tokenizer, f"Here: {spelling}, then more."))
        before, completing = completing_split(tokenizer, spelling)
        lead, nice = ids(tokenizer, "Here: "), ids(tokenizer, " nice.")
        scripted.add(f"srvalt-{name}", [*lead, *before, *nice], {len(lead) + len(before): [completing]})
    path = tmp / "served.yaml"
    path.write_text(yaml.safe_dump(plan_dict(model_dir, blocklist, None, tmp), allow_unicode=True, sort_keys=False))
    with LiveServer(path, ServerSettings(max_queue=8), run_dir=tmp / "run") as live:
        yield live


def post(live: Any, endpoint: str, body: dict[str, Any]) -> tuple[str, str]:
    """The response as a reader gets it: every string of the JSON body (or of each server-sent event); and,
    streamed, what a client shows (the deltas or texts joined)."""
    with time_bound(60):
        reply = httpx.post(f"{live.url}/{endpoint}", json={"model": "hostile-filter", **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    if not body.get("stream"):
        return "\n".join(strings_of(reply.json())), ""
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    assert events, reply.text
    choices = [c for event in events for c in event.get("choices", [])]
    shown = "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in choices)
    return "\n".join(s for event in events for s in strings_of(event)), shown


@pytest.mark.parametrize("case", NAMES)
def test_served_chat_masks_the_text_and_withholds_its_logprobs(case, served):
    body = {"messages": [{"role": "user", "content": f"case srv-{case}"}], "max_tokens": 96}
    reply, _ = post(served, "chat/completions", {**body, "logprobs": True, "top_logprobs": 5})
    assert "***" in reply
    assert_withheld(case, found_words(reply), reply)


@pytest.mark.parametrize("case", NAMES)
def test_served_streams_never_show_a_blocked_word(case, served):
    chat = {"messages": [{"role": "user", "content": f"case srv-{case}"}], "max_tokens": 96}
    legacy = {"prompt": f"case srv-{case}", "max_tokens": 96}
    for endpoint, body in (("chat/completions", chat), ("completions", legacy)):
        events, shown = post(served, endpoint, {**body, "stream": True})
        assert "***" in shown, shown
        assert_withheld(case, found_words(shown) | found_words(events), shown, events)


@pytest.mark.parametrize("case", NAMES)
def test_served_top_logprobs_withhold_an_alternative_that_completes_a_blocked_word(case, served, tokenizer):
    _, spelling = FAMILIES[case]
    before, completing = completing_split(tokenizer, spelling)
    prompt = {"prompt": f"case srvalt-{case}", "max_tokens": 96}
    with time_bound(60):
        reply = httpx.post(
            f"{served.url}/completions", json={"model": "hostile-filter", **prompt, "logprobs": 5}, timeout=60
        )
    legacy = reply.json()
    choice = legacy["choices"][0]
    assert choice["text"] == "Here: " + tokenizer.decode(before) + " nice."  # the answer is clean and kept
    at = len(ids(tokenizer, "Here: ")) + len(before)
    assert tokenizer.decode([completing]) not in choice["logprobs"]["top_logprobs"][at]
    chat = {"messages": [{"role": "user", "content": f"case srvalt-{case}"}], "max_tokens": 96}
    replies = [
        "\n".join(strings_of(legacy)),
        post(served, "chat/completions", {**chat, "logprobs": True, "top_logprobs": 5})[0],
    ]
    assert_withheld(case, set().union(*map(found_words, replies)), *replies)


# --- 6. the blocklist file, read bounded ------------------------------------------------------------------


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _huge(path: Path) -> Path:
    with path.open("wb") as f:
        f.truncate((4 << 20) + 1)  # sparse: one byte past the limit costs no disk
    return path


def _link_to_zero(path: Path) -> Path:
    path.symlink_to("/dev/zero")
    return path


BAD_BLOCKLISTS = {
    "dev-zero": lambda d: Path("/dev/zero"),
    "symlink-to-dev-zero": lambda d: _link_to_zero(d / "words.txt"),
    "fifo-without-writer": lambda d: _fifo(d / "words.fifo"),
    "directory": lambda d: (d / "words").mkdir() or d / "words",
    "over-4-MiB": lambda d: _huge(d / "words.txt"),
    "not-utf-8": lambda d: (d / "words.txt").write_bytes(b"ban\xffana\n") and d / "words.txt",
    "too-many-entries": lambda d: (
        (d / "words.txt").write_text("".join(f"w{i}\n" for i in range(20_001))) and d / "words.txt"
    ),
    "an-entry-of-5000-characters": lambda d: (d / "words.txt").write_text("x" * 5000 + "\n") and d / "words.txt",
    "missing": lambda d: d / "no-such-words.txt",
}


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("kind", list(BAD_BLOCKLISTS))
def test_a_hostile_blocklist_file_is_refused_naming_it(kind, command, model_dir, tmp_path, capsys):
    user = tmp_path / "user"
    user.mkdir()
    path = BAD_BLOCKLISTS[kind](user)
    plan = user / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_dict(model_dir, path, None, user), allow_unicode=True, sort_keys=False))
    before = snapshot(user)
    argv = (
        ["validate", "--deep", str(plan)] if command == "validate" else ["run", str(plan), "--out", str(tmp_path / "r")]
    )
    said = refused(argv, capsys, names=[str(path), "blocklist"], seconds=30, memory_mb=256)
    assert len([line for line in said.splitlines() if str(path) in line]) == 1, said  # one line names it
    assert_untouched(before, user)


def test_a_blocklist_llmplan_reads_is_accepted_by_validate(model_dir, blocklist, tmp_path, capsys):
    from llmplan.engine.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(
        yaml.safe_dump(plan_dict(model_dir, blocklist, None, tmp_path), allow_unicode=True, sort_keys=False)
    )
    with time_bound(30):
        assert main(["validate", "--deep", str(plan)]) == 0, capsys.readouterr()
