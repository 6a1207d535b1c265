"""`load.draft` in a plan: another plan's model as the speculative draft, on a tiny random Llama.

The answer of a plan with `speculative: {method: draft}` equals the same plan's without it (greedy), with
guesses made and most accepted (the draft is the same weights in int8); a plan that asks for a draft and
has none, a draft plan that does not exist, names this plan back, places no model, or speaks another
vocabulary: one finding or one failure line naming it, before any answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from llmplan.engine.findings import PlanError
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover
from tests.pipeline.conftest import run_plan
from tests.stages.tiny_run import load_stages, make_tiny_model_dir, make_tokenizer, write_plan

DRAFTING = {"speculative": {"method": "draft", "tokens": 3}, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))[0]


def draft_plan(folder: Path, model_dir: Path, dtype: str = "int8", name: str = "draft") -> Path:
    stages = load_stages(model_dir)
    next(s for s in stages if s["id"] == "convert")["with"]["dtype"] = dtype
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "device": "cpu", "seed": 0, "threads": 1, "stages": stages}))
    return path


def with_draft(plan: Path, draft: str | None) -> Path:
    """The plan with a load.draft stage after its placement (None: without one)."""
    data: dict[str, Any] = yaml.safe_load(plan.read_text())
    if draft is not None:
        at = next(i for i, s in enumerate(data["stages"]) if s["uses"] == "load.to_device") + 1
        data["stages"].insert(at, {"id": "draft", "uses": "load.draft", "with": {"plan": draft}})
    plan.write_text(yaml.safe_dump(data, allow_unicode=True, sort_keys=False))
    return plan


def test_a_drafted_answer_equals_the_plain_one(tmp_path: Path, model_dir: Path) -> None:
    draft_plan(tmp_path, model_dir)
    plain = run_plan(write_plan(tmp_path, model_dir, name="plain", generate={"max_new_tokens": 24}), tmp_path / "a")
    plan = with_draft(write_plan(tmp_path, model_dir, name="drafted", generate=DRAFTING), "draft.yaml")
    data = yaml.safe_load(plan.read_text())
    plan.write_text(yaml.safe_dump({**data, "stages": [*data["stages"], {"id": "free", "uses": "output.release"}]}))
    drafted = run_plan(plan, tmp_path / "b")
    assert plain.status == drafted.status == "ok", drafted.message
    (want,), (got,) = plain.context.generations, drafted.context.generations
    assert got.tokens == want.tokens
    assert got.generation.guessed > 0 and got.generation.accepted / got.generation.guessed > 0.5
    assert drafted.context.metrics.get("draft", "draft")["bytes"] > 0
    assert "draft_model" in drafted.context.release_report["released"]  # the draft's memory is given back too


def test_validate_refuses_a_draft_that_cannot_be(tmp_path: Path, model_dir: Path) -> None:
    registry = discover()

    def finding(plan: Path) -> str:
        with pytest.raises(PlanError) as bad:
            load_plan(plan, registry)
        (only,) = bad.value.findings
        return f"{Path(only.file).name}:{only.line}: {only.message}"

    asks = with_draft(write_plan(tmp_path, model_dir, name="asks", generate=DRAFTING), None)
    assert "reads 'draft_model' but no stage in the plan writes it; add a stage that writes it (load.draft)" in finding(
        asks
    )
    missing = with_draft(write_plan(tmp_path, model_dir, name="missing", generate=DRAFTING), "nowhere.yaml")
    assert finding(missing).startswith("missing.yaml:") and "no plan file" in finding(missing)
    unplaced = tmp_path / "unplaced.yaml"
    unplaced.write_text(yaml.safe_dump({"name": "u", "stages": load_stages(model_dir)[:3]}))
    assert "has no load.to_device stage" in finding(
        with_draft(write_plan(tmp_path, model_dir, name="u2"), "unplaced.yaml")
    )
    loop = with_draft(write_plan(tmp_path, model_dir, name="loop", generate=DRAFTING), "loop.yaml")
    assert "a cycle" in finding(loop)


def test_a_draft_of_another_vocabulary_is_refused_at_load(tmp_path: Path, model_dir: Path) -> None:
    other = tmp_path / "other-model"
    import shutil

    shutil.copytree(model_dir, other)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (other / name).unlink()
    vocab = tmp_path / "other-vocab"
    make_tokenizer(vocab)
    tokenizer = (vocab / "tokenizer.json").read_text()
    # the same trained vocabulary with two of its tokens swapped: ids that no longer mean the same text
    import json

    data = json.loads(tokenizer)
    entries = data["model"]["vocab"]
    first, second = sorted(entries, key=entries.get)[100:102]
    entries[first], entries[second] = entries[second], entries[first]
    (other / "tokenizer.json").write_text(json.dumps(data))
    shutil.copy(vocab / "tokenizer_config.json", other / "tokenizer_config.json")
    draft_plan(tmp_path, other, dtype="fp32", name="stranger")
    plan = with_draft(write_plan(tmp_path, model_dir, name="mixed", generate=DRAFTING), "stranger.yaml")
    result = run_plan(plan, tmp_path / "run")
    assert result.status != "ok"
    assert "draft plan stranger.yaml: its vocabulary is not the model's (token 100 is" in result.message
    assert result.context.generations is None  # nothing answered


def test_a_draft_with_fewer_token_ids_is_refused_at_load_and_at_validate_deep(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmplan.engine.cli import main
    from tests.llm.tiny import make_tiny_llama

    vocab = make_tokenizer(tmp_path / "probe")
    small, _ = make_tiny_llama(tmp_path / "small", n_layers=2, vocab=vocab - 20)  # its embedding: 20 ids short
    make_tokenizer(small)  # the model's own tokenizer: same text for every id it has
    draft_plan(tmp_path, small, dtype="fp32", name="short")
    plan = with_draft(write_plan(tmp_path, model_dir, name="shorted", generate=DRAFTING), "short.yaml")
    result = run_plan(plan, tmp_path / "run")
    assert result.status != "ok" and result.context.generations is None
    assert "(load.draft): plan short.yaml: its model takes token ids below" in result.message
    assert f"below {vocab - 20}, the model's vocabulary holds {vocab}" in result.message
    assert main(["validate", "--deep", str(plan)]) != 0
    captured = capsys.readouterr()
    err = captured.out + captured.err
    line = next(n for n, text in enumerate(plan.read_text().splitlines(), 1) if "plan: short.yaml" in text)
    assert f"shorted.yaml:{line}:" in err and "draft plan short.yaml: its model takes token ids below" in err, err
    assert "Traceback" not in err
