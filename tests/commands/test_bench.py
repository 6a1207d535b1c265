"""`llmplan bench` on a tiny model: it runs through the engine, emits every JSON field, and the formats work.

Never timed: only the presence and sanity of the figures is checked (the CPU may be shared).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmplan.engine.cli import main
from tests.stages.tiny_run import make_tiny_model_dir, write_plan

FIGURES = ("prefill_tok_s", "decode_tok_s", "ttft_s")


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("bench")
    model_dir, _ = make_tiny_model_dir(tmp, n_layers=2)
    return write_plan(tmp, model_dir)


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(["bench", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_json_has_every_field_and_ratios(plan: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = _bench(
        capsys,
        str(plan),
        *("--batch", "1,3", "--runs", "2", "--prompt-tokens", "6", "--gen-tokens", "4"),
        *("--vs", "transformers", "--format", "json", "--out", str(tmp_path / "tiny")),
    )
    result = json.loads(out)
    assert result["machine"]["cpu"] and result["machine"]["threads"] == 1  # the plan's thread count
    assert result["machine"]["torch"] and result["machine"]["transformers"]
    rows = {(r["engine"], r["batch"]): r for r in result["results"]}
    assert set(rows) == {("llmplan", 1), ("llmplan", 3), ("transformers", 1), ("transformers", 3)}
    for row in rows.values():
        for figure in FIGURES:
            s = row[figure]
            assert s["n"] == 2 and 0 < s["min"] <= s["median"] <= s["max"]
        assert row["load"]["warm_s"] > 0 and row["load_to_first_token_s"] > row["load"]["warm_s"]
    ours = rows[("llmplan", 1)]
    assert ours["dtype"] == "fp32" and ours["peak_rss_bytes"] > 0
    mem = ours["memory"]
    assert mem["weights_bytes"] > 0 and mem["kv_cache_bytes"] > 0 and mem["peak_over_budget"] > 0
    assert ours["load"]["cold_s"] is not None or any("cold" in n for n in result["notes"])
    ratios = {r["batch"]: r for r in result["ratios"]}
    assert set(ratios) == {1, 3} and all(ratios[1][f] > 0 for f in FIGURES)
    assert ratios[1]["greedy_tokens_agree"] == 4  # fp32, same weights: the same greedy tokens
    assert json.loads((tmp_path / "tiny.json").read_text())["plan"] == str(plan)
    assert "| llmplan | fp32 | 1 |" in (tmp_path / "tiny.md").read_text()


def test_dtype_grid_markdown_and_csv(plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ("--batch", "2", "--runs", "1", "--prompt-tokens", "5", "--gen-tokens", "3", "--no-cold")
    md = _bench(capsys, str(plan), *common, "--dtype", "fp32,int8")
    assert "| llmplan | fp32 | 2 |" in md and "| llmplan | int8 | 2 |" in md and "threads" in md
    csv = _bench(capsys, str(plan), *common, "--format", "csv", "--set", "place.kv_cache.max_tokens=16")
    lines = csv.strip().splitlines()
    assert lines[0] == "engine,dtype,batch,figure,median,min,max,n"
    assert any(line.startswith("llmplan,fp32,2,decode_tok_s,") for line in lines)


def test_bad_arguments_are_one_line_errors(plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "no-such-plan.yaml"]) == 1
    assert "no such plan file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", str(plan), "--batch", "0"])


def test_mix_compares_static_batches_with_the_scheduler(
    plan: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = _bench(
        capsys,
        str(plan),
        *("--mix", "7", "--slots", "3", "--runs", "1", "--max-step-tokens", "16"),
        *("--mix-prompts", "2-20", "--mix-outputs", "2-9", "--format", "json", "--out", str(tmp_path / "mix")),
    )
    result = json.loads(out)
    assert result["requests"] == 7 and result["slots"] == 3
    assert 7 * 2 <= result["output_tokens"] <= 7 * 9
    for side in ("static", "scheduler"):
        s = result["sides"][side]
        assert s["wall_s"] > 0 and s["output_tok_s"] > 0 and 0 < s["ttft_p50_s"] <= s["ttft_p90_s"]
    assert result["throughput_ratio"] > 0 and result["single_request"]["ratio"] > 0
    assert "avx2" in result["machine"]["cpu_features"] or not result["machine"]["cpu_features"]
    assert "| scheduler |" in (tmp_path / "mix.md").read_text()


def test_mix_refuses_a_step_budget_below_the_slots(plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(plan), "--mix", "4", "--slots", "8", "--max-step-tokens", "8"]) != 0
    assert "--max-step-tokens (8) must exceed --slots (8)" in capsys.readouterr().err


def test_serve_runs_the_load_generator_against_llmplan_serve(
    plan: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = _bench(
        capsys,
        str(plan),
        *("--serve", "--clients", "1,2", "--prompt-tokens", "12", "--gen-tokens", "5", "--format", "json"),
        *("--out", str(tmp_path / "serve")),
    )
    result = json.loads(out)
    ours = result["sides"]["llmplan"]
    assert set(ours) == {"1", "2"} and result["ratios"] is None  # no reference asked for
    for clients, level in ours.items():
        assert level["requests"] == 4 and level["ok"] == 4 and level["lost"] == 0 and level["all_answered"]
        assert level["output_tok_per_s"] > 0 and 0 < level["ttft_p50_s"] <= level["ttft_p99_s"], clients
    assert "| llmplan | 2 |" in (tmp_path / "serve.md").read_text()


def test_llama_server_needs_serve(plan: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(plan), "--vs", "llama-server"]) == 1
    assert "add --serve" in capsys.readouterr().err
