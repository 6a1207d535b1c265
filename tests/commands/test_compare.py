"""`llmplan compare` on a tiny model: one row per plan with the bench and eval figures, and the picture.

Never timed: the figures are checked for presence and sense, and the quality figures against `llmplan eval`'s
code (fp32 against itself is exactly 0), not against numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmplan.commands.compare_figure import frontier
from llmplan.engine.cli import main
from tests.stages.tiny_run import SENTENCES, make_tiny_model_dir, write_plan


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("compare")
    model_dir, _ = make_tiny_model_dir(tmp, n_layers=2)
    fp32 = write_plan(tmp, model_dir, name="tiny-fp32")
    data = yaml.safe_load(fp32.read_text(encoding="utf-8"))
    data["name"] = "tiny-int8"
    next(s for s in data["stages"] if s["id"] == "convert")["with"]["dtype"] = "int8"
    int8 = tmp / "tiny-int8.yaml"
    int8.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return [fp32, int8]


def test_one_row_per_plan_and_the_picture(plans: list[Path], tmp_path: Path, capsys) -> None:
    text = tmp_path / "words.txt"
    text.write_text(" ".join(SENTENCES * 4), encoding="utf-8")
    picture = tmp_path / "pareto.svg"
    argv = [
        "compare", *map(str, plans), "--text", str(text), "--context", "16", "--greedy", "2",
        "--prompt-tokens", "4", "--gen-tokens", "4", "--batch", "1,2", "--runs", "1",
        "--picture", str(picture), "--format", "json", "--out", str(tmp_path / "table"),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    fp32, int8 = result["plans"]
    assert (fp32["plan"], int8["plan"]) == ("tiny-fp32", "tiny-int8") and int8["weights"] == "int8"
    assert fp32["kl_mean"] == 0.0 and fp32["top1_agreement"] == 1.0 and int8["kl_mean"] > 0
    assert 0 < int8["weights_bytes"] < fp32["weights_bytes"] and fp32["kv_cache_bytes"] == int8["kv_cache_bytes"] > 0
    for row in result["plans"]:
        assert row["decode_tok_s_b1"] > 0 and row["decode_tok_s_b2"] > 0 and row["ttft_s"] > 0
        assert row["load_s"] > 0 and row["load_peak_bytes"] is not None and len(row["plan_hash"]) == 64
    svg = picture.read_text(encoding="utf-8")
    assert "tiny-fp32" in svg and "tiny-int8" in svg and "frontier" in svg
    table = (tmp_path / "table.md").read_text(encoding="utf-8")
    assert "| tiny-int8 | int8 |" in table and "decode tok/s b2" in table
    # what the figures were measured on: the CPU's SIMD features as this machine reports them, the load around
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    features = result["machine"]["cpu_features"]
    assert set(features) <= set(flags) and ("avx2" in features) == ("avx2" in flags)
    start, end = result["machine"]["loadavg"], result["machine"]["loadavg_end"]
    assert len(start) == len(end) == 3 and min(start + end) >= 0
    assert f"({', '.join(features) or 'no SIMD features listed'}, " in table
    assert f"Load average {start[0]:.2f} at the start, {end[0]:.2f} at the end" in table


def test_a_bad_picture_path_is_one_line_before_loading(plans: list[Path], tmp_path: Path, capsys) -> None:
    assert main(["compare", str(plans[0]), "--picture", str(tmp_path / "p.gif")]) != 0
    err = capsys.readouterr().err
    assert "--picture" in err and ".svg or .png" in err and "Traceback" not in err


def test_the_frontier_keeps_what_nothing_beats() -> None:
    # (KL, tok/s): b is beaten by a (less KL, faster); d ties a exactly and stays.
    points = [(0.0, 50.0), (0.1, 40.0), (0.2, 90.0), (0.0, 50.0), (0.3, 80.0)]
    assert frontier(points, more_is_better=True) == [0, 3, 2]
    # (KL, MiB): fewer bytes are better.
    assert frontier([(0.0, 500.0), (0.1, 200.0), (0.2, 300.0)], more_is_better=False) == [0, 1]
