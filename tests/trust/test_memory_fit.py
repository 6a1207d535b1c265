"""Issue 27: `validate --deep --memory BYTES` predicts the peak, says whether it fits, and what KV setting does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmplan.engine.cli import deep_memory_check, main
from llmplan.engine.memory_fit import parse_size
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover

from .checkpoints import make_checkpoint, plan_for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def planned(plan: Path, memory: int | None, overrides: list[str] | None = None):  # type: ignore[no-untyped-def]
    findings, _, memory_plan = deep_memory_check(load_plan(plan, discover(), overrides), memory)
    assert memory_plan is not None
    return [str(f) for f in findings], memory_plan


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8G", 8 << 30), ("512MiB", 512 << 20), ("512M", 512 << 20), ("8GB", 8 * 10**9), ("1000000", 10**6)],
)
def test_sizes_read_as_people_write_them(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["8X", "GiB", "-1", "0", "1.5.2G"])
def test_a_bad_size_is_one_clear_line(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", "--deep", "--memory", text, "plan.yaml"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("llmplan validate: error: argument --memory:"), lines


def test_the_peak_is_the_larger_of_converting_and_steady(model_dir: Path, tmp_path: Path) -> None:
    found, memory = planned(plan_for(tmp_path, model_dir), None)
    assert found == [] and memory.fits
    converting = memory.peaks["converting"]
    assert converting >= memory.regions["weights"] and memory.peak == max(converting, memory.steady)
    assert memory.available_from in ("available host memory", "host memory")  # the CPU plan's default


def test_a_kv_cache_that_does_not_fit_names_the_largest_settings_that_do(model_dir: Path, tmp_path: Path) -> None:
    plan = plan_for(tmp_path, model_dir)
    _, roomy = planned(plan, None, ["place.max_batch=64", "place.kv_cache.max_tokens=256"])
    budget = max(roomy.peaks["converting"], roomy.regions["weights"] + roomy.steady // 4)
    found, tight = planned(plan, budget, ["place.max_batch=64", "place.kv_cache.max_tokens=256"])
    assert not tight.fits and len(found) == 1
    assert "stages[7].with.kv_cache.max_tokens:" in found[0]
    assert f"--set place.kv_cache.max_tokens={tight.max_tokens} (at max_batch 64)" in found[0]
    assert f"--set place.max_batch={tight.max_batch} (at max_tokens 256)" in found[0]
    # each named setting fits the same budget, and one more token or slot would not
    assert tight.max_tokens is not None and tight.max_batch is not None
    for overrides in (
        [f"place.kv_cache.max_tokens={tight.max_tokens}", "place.max_batch=64"],
        [f"place.max_batch={tight.max_batch}", "place.kv_cache.max_tokens=256"],
    ):
        assert planned(plan, budget, overrides)[1].fits, overrides
    for overrides in (
        [f"place.kv_cache.max_tokens={tight.max_tokens + 1}", "place.max_batch=64"],
        [f"place.max_batch={tight.max_batch + 1}", "place.kv_cache.max_tokens=256"],
    ):
        assert not planned(plan, budget, overrides)[1].fits, overrides


def test_a_peak_while_converting_that_does_not_fit_points_at_the_convert_stage(model_dir: Path, tmp_path: Path) -> None:
    plan = plan_for(tmp_path, model_dir)
    _, memory = planned(plan, None)
    found, tight = planned(plan, memory.peaks["converting"] - 1)
    assert not tight.fits and tight.max_tokens is None and tight.max_batch is None
    assert len(found) == 1 and "stages[6].uses: predicted peak" in found[0] and "while converting" in found[0]


def test_json_carries_the_numbers_and_exits_1(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = plan_for(tmp_path, model_dir)
    args = ["validate", "--deep", "--format", "json", str(plan), "--set", "place.max_batch=64"]
    assert main([*args, "--memory", "1G"]) == 0
    fits = json.loads(capsys.readouterr().out)["memory"][str(plan)]
    assert fits["fits"] and fits["available_bytes"] == 1 << 30 and fits["available_from"] == "--memory"
    assert fits["peak_bytes"] == max(fits["steady_bytes"], *fits["peaks"].values())
    assert fits["steady_bytes"] == sum(fits["regions"].values())
    budget = fits["regions"]["weights"] + fits["regions"]["kv_cache"] // 2
    assert main([*args, "--memory", str(max(budget, fits["peaks"]["converting"]))]) == 1
    out = json.loads(capsys.readouterr().out)
    tight = out["memory"][str(plan)]
    assert not out["ok"] and not tight["fits"] and tight["fit_max_batch"] < 64 and tight["kv_stage"] == "place"


def test_memory_without_deep_is_refused(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--memory", "1G", str(plan_for(tmp_path, model_dir))]) == 1
    assert "--memory needs --deep" in capsys.readouterr().err
