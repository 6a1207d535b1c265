"""Issue 11, results cache: a replay only for the same computation, and a replay always says so."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from llmplan.engine.cli import main

from .checkpoints import make_checkpoint, plan_for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def cached_plan(tmp: Path, model_dir: Path, db: Path) -> Path:
    extra = [
        {"id": "lookup", "uses": "cache.lookup", "with": {"db": str(db), "mode": "reuse"}},
        {"id": "clean", "uses": "output.postprocess"},
        {"id": "text", "uses": "output.detokenize"},
        {"id": "write", "uses": "output.write", "with": {"to": ["stdout_json"]}},
        {"id": "store", "uses": "output.cache", "with": {"db": str(db)}},
    ]
    return plan_for(tmp, model_dir, hashes="if_present", extra=extra, max_new_tokens=6)


def run_json(plan: Path, out: Path, capsys: pytest.CaptureFixture[str], *sets: str) -> tuple[dict, str, dict]:  # type: ignore[type-arg]
    args = ["run", str(plan), "--json", "--quiet", "--out", str(out)]
    for item in sets:
        args += ["--set", item]
    code = main(args)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    stages = {s["id"]: s["status"] for s in json.loads((out / "stages.json").read_text())}
    metrics = json.loads((out / "metrics.json").read_text())
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err, {"stages": stages, "metrics": metrics}


def test_precision_and_other_upstream_params_are_in_the_key(model_dir: Path, tmp_path: Path, capsys) -> None:
    db = tmp_path / "results.sqlite"
    plan = cached_plan(tmp_path, model_dir, db)
    fresh, err, meta = run_json(plan, tmp_path / "r1", capsys)
    assert meta["stages"]["generate"] == "ok" and fresh["from_cache"] is False
    assert "replayed" not in err

    # Same plan, other precision / KV cache / device-side settings: must generate again.
    for n, change in enumerate(
        ["convert.dtype=bf16", "convert.dtype=fp16", "place.kv_cache.max_tokens=32", "verify.hashes=required"]
    ):
        other, err, meta = run_json(plan, tmp_path / f"o{n}", capsys, change)
        assert meta["stages"]["generate"] == "ok", change
        assert other["from_cache"] is False and "replayed" not in err, change

    # The very same computation again: replayed, and it says so everywhere.
    again, err, meta = run_json(plan, tmp_path / "r2", capsys)
    assert meta["stages"]["generate"] == "skipped" and meta["stages"]["convert"] == "skipped"
    assert again["from_cache"] is True and again["tokens"] == fresh["tokens"]
    assert "replayed from the results cache: 1 answer(s) from run 1 of" in err
    source = meta["metrics"]["lookup"]["replayed_from"]
    assert source["db"] == str(db) and source["results"][0]["run_id"] == 1
    assert meta["metrics"]["lookup"]["replayed"] is True
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT from_cache FROM results ORDER BY id DESC LIMIT 1").fetchall()
    assert rows == [(1,)]


def test_a_changed_model_file_is_a_miss(model_dir: Path, tmp_path: Path, capsys) -> None:
    import shutil

    local = Path(shutil.copytree(model_dir, tmp_path / "model"))
    db = tmp_path / "results.sqlite"
    plan = cached_plan(tmp_path, local, db)
    run_json(plan, tmp_path / "r1", capsys)
    # generation_config.json is not listed in SHA256SUMS: its stat identity (ctime) changes on any write.
    target = local / "generation_config.json"
    target.write_text(target.read_text(encoding="utf-8"), encoding="utf-8")
    _, err, meta = run_json(plan, tmp_path / "r2", capsys)
    assert meta["stages"]["generate"] == "ok" and "replayed" not in err


def test_rows_stored_under_the_old_key_format_are_not_replayed() -> None:
    from llmplan.stages.results.store import cache_key

    args = ("fp", [1, 2, 3], {"temperature": 0.7}, {}, 0)
    # How v1 built a key (generation params only): a row stored under it must never match any more.
    material = {
        "v": "llmplan.cache/v1",
        "model": "fp",
        "prompt": [1, 2, 3],
        "params": {"temperature": 0.7},
        "overrides": {},
        "seed": 0,
    }
    text = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    v1 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert cache_key(*args) != v1
    assert cache_key(*args, {"upstream": []}) not in (v1, cache_key(*args))
