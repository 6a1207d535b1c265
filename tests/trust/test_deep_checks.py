"""Issue 11: `validate --deep` refuses what `run` refuses, and estimates what `place` reports."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmplan.engine.cli import deep_check
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover
from tests.pipeline.conftest import run_plan

from .checkpoints import make_checkpoint, plan_for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def deep_messages(plan: Path, overrides: list[str] | None = None) -> tuple[list[str], dict[str, int]]:
    findings, estimate = deep_check(load_plan(plan, discover(), overrides))
    return [str(f) for f in findings], estimate


def test_a_good_plan_passes(model_dir: Path, tmp_path: Path) -> None:
    found, estimate = deep_messages(plan_for(tmp_path, model_dir))
    assert found == [] and estimate["weights"] > 0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["convert.dtype=int4", "convert.group_size=48"], "stages[6].with.group_size: group_size 48 does not divide"),
        (["generate.num_beams=4"], "num_beams 4 (stage 'generate') needs 4 KV-cache rows; max_batch is 1"),
        (
            ["prompt.prompts_file=/nonexistent/prompts.jsonl", "prompt.messages=null"],
            "prompts_file: /nonexistent/prompts.jsonl: prompts file not found",
        ),
    ],
)
def test_deep_refuses_what_run_refuses(model_dir: Path, tmp_path: Path, overrides: list[str], expected: str) -> None:
    found, _ = deep_messages(plan_for(tmp_path, model_dir), overrides)
    assert any(expected in line for line in found), found


@pytest.mark.parametrize(
    ("attention", "expected"),
    [
        ({"heads": [0, 7]}, "heads [7] out of range: the model has 4 heads"),
        ({"layers": [0, 5]}, "layers [5] out of range: the model has 3 layers"),
    ],
)
def test_deep_refuses_attention_capture_out_of_range(model_dir: Path, tmp_path: Path, attention, expected) -> None:  # type: ignore[no-untyped-def]
    path = plan_for(tmp_path, model_dir)
    plan = yaml.safe_load(path.read_text())
    plan["observe"]["attention"] = attention
    path.write_text(yaml.safe_dump(plan))
    found, _ = deep_messages(path)
    assert any(expected in line for line in found), found


def test_work_buffer_estimate_is_what_place_reports(model_dir: Path, tmp_path: Path) -> None:
    plan = plan_for(tmp_path, model_dir)
    _, estimate = deep_messages(plan)
    result = run_plan(plan, tmp_path / "run", until="place")
    assert result.status == "ok", result.message
    reported = result.context.metrics.get("place", "regions")["work_buffers"]
    model = result.context.model
    real = sum(b.nbytes for name, b in model.named_buffers() if name.startswith("rope_"))
    assert estimate["work_buffers"] == reported == real
