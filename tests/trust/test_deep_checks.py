"""Issue 11: `validate --deep` refuses what `run` refuses, and estimates what `place` reports."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmplan.engine.cli import deep_check
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover
from tests.llm.archs import FAMILIES
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


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_plan(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan over a tiny checkpoint of each family transformers made (tests/llm/archs.py), its cache small
    enough that the sliding layers' rings (window 16 + chunk 8 tokens) are smaller than the 64-token rows."""
    from tests.llm.archs import make_tiny
    from tests.stages.tiny_run import load_stages, make_tokenizer

    root = tmp_path_factory.mktemp(f"deep-{request.param}")
    vocab = make_tokenizer(root / "tok-probe")  # the model's vocabulary covers the tokenizer's
    model_dir, _ = make_tiny(root, request.param, vocab_size=vocab)
    make_tokenizer(model_dir)
    place = {"kv_cache": {"max_tokens": 64, "chunk": 8}, "max_batch": 2}
    plan = {
        "name": f"deep-{request.param}",
        "device": "cpu",
        "seed": 0,
        "threads": 1,
        "observe": {"memory_interval_ms": 0},
        "stages": [
            *load_stages(model_dir, place=place),
            {"id": "prompt", "uses": "compute.tokenize", "with": {"messages": [{"role": "user", "content": "Hi"}]}},
            {"id": "generate", "uses": "compute.generate", "with": {"max_new_tokens": 24, "ignore_eos": True}},
        ],
    }
    path = root / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False), encoding="utf-8")
    return path


def test_each_familys_estimate_is_what_it_allocates(family_plan: Path, tmp_path: Path) -> None:
    """`validate --deep` sizes weights, KV cache and work buffers per architecture (a sliding layer's window +
    chunk, Gemma's head_dim, biases and q/k norms, Gemma 3's local RoPE tables): each equals what `run`
    allocated, counted from the tensors themselves; and the plan generates through its rings."""
    found, estimate = deep_messages(family_plan)
    assert found == []
    result = run_plan(family_plan, tmp_path / "run")
    assert result.status == "ok", result.message
    regions = result.context.metrics.get("place", "regions")
    model, cache = result.context.model, result.context.kv_cache
    held = sum(k.nbytes + v.nbytes for k, v in cache.store.groups)
    real_cache = held + sum(t.nbytes for t in (cache.valid, cache.pos, cache.next_pos))
    assert estimate["kv_cache"] == regions["kv_cache"] == real_cache
    cfg = model.cfg
    full = 2 * 2 * cfg.n_kv_heads * cfg.head_dim * 4 * 64 * cfg.n_layers  # every layer's 64 slots, fp32
    assert (held < full) == any(cfg.layer_windows)  # the sliding layers keep 24 of 64
    assert estimate["work_buffers"] == regions["work_buffers"]
    assert regions["work_buffers"] == sum(b.nbytes for name, b in model.named_buffers() if name.startswith("rope_"))
    # fp32: every linear, norm and bias, once per storage (a tied head is the embedding table itself)
    model_bytes = sum({p.data_ptr(): p.nbytes for p in model.parameters()}.values())
    assert estimate["weights"] == regions["weights"] == model_bytes
