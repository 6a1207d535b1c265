"""The output filter as a guard: normalized matching (32 spellings), the streaming matcher, its place
in the graph (before every sink, whatever the YAML order), and nothing of a flagged answer kept."""

from __future__ import annotations

import json
import random
import sqlite3
from typing import Any

import pytest

from llmplan.engine.findings import PlanError
from llmplan.engine.graph import build_graph, execution_order
from llmplan.engine.runner import Runner
from llmplan.engine.stage import Params, Phase, Stage
from llmplan.llm.text import Matcher, StreamGuard, normalize
from llmplan.stages.output_filter import MASK, apply_filter, load_blocklist
from llmplan.stages.slots import InferenceContext
from llmplan.stages.types import Candidate, Generation, Result

BLOCKED = ["secret", "straße", "launch code"]

# 32 ways to write a blocked entry; each must be flagged and masked whole.
SPELLINGS = [
    "secret",
    "SECRET",
    "Secret",
    "ｓｅｃｒｅｔ",  # fullwidth
    "ＳＥＣＲＥＴ",  # fullwidth capitals
    "se\u200bcret",  # zero-width space
    "sec\u00adret",  # soft hyphen
    "s\u200decret",  # zero-width joiner
    "secr\u200cet",  # zero-width non-joiner
    "se\u2060cret",  # word joiner
    "sec\ufeffret",  # BOM inside a word
    "sec\u200eret",  # left-to-right mark
    "s\ufe0fecret",  # variation selector
    "𝐬𝐞𝐜𝐫𝐞𝐭",  # mathematical bold
    "𝑠𝑒𝑐𝑟𝑒𝑡",  # mathematical italic
    "𝘀𝗲𝗰𝗿𝗲𝘁",  # mathematical sans-serif bold
    "𝚜𝚎𝚌𝚛𝚎𝚝",  # mathematical monospace
    "ⓢⓔⓒⓡⓔⓣ",  # circled letters
    "ѕесrеt",  # Cyrillic dze, ie, es
    "ЅЕСRЕТ",  # Cyrillic capitals
    "sεcrεt",  # Greek epsilon
    "straße",
    "STRASSE",  # case folding: ß is ss
    "Strasse",
    "STRAẞE",  # capital sharp s
    "ſtraße",  # long s
    "launch code",
    "launch\u00a0code",  # no-break space
    "launch \t\n code",  # a run of whitespace
    "LAUNCH\u2003CODE",  # em space
    "launch\u202fcοde",  # narrow no-break space, Greek omicron
    "ｌａｕｎｃｈ\u3000ｃｏｄｅ",  # fullwidth with an ideographic space
]


@pytest.fixture
def blocklist(tmp_path):
    path = tmp_path / "block.txt"
    path.write_text("\n".join(BLOCKED) + "\n", encoding="utf-8")
    return path


def test_there_are_32_distinct_spellings():
    assert len(SPELLINGS) == 32 == len(set(SPELLINGS))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_spelling_is_masked_whole(blocklist, spelling):
    matcher = Matcher(load_blocklist(blocklist))
    text = f"Before {spelling}, after."
    assert matcher.count(text) == 1, spelling
    assert matcher.mask(text, MASK) == f"Before {MASK}, after."


@pytest.mark.parametrize("text", ["secretary", "secrets", "a straßenbahn", "launch codes", "launcher code"])
def test_whole_words_only(blocklist, text):
    assert Matcher(load_blocklist(blocklist)).count(text) == 0


def test_normalization_covers_the_documented_classes():
    assert normalize("ＡＢＣ") == normalize("𝐀𝐁𝐂") == normalize("АВС") == "abc"  # fullwidth, bold, Cyrillic
    assert normalize("a\u00a0\u2003 b") == "a b" and normalize("x\u00ady\u200b") == "xy"
    assert normalize("STRASSE") == normalize("straße")


