from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from llmplan.engine.findings import StageFailure
from llmplan.stages import completion_rendering as output_format
from llmplan.stages import output_write
from llmplan.stages.completion_rendering import RESULT_KEYS, SCHEMA
from llmplan.stages.output_write import OutputWrite, WriteParams
from llmplan.stages.types import Candidate, Generation, ModelSource, Result

PLAN = """
name: write-test
stages:
  - {id: source, uses: fake.source, with: {tokenizer_dir: /nonexistent}}
  - {id: weights, uses: fake.weights}
  - {id: generate, uses: fake.generate}
  - {id: post, uses: output.postprocess}
  - {id: detok, uses: output.detokenize}
  - {id: write, uses: output.write}
"""


def _completion(rid: str = "r0", text: str = "Hello world.", **kw) -> Result:
    # 2 tokens decoded at 42.5 tokens/s; 3 prompt tokens prefilled in 0.01 s: 300 tokens/s
    gen = Generation(3, [5, 6, 2], [-0.25, -0.5, -1.0], finish_reason="eos", prefill_s=0.01, ttft_s=0.125)
    gen.decode_s = 2 / 42.5
    return Result(rid, gen, timed_as="phases", batch_prompt=3, prompt="Say hello", text=text, **kw)


def _beam() -> Result:
    return _completion(
        "beam",
        "The sky is blue.",
        candidates=[Candidate([1, 2], -1.5, "eos"), Candidate([1, 3], float("-inf"), "length")],
        candidate_texts=["The sky is blue.", "The sky."],
    )


def _write(ctx, completions, **params):
    ctx.completions = completions
    OutputWrite().run(ctx, WriteParams(**params))
    return ctx.deliveries


def test_terminal_text_and_summary(ctx, capsys):
    assert _write(ctx, [_completion()]) == ["terminal"]
    out, err = capsys.readouterr()
    assert out == "Hello world.\n"
    assert (
        err.strip()
        == "3 prompt + 3 generated tokens · finish stop (eos) · TTFT 0.125 s · 300.0 tok/s prefill · 42.5 tok/s decode"
    )


def test_terminal_shows_every_beam_candidate_with_its_score(ctx, capsys):
    beam = _beam()
    beam.candidate_texts = ["The sky is blue.", "The sky.\nIt is."]
    assert _write(ctx, [beam]) == ["terminal"]
    out, _ = capsys.readouterr()
    assert out.splitlines() == [
        "1. (score -1.5000 · finish stop (eos)) The sky is blue.",
        "2. (score -inf · finish length) The sky.",
        "   It is.",
    ]


def test_streamed_text_is_not_printed_twice(ctx, capsys):
    _write(ctx, [_completion(streamed=True)])
    out, err = capsys.readouterr()
    assert out == "\n" and "Hello world." not in out and "42.5 tok/s" in err


def test_json_mode_prints_only_json_lines(ctx, make_plan, capsys):
    ctx.plan = make_plan(PLAN)
    ctx.json_mode = True
    ctx.model_source = ModelSource(ctx.run_dir or os.getcwd(), "hf-dir", "fp-abc")
    ctx.metrics.by_stage = {"source": {"wall_s": 1.5}, "weights": {"wall_s": 2.0}, "generate": {"wall_s": 9.0}}
    _write(ctx, [_completion("r0", "line one\nline two"), _beam()], to=["terminal", "stdout_json"])
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert len(lines) == 2 and out.endswith("\n")
    first, beam = (json.loads(line) for line in lines)
    assert tuple(first) == RESULT_KEYS
    assert first["schema"] == SCHEMA and first["id"] == "r0" and first["text"] == "line one\nline two"
    assert first["plan"] == "write-test" and first["model"] == "fp-abc"
    assert first["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert first["timings"] == {
        "load_s": 3.5,
        "queue_s": 0.0,
        "prefill_s": 0.01,
        "ttft_s": 0.125,
        "decode_s": 2 / 42.5,
        "prefill_tokens_per_s": 300.0,
        "decode_tokens_per_s": 42.5,
        "batch": 1.0,
    }
    assert first["tokens"] == [5, 6, 2] and first["logprobs"] == [-0.25, -0.5, -1.0] and first["candidates"] == []
    assert [c["score"] for c in beam["candidates"]] == [-1.5, None]  # -inf is not JSON: null
    assert beam["candidates"][0] == {
        "text": "The sky is blue.",
        "tokens": [1, 2],
        "score": -1.5,
        "finish_reason": "stop",
        "finish_detail": "eos",
    }


