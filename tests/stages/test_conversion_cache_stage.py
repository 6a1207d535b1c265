"""load.convert with the conversion cache: the first start converts and keeps, the second maps (reading no shard)
and answers token for token the same; a damaged entry is refused and rebuilt; `cache: false` and a cache that
cannot be written convert in memory, saying so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmplan.engine.cli import main
from tests.stages.tiny_run import make_tiny_model_dir, write_plan


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), n_layers=2)[0]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMPLAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LLMPLAN_CONVERSION_CACHE")  # the default place: $LLMPLAN_CACHE/conversions
    return tmp_path / "cache"


def int8_plan(tmp_path: Path, model_dir: Path, **convert: Any) -> Path:
    """The tiny plan, its folder trusted on first use (so its shards have SHA-256 to key by), int8 weights."""
    path = write_plan(tmp_path, model_dir)
    plan = yaml.safe_load(path.read_text(encoding="utf-8"))
    for stage in plan["stages"]:
        if stage["id"] == "model":
            stage["with"]["trust_on_first_use"] = True
        if stage["id"] == "verify":
            stage["with"] = {"hashes": "required"}
        if stage["id"] == "convert":
            stage["with"] = {"dtype": "int8", **convert}
    plan["stages"].append({"id": "release", "uses": "output.release"})
    path.write_text(yaml.safe_dump(plan, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def start(plan: Path, out: Path) -> tuple[dict[str, Any], list[int]]:
    """One run: (load.convert's metrics, the greedy tokens)."""
    assert main(["run", str(plan), "--out", str(out), "--quiet"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    tokens = json.loads((out / "generations.json").read_text())[0]["tokens"]
    return metrics["convert"], tokens


def test_the_second_start_maps_the_conversion_and_reads_no_shard(
    tiny: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = int8_plan(tmp_path, tiny)
    first, tokens = start(plan, tmp_path / "first")
    assert first["weights_road"] == "cached" and first["bytes_read"] > 0
    assert "converted in" in capsys.readouterr().err
    entry = Path(first["conversion_entry"])
    assert entry.parent == cache / "conversions" and entry.is_dir()

    from llmplan.stages import load_shard_stream

    def no_reads(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a source shard was read on a start the cache should have served")

    monkeypatch.setattr(load_shard_stream, "read_shards", no_reads)
    second, again = start(plan, tmp_path / "second")
    assert second["weights_road"] == "cache-mapped" and "bytes_read" not in second
    assert second["conversion_entry"] == str(entry) and second["entry_bytes"] == first["entry_bytes"]
    assert second["quant_error_max"] == pytest.approx(first["quant_error_max"])  # as measured when converted
    assert again == tokens
    assert "mapped from the conversion cache" in capsys.readouterr().err


def test_a_damaged_entry_is_refused_and_rebuilt(
    tiny: Path, tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = int8_plan(tmp_path, tiny)
    first, tokens = start(plan, tmp_path / "first")
    shard = next(Path(first["conversion_entry"]).glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    second, again = start(plan, tmp_path / "second")
    err = capsys.readouterr().err
    refused = [line for line in err.splitlines() if "refused" in line]
    assert len(refused) == 1 and shard.name in refused[0] and "converting again" in refused[0]
    assert second["weights_road"] == "cached" and again == tokens
    third, _ = start(plan, tmp_path / "third")
    assert third["weights_road"] == "cache-mapped"


def test_cache_false_converts_in_memory_and_keeps_nothing(
    tiny: Path, tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics, _ = start(int8_plan(tmp_path, tiny, cache=False), tmp_path / "run")
    assert metrics["weights_road"] == "memory" and "cache: false" in metrics["weights_road_why"]
    assert "converted in memory, not cached" in capsys.readouterr().err
    assert not (cache / "conversions").exists()


def test_a_cache_that_cannot_be_written_converts_in_memory_and_says_why(
    tiny: Path, tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "conversions").write_text("not a folder")
    metrics, tokens = start(int8_plan(tmp_path, tiny), tmp_path / "run")
    assert metrics["weights_road"] == "memory" and "conversions" in metrics["weights_road_why"]
    err = capsys.readouterr().err
    assert "converted in memory, not cached: the conversion cache cannot keep it" in err
    assert tokens


def test_unverified_shards_are_not_cached(tiny: Path, tmp_path: Path, cache: Path) -> None:
    plan = write_plan(tmp_path, tiny)  # hashes off: nothing to key an entry by
    data = yaml.safe_load(plan.read_text(encoding="utf-8"))
    data["stages"][6]["with"] = {"dtype": "int8"}
    plan.write_text(yaml.safe_dump(data), encoding="utf-8")
    metrics, _ = start(plan, tmp_path / "run")
    assert metrics["weights_road"] == "memory" and "SHA-256" in metrics["weights_road_why"]


def test_models_lists_the_entry_and_rm_makes_the_next_start_convert_again(
    tiny: Path, tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = int8_plan(tmp_path, tiny)
    first, _ = start(plan, tmp_path / "first")
    entry = Path(first["conversion_entry"])
    capsys.readouterr()
    assert main(["models", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (row,) = [r for r in rows if r.get("kind") == "conversion"]
    assert (row["name"], row["dtype"], row["model"]) == (entry.name, "int8", tiny.name)
    assert row["bytes"] == sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
    assert main(["models", "rm", entry.name]) == 0
    assert not entry.exists() and "converts again" in capsys.readouterr().out
    second, _ = start(plan, tmp_path / "second")
    assert second["weights_road"] == "cached"


def test_validate_deep_predicts_the_road_the_disk_and_the_file_backed_bytes(
    tiny: Path, tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = int8_plan(tmp_path, tiny)

    def predicted() -> dict[str, Any]:
        capsys.readouterr()
        assert main(["validate", "--deep", "--format", "json", str(plan)]) == 0
        return json.loads(capsys.readouterr().out)["memory"][str(plan)]

    before = predicted()  # nothing cached yet: it will convert, write the entry, then map it
    assert before["peaks"]["converting"] > 0 and before["disk"]["a conversion cache entry"] > 0
    assert before["file_backed"]["weights"] == before["regions"]["weights"]
    first, _ = start(plan, tmp_path / "first")
    written = first["entry_bytes"]
    assert before["disk"]["a conversion cache entry"] == written  # the fp32 embedding and norms stay in the source
    assert first["in_place_bytes"] > 0 and written + first["in_place_bytes"] == before["regions"]["weights"]
    after = predicted()  # the entry is there: mapped, no conversion, nothing written
    assert after["disk"] == {} and "converting" not in after["peaks"]
    assert after["file_backed"]["weights"] == written + first["in_place_bytes"]
    assert after["anonymous_bytes"] == after["steady_bytes"] - after["file_backed"]["weights"]


def test_the_report_draws_the_road_and_the_split_and_release_gives_the_mapped_pages_back(
    tiny: Path, tmp_path: Path, cache: Path
) -> None:
    from llmplan.commands.report.figures_flow import draw_load_flow
    from llmplan.commands.report.figures_memory_plan import draw_memory_plan
    from llmplan.commands.report.run_data import RunData

    plan = int8_plan(tmp_path, tiny)
    start(plan, tmp_path / "first")
    start(plan, tmp_path / "second")
    release = json.loads((tmp_path / "second" / "metrics.json").read_text())["release"]
    assert release["mapped_weights_before"] > 0 and release["mapped_weights_after"] == 0
    assert release["file_backed_before"] > 0 and release["anonymous_before"] > 0
    for run_dir, title in ((tmp_path / "first", "conversion cache → device"), (tmp_path / "second", "(mapped)")):
        run = RunData.load(run_dir)
        figure = draw_load_flow(run, tmp_path / f"pictures-{run_dir.name}")
        assert figure.path is not None and title in figure.path.read_text(encoding="utf-8")
        (table,) = draw_memory_plan(run, tmp_path)
        assert "weights, file-backed (mapped)" in (table.html or "")
    samples = json.loads((tmp_path / "second" / "memory.json").read_text())["samples"]
    assert samples and all(0 < s["file"] <= s["rss"] for s in samples)  # each sample split in two
    from llmplan.commands.report.figures_memory import draw_memory

    (picture, *_) = draw_memory(RunData.load(tmp_path / "second"), tmp_path / "memory-picture")
    assert picture.path is not None and "file-backed" in picture.path.read_text(encoding="utf-8")


def test_a_bf16_folder_under_a_bf16_plan_maps_its_unfused_linears_where_they_lie(
    tiny: Path, tmp_path: Path, cache: Path
) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tiny-bf16"
    shutil.copytree(tiny, folder, ignore=shutil.ignore_patterns("SHA256SUMS", "*.safetensors*"))
    shards = sorted(tiny.glob("*.safetensors"))
    tensors = {k: v.to(torch.bfloat16) for shard in shards for k, v in load_file(shard).items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    plan = int8_plan(tmp_path, folder, dtype="bf16")
    first, tokens = start(plan, tmp_path / "first")
    second, again = start(plan, tmp_path / "second")
    assert second["weights_road"] == "cache-mapped" and again == tokens
    unfused = sum(t.nbytes for k, t in tensors.items() if k.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")))
    assert first["in_place_bytes"] == second["in_place_bytes"] == unfused  # o, down and the head: bf16 as they lie
    marker = json.loads((Path(first["conversion_entry"]) / "llmplan_conversion.json").read_text())
    assert {ref["shard"] for ref in marker["in_place"].values()} == {"model.safetensors"}
    assert str(folder / "model.safetensors") in second["mapped_files"]
    place = json.loads((tmp_path / "second" / "metrics.json").read_text())["place"]
    backing, weights = place["weights_backing"], place["regions"]["weights"]
    assert backing["file_backed"] >= 0.9 * weights and backing["file_backed"] + backing["anonymous"] == weights
