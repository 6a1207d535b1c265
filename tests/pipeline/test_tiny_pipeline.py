"""The whole plan on tiny random Llama checkpoints (written by transformers): precisions, integrity, cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from llmplan.engine.cli import main
from llmplan.llm.trust.manifest import write_sha256sums
from tests.stages.tiny_run import write_plan

from .conftest import run_plan

# Relative logit error ||ours - hf|| / ||hf||. fp32 is the same math (summation order only, ~1e-7);
# bf16 keeps 8 mantissa bits (~4e-3 per rounding), compounding over layers. Quantized precisions are
# checked on the real model (test_smollm2_precisions.py): a random tiny model amplifies weight error
# far more than a trained one, so its numbers would say little.
BOUNDS = {"fp32": 1e-5, "bf16": 3e-2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.llm.tiny import make_tiny_llama
    from tests.stages.tiny_run import make_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    vocab = make_tokenizer(root / "probe")
    model_dir, hf = make_tiny_llama(
        root, n_layers=3, vocab=vocab, hidden=64, heads=4, kv_heads=2, max_shard_size="60KB"
    )
    make_tokenizer(model_dir)
    assert len(list(model_dir.glob("*.safetensors"))) > 2, "several shards"
    # Every file the load reads: with a SHA256SUMS, one it leaves out is refused.
    read = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"]
    write_sha256sums(model_dir, [*(p.name for p in model_dir.glob("*.safetensors")), *read])
    return model_dir, hf.eval()


def edit_plan(path: Path, **changes: dict) -> Path:  # type: ignore[type-arg]
    plan = yaml.safe_load(path.read_text(encoding="utf-8"))
    for stage in plan["stages"]:
        stage.setdefault("with", {}).update(changes.get(stage["id"], {}))
    path.write_text(yaml.safe_dump(plan, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_loaded_model_matches_transformers_logits(dtype: str, tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model_dir, hf = tiny
    plan = write_plan(tmp_path, model_dir, name=f"tiny-{dtype}")
    result = run_plan(plan, tmp_path / "run", [f"convert.dtype={dtype}"], until="place")
    assert result.exit_code == 0, result.message
    model = result.context.model
    tokens = torch.randint(3, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24).expand(2, 24)
    with torch.inference_mode():
        ours = model(tokens, positions).float()
        reference = hf(tokens).logits.float()
    error = float((ours - reference).norm() / reference.norm())
    assert error < BOUNDS[dtype], f"{dtype}: relative logit error {error:.2e}"
    read = result.context.metrics.by_stage["convert"]  # reading happens in the stage that drains the stream
    assert read["peak_buffer_shards"] == 1 and read["bytes_read"] > 2 * read["peak_buffer_bytes"]


def test_quantized_conversion_reports_bytes_and_error(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plan = write_plan(tmp_path, tiny[0])
    for dtype, ratio, worst in (("int8", 3.5, 0.02), ("int4", 5.0, 0.15)):
        result = run_plan(plan, tmp_path / dtype, [f"convert.dtype={dtype}"], until="convert")
        quant = result.context.metrics.by_stage["convert"]
        assert 0 < quant["quant_error_max"] < worst
        assert quant["bytes_after"] < quant["bytes_before"] / ratio * 1.6  # embeddings and norms stay fp32


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing", "missing shard"),
        ("truncated", "truncated"),
        ("flipped", "SHA-256 mismatch"),
    ],
)
def test_damaged_checkpoint_stops_before_any_tensor_is_read(
    damage: str, message: str, tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny[0], model_dir)
    shard = sorted(model_dir.glob("*.safetensors"))[-1]
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    plan = edit_plan(write_plan(tmp_path, model_dir), verify={"hashes": "required"})
    code = main(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith("error: stage 'verify' (load.verify): ")
    assert str(shard) in err[0] and message in err[0]
    statuses = {s["id"]: s["status"] for s in json.loads((tmp_path / "run" / "stages.json").read_text())}
    assert statuses["verify"] == "failed" and statuses["read"] == statuses["convert"] == "not_run"


def test_second_identical_run_is_served_from_the_cache_without_reading_a_shard(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plan_path = write_plan(tmp_path, tiny[0], generate={"temperature": 0.8, "top_k": 20})
    plan = yaml.safe_load(plan_path.read_text(encoding="utf-8"))
    db = str(tmp_path / "results.sqlite")
    plan["stages"] += [
        {"id": "lookup", "uses": "cache.lookup", "with": {"db": db, "mode": "reuse"}},
        {"id": "clean", "uses": "output.postprocess"},
        {"id": "text", "uses": "output.detokenize"},
        {"id": "write", "uses": "output.write", "with": {"to": [{"json": str(tmp_path / "out.json")}]}},
        {"id": "store", "uses": "output.cache", "with": {"db": db}},
        {"id": "release", "uses": "output.release"},
    ]
    plan_path.write_text(yaml.safe_dump(plan, allow_unicode=True), encoding="utf-8")
    first = run_plan(plan_path, tmp_path / "first")
    first_text = json.loads((tmp_path / "out.json").read_text())
    second = run_plan(plan_path, tmp_path / "second")
    assert first.exit_code == second.exit_code == 0
    statuses = {r.id: r.status for r in second.records}
    for stage in ("verify", "read", "convert", "place", "generate"):
        assert statuses[stage] == "skipped", statuses
    assert "bytes_read" not in second.context.metrics.by_stage.get("convert", {})
    again = json.loads((tmp_path / "out.json").read_text())
    assert [r["text"] for r in again["results"]] == [r["text"] for r in first_text["results"]]
    assert [r["from_cache"] for r in again["results"]] == [True]


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_converted_checkpoint_is_saved_verified_and_loaded_without_converting(tiny, tmp_path: Path, dtype: str) -> None:  # type: ignore[no-untyped-def]
    model_dir, _ = tiny
    saved = tmp_path / f"tiny-{dtype}"
    plan = write_plan(tmp_path, model_dir)
    first = run_plan(plan, tmp_path / "first", [f"convert.dtype={dtype}", f"convert.save_to={saved}"], until="place")
    assert first.exit_code == 0, first.message
    assert (saved / "SHA256SUMS").is_file() and (saved / "tokenizer.json").is_file()
    source_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    assert sum(p.stat().st_size for p in saved.glob("*.safetensors")) < source_bytes / 2

    (tmp_path / "again").mkdir()
    again = edit_plan(write_plan(tmp_path / "again", saved), verify={"hashes": "required"})
    second = run_plan(again, tmp_path / "second", [f"convert.dtype={dtype}"], until="place")
    assert second.exit_code == 0, second.message
    assert second.context.metrics.by_stage["convert"]["preconverted"] is True
    tokens = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16)[None]
    with torch.inference_mode():
        torch.testing.assert_close(second.context.model(tokens, positions), first.context.model(tokens, positions))

    wrong = run_plan(again, tmp_path / "wrong", ["convert.dtype=fp32"], until="place")
    assert wrong.exit_code == 1 and f"the checkpoint was converted to {dtype}" in wrong.message