def _stream(matcher: Matcher, pieces: list[str], action: str = "mask") -> tuple[str, list[str]]:
    out: list[str] = []
    guard = StreamGuard(out.append, matcher, action, MASK)
    for piece in pieces:
        guard(piece)
    guard.end()
    return "".join(out), out


def _split(text: str, rng: random.Random) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, 4)
        pieces.append(text[at : at + step])
        at += step
    return pieces


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_stream_is_masked_like_the_file(blocklist, spelling):
    matcher = Matcher(load_blocklist(blocklist))
    text = f"It is {spelling} and more {spelling}. End."
    rng = random.Random(len(spelling))
    for pieces in (list(text), _split(text, rng), [text]):
        shown, _ = _stream(matcher, pieces)
        assert shown == matcher.mask(text, MASK)


def test_stream_holds_back_only_what_an_entry_could_still_match(blocklist):
    matcher = Matcher(load_blocklist(blocklist))
    assert matcher.hold == len("launch code") + 1
    out: list[str] = []
    guard = StreamGuard(out.append, matcher, "mask", MASK)
    text = "A long answer with nothing to hide in it at all, just words and more words."
    for i, ch in enumerate(text, start=1):
        guard(ch)
        assert len("".join(out)) >= i - matcher.hold  # text flows, only the tail waits
    guard("secr")
    shown = "".join(out)
    guard.end()
    assert "".join(out) == text + "secr" and len(shown) < len(text) + 4


def test_stream_reject_stops_at_the_match(blocklist):
    matcher = Matcher(load_blocklist(blocklist))
    shown, _ = _stream(matcher, list("Fine so far. The ЅЕСRЕТ is out, and more text follows."), "reject")
    assert shown == "Fine so far. The "


def test_unbounded_regex_holds_the_stream_until_the_end(tmp_path):
    path = tmp_path / "b.txt"
    path.write_text("re:bad.*word\n", encoding="utf-8")
    matcher = Matcher(load_blocklist(path))
    out: list[str] = []
    guard = StreamGuard(out.append, matcher, "mask", MASK)
    for ch in "a bad long word":
        guard(ch)
    assert out == []
    guard.end()
    assert "".join(out) == f"a {MASK}"


def test_flagged_completion_keeps_no_token_data(blocklist):
    matcher = Matcher(load_blocklist(blocklist))
    for action in ("mask", "reject"):
        generated = Generation(3, [1, 2, 3, 4], [-1.0] * 4, finish_reason="eos")
        c = Result("a", generated, prompt="p", text="the ѕесrеt")
        c.token_logprobs = [{"token": "x", "id": 1, "logprob": -1.0, "top_logprobs": []}]
        c.candidates, c.candidate_texts = [Candidate([1, 2], -1.0, "eos")], ["the secret"]
        assert apply_filter(c, matcher, action)
        assert c.tokens == [] and c.logprobs == [] and c.token_logprobs is None
        assert c.candidates[0].tokens == [] and c.completion_tokens == 4  # usage still counts what was generated
        assert c.text == ("the ***" if action == "mask" else "")


# --- in the engine --------------------------------------------------------------------------------


class StreamGenParams(Params):
    answer: str


