from __future__ import annotations

import pytest

from llmplan.engine.findings import StageFailure
from llmplan.stages.output_filter import FilterParams, OutputFilter
from llmplan.stages.types import Candidate, Generation, Result


def _completion(text: str, **kw) -> Result:
    return Result("a", Generation(3, [1, 2, 3, 4], finish_reason="eos"), prompt="prompt", text=text, **kw)


@pytest.fixture
def blocklist(tmp_path):
    path = tmp_path / "block.txt"
    path.write_text("# words and patterns\n\nclass\n\nre:gr[ae]y\n坏\n", encoding="utf-8")
    return path


def _run(ctx, completions, path, action="mask"):
    ctx.completions = completions
    OutputFilter().run(ctx, FilterParams(blocklist=str(path), action=action))
    return completions


def test_mask(ctx, blocklist):
    c, clean = _completion("A Class of classic grey and GRAY things 这是坏的"), _completion("nothing here")
    _run(ctx, [c, clean], blocklist)
    assert c.text == "A *** of classic *** and *** things 这是***的"  # whole words only for ASCII entries
    assert c.flagged == ["masked 4 blocklist matches"]  # how many, never which entries
    assert c.error is None and (c.finish_reason, c.finish_detail) == ("content_filter", "eos")  # OpenAI's word
    assert clean.text == "nothing here" and clean.flagged == [] and clean.finish_reason == "stop"
    assert ctx.metrics.get("run", "flagged") == 1


def test_reject_keeps_finish_reason(ctx, blocklist):
    c = _completion("a grey day", candidates=[Candidate([1], -1.0, "eos")], candidate_texts=["grey"])
    _run(ctx, [c], blocklist, action="reject")
    assert c.text == "" and c.candidate_texts == [""]
    assert (
        c.error == "rejected by filter" and c.finish_detail == "eos" and c.flagged == ["rejected: 2 blocklist matches"]
    )
    assert c.finish_reason == "content_filter"  # what OpenAI says of an answer its filter withheld


def test_candidates_are_masked(ctx, blocklist):
    c = _completion("fine", candidates=[Candidate([1], -1.0, "eos")], candidate_texts=["a class act"])
    _run(ctx, [c], blocklist)
    assert c.text == "fine" and c.candidate_texts == ["a *** act"] and c.flagged == ["masked 1 blocklist match"]


def test_bad_regex_names_file_and_line(ctx, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("# comment\nok\nre:(unclosed\n", encoding="utf-8")
    with pytest.raises(StageFailure, match=rf"^{path}:3: bad regular expression '\(unclosed'"):
        _run(ctx, [_completion("x")], path)


def test_empty_matching_regex_and_missing_file(ctx, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("re:a*\n", encoding="utf-8")
    with pytest.raises(StageFailure, match=rf"{path}:1: .*matches the empty string"):
        _run(ctx, [_completion("x")], path)
    with pytest.raises(StageFailure, match="blocklist file not found"):
        _run(ctx, [_completion("x")], tmp_path / "nope.txt")