def test_relative_files_go_under_the_data_home(ctx, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path / "..")  # where the user stands does not matter
    deliveries = _write(
        ctx,
        [_completion(), _beam()],
        to=[{"json": "out/results.json"}, {"text": "out/answer.txt"}, {"markdown": str(tmp_path / "report.md")}],
    )
    home = tmp_path  # LLMPLAN_HOME, set by tests/conftest.py
    assert deliveries == [f"json:{home / 'out/results.json'}", f"text:{home / 'out/answer.txt'}", f"markdown:{tmp_path / 'report.md'}"]
    # no terminal sink: nothing on stdout; each file says where it went (#57: a shared path is replaced by every run)
    assert capsys.readouterr() == ("", "".join(f"wrote {d.split(':', 1)[1]} ({d.split(':')[0]}, new)\n" for d in deliveries))
    document = json.loads((tmp_path / "out/results.json").read_text(encoding="utf-8"))
    assert document["schema"] == SCHEMA and [r["id"] for r in document["results"]] == ["r0", "beam"]
    assert [c["score"] for c in document["results"][1]["candidates"]] == [-1.5, None]
    text = (tmp_path / "out/answer.txt").read_text(encoding="utf-8")
    assert text == "[r0]\nHello world.\n\n[beam]\nThe sky is blue.\n"
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "## beam" in markdown and "> Say hello" in markdown and "(score -1.5000) The sky is blue." in markdown
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_terminal_markdown_and_json_formats(ctx, capsys):
    _write(ctx, [_completion()], format="markdown")
    out, _ = capsys.readouterr()
    assert out.startswith("# Results") and "Hello world." in out
    _write(ctx, [_completion()], format="json")
    out, _ = capsys.readouterr()
    assert json.loads(out)["text"] == "Hello world."


@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_write_leaves_no_partial_file(ctx, tmp_path, monkeypatch, existing):
    target = tmp_path / "results.json"
    old = json.dumps({"schema": SCHEMA, "results": [], "old": True}) + "\n"  # an earlier run's output
    if existing:  # written by llmplan (with its marker): since #33 a hand-written look-alike would be refused
        output_write.atomic_write(target, iter([old]), "json")
    real = output_format.json_document_chunks

    def broken(*args, **kwargs):
        chunks = real(*args, **kwargs)
        for _ in range(5):
            yield next(chunks)
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the file

    monkeypatch.setattr(output_format, "json_document_chunks", broken)
    with pytest.raises(KeyboardInterrupt):
        _write(ctx, [_completion()], to=[{"json": str(target)}])
    if existing:
        assert target.read_text(encoding="utf-8") == old
    else:
        assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ([".results.json.llmplan", "results.json"] if existing else [])


def test_unwritable_target_is_one_line(ctx, tmp_path):
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(StageFailure, match="is a directory"):
        _write(ctx, [_completion()], to=[{"json": str(tmp_path / "dir.json")}])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StageFailure, match="cannot write"):
        output_write.atomic_write(blocker / "sub" / "out.txt", iter(["x"]))


@pytest.mark.parametrize("bad", [[{"yaml": "x.yaml"}], [{"json": "a", "text": "b"}], ["printer"], [], [{"json": ""}]])
def test_bad_sinks_are_refused(bad):
    with pytest.raises(ValidationError):
        WriteParams(to=bad)