class StreamingGenerate(Stage):
    """Streams its answer piece by piece through ctx.stream, as compute.generate does."""

    name = "fake.streaming_generate"
    phase = Phase.COMPUTE
    Params = StreamGenParams
    reads = ("requests", "weights", "tokenizer")
    writes = ("generations",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        from llmplan.stages.observe import finish_observing
        from llmplan.stages.types import Result

        assert ctx.tokenizer is not None and ctx.requests is not None
        ids = ctx.tokenizer.encode(params.answer)
        for i in range(len(ids)):  # the decoded delta of each token, like StreamDecoder
            ctx.stream(ctx.tokenizer.decode(ids[: i + 1])[len(ctx.tokenizer.decode(ids[:i])) :])
        ctx.stream("\n")
        ctx.generations = [
            Result(
                r.id, Generation(len(r.prompt_ids), list(ids), [-0.5] * len(ids), finish_reason="length"), streamed=True
            )
            for r in ctx.requests
        ]
        finish_observing(ctx, ctx.generations)


def _plan(tokenizer_dir, tmp_path, blocklist, action: str, *, filter_after_sinks: bool = False) -> str:
    filt = f"  - {{id: filter, uses: output.filter, with: {{blocklist: {json.dumps(str(blocklist))}, action: {action}}}}}\n"
    sinks = json.dumps(["terminal", {"json": str(tmp_path / "out.json")}])
    body = f"""name: guard
stages:
  - {{id: source, uses: fake.source, with: {{tokenizer_dir: {json.dumps(str(tokenizer_dir))}}}}}
  - {{id: weights, uses: fake.weights}}
  - {{id: generate, uses: fake.streaming_generate, with: {{answer: "The sky. The secret is blue."}}}}
  - {{id: post, uses: output.postprocess}}
  - {{id: detok, uses: output.detokenize}}
"""
    if not filter_after_sinks:
        body += filt
    body += f"""  - {{id: write, uses: output.write, with: {{to: {sinks}}}}}
  - {{id: store, uses: output.cache, with: {{db: {json.dumps(str(tmp_path / "r.sqlite"))}}}}}
"""
    return body + (filt if filter_after_sinks else "")


@pytest.fixture
def guard_registry(registry):
    registry.add(StreamingGenerate)
    return registry


def test_filter_runs_before_every_sink_whatever_the_order(
    make_plan, guard_registry, tokenizer_dir, tmp_path, blocklist
):
    bound = make_plan(_plan(tokenizer_dir, tmp_path, blocklist, "mask", filter_after_sinks=True))
    order = execution_order(build_graph(bound.stages))
    assert order.index("filter") < order.index("write") and order.index("filter") < order.index("store")
    with pytest.raises(PlanError, match="cycle between stages"):
        make_plan(_plan(tokenizer_dir, tmp_path, blocklist, "mask").replace("mask}}", "mask}, after: [write]}"))


@pytest.mark.parametrize("action", ["mask", "reject"])
@pytest.mark.parametrize("listed_last", [False, True])
def test_nothing_blocked_reaches_any_sink(
    make_plan, guard_registry, tokenizer_dir, tmp_path, blocklist, capsys, action, listed_last
):
    from llmplan.engine.cli import _stdout_stream

    ctx = InferenceContext()
    ctx.stream = _stdout_stream
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    bound = make_plan(_plan(tokenizer_dir, tmp_path, blocklist, action, filter_after_sinks=listed_last))
    result = Runner(bound, ctx, run_dir).run()
    assert result.status == "ok", result.message
    out = capsys.readouterr().out
    assert "secret" not in out and out.startswith("The sky. The ")
    assert (MASK in out) == (action == "mask") and ("rejected by filter" in out) == (action == "reject")
    document = json.loads((tmp_path / "out.json").read_text(encoding="utf-8"))
    result_obj = document["results"][0]
    assert (
        result_obj["tokens"] == []
        and result_obj["logprobs"] is None
        and result_obj["flagged"] == ["masked 1 blocklist match" if action == "mask" else "rejected: 1 blocklist match"]
    )
    assert "secret" not in result_obj["text"]
    with sqlite3.connect(tmp_path / "r.sqlite") as db:
        rows = db.execute("SELECT * FROM results").fetchall()
    assert rows and all("secret" not in json.dumps(row, default=str) for row in rows)
    generations = (run_dir / "generations.json").read_text(encoding="utf-8")
    record = json.loads(generations)[0]
    assert record["tokens"] == [] and record["pieces"] == [] and record["logprobs"] == [] and record["redacted"]
    assert "secret" not in generations
