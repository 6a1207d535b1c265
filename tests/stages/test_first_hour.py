"""Issue 57, the first hour as a new user drives it: a run generates unless a replay is asked for, answers run to
their end (EOS or the context), plans by name from any folder and the default plan with none, `llmplan models`,
a memory prediction over the machine's said plainly, and the JSON sink saying where it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmplan.engine.cli import DEFAULT_PLAN, main
from llmplan.llm.sampling import SamplingParams
from tests.stages.tiny_run import make_tiny_model_dir, write_plan

LLMPLAN = [sys.executable, "-m", "llmplan"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), n_layers=2)[0]


def cached_plan(tmp_path: Path, model_dir: Path, *, seed: bool, lookup: dict[str, Any] | None = None) -> Path:
    """A sampled tiny plan with a results cache (the lookup's mode as given: none means the default)."""
    path = write_plan(tmp_path, model_dir, generate={"temperature": 0.9, "top_k": 50})
    plan = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not seed:
        del plan["seed"]
    db = str(tmp_path / "results.sqlite")
    plan["stages"] += [
        {"id": "lookup", "uses": "cache.lookup", "with": {"db": db, **(lookup or {})}},
        {"id": "clean", "uses": "output.postprocess"},
        {"id": "text", "uses": "output.detokenize"},
        {"id": "write", "uses": "output.write", "with": {"to": [{"json": "out/tiny.json"}]}},
        {"id": "store", "uses": "output.cache", "with": {"db": db}},
    ]
    path.write_text(yaml.safe_dump(plan, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return path


def run(plan: Path, out: Path, *extra: str) -> tuple[int, dict[str, str]]:
    """`llmplan run PLAN` as typed: (exit code, each stage's status)."""
    code = main(["run", str(plan), "--out", str(out), *extra])
    statuses = {s["id"]: s["status"] for s in json.loads((out / "stages.json").read_text())} if code == 0 else {}
    return code, statuses


# --- 1. replay only when asked -------------------------------------------------------------------------------


def test_a_repeated_sampled_run_generates_anew_with_a_seed_of_its_own(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = cached_plan(tmp_path, tiny, seed=False)
    seeds = []
    for name in ("first", "second"):
        code, statuses = run(plan, tmp_path / name)
        assert code == 0 and statuses["generate"] == "ok", statuses
        err = capsys.readouterr().err
        assert "replayed" not in err and "seed " in err and "--set seed=" in err  # said, and how to repeat it
        seeds.append(yaml.safe_load((tmp_path / name / "plan.resolved.yaml").read_text())["seed"])
    assert seeds[0] != seeds[1]


def test_a_replay_is_asked_for_and_said_and_a_report_always_generates(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = cached_plan(tmp_path, tiny, seed=True)
    assert run(plan, tmp_path / "first")[1]["generate"] == "ok"
    code, statuses = run(plan, tmp_path / "again")  # the same computation, not asked to replay: generated
    assert code == 0 and statuses["generate"] == "ok"
    capsys.readouterr()
    code, statuses = run(plan, tmp_path / "replay", "--replay")
    assert code == 0 and statuses["generate"] == "skipped"
    assert "replayed from the results cache" in capsys.readouterr().err
    assert main(["run", str(plan), "--replay", "--report", "--out", str(tmp_path / "both")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "--replay and --report: a report draws a run that generates; give one of them"
    ]
    (tmp_path / "reuse").mkdir()
    reusing = cached_plan(tmp_path / "reuse", tiny, seed=True, lookup={"mode": "reuse"})
    run(reusing, tmp_path / "stored")
    capsys.readouterr()
    code, statuses = run(reusing, tmp_path / "reported", "--report")
    assert code == 0 and statuses["generate"] == "ok"
    assert "report: this run generates (lookup.mode reuse set aside for it)" in capsys.readouterr().err


def test_replay_without_a_lookup_stage_is_one_line(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = write_plan(tmp_path, tiny)
    assert main(["run", str(plan), "--replay", "--out", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().err.strip() == f"--replay: {plan} has no cache.lookup stage to replay from"


# --- 2. answers run to their end ----------------------------------------------------------------------------


def test_an_answer_runs_to_the_context_when_no_limit_is_set(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert SamplingParams().max_new_tokens is None  # the library's default: no cap
    plan = write_plan(tmp_path, tiny, generate={"max_new_tokens": None})  # ignore_eos: the context is the end
    data = yaml.safe_load(plan.read_text())
    del data["stages"][-1]["with"]["max_new_tokens"]  # as a user leaves it out
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["run", str(plan), "--quiet", "--out", str(tmp_path / "r")]) == 0
    generated = json.loads((tmp_path / "r" / "metrics.json").read_text())["generate"]
    assert generated["finish_reasons"] == ["cache_full"] and generated["generated_tokens"] > 100  # a 128-token cache
    capped = ["--set", "generate.max_new_tokens=5"]
    assert main(["run", str(plan), "--quiet", "--out", str(tmp_path / "capped"), *capped]) == 0
    generated = json.loads((tmp_path / "capped" / "metrics.json").read_text())["generate"]
    assert (generated["finish_reasons"], generated["generated_tokens"]) == (["length"], 5)


def test_shipped_plans_leave_the_answer_uncapped_and_generate() -> None:
    for name in ("llama-int8", "llama-fp32", "qwen2.5-0.5b-chat", "qwen2.5-0.5b-int8"):
        plan = yaml.safe_load((DEFAULT_PLAN.parent / f"{name}.yaml").read_text())
        stages = {s["id"]: s.get("with", {}) for s in plan["stages"]}
        assert "max_new_tokens" not in stages["generate"] and stages["lookup"]["mode"] == "off", name
    sampled = yaml.safe_load((DEFAULT_PLAN.parent / "qwen2.5-0.5b-int8.yaml").read_text())
    assert "seed" not in sampled  # each run samples anew


# --- 3. plans by name, and the default plan -----------------------------------------------------------------


def test_a_plan_by_name_from_any_folder(tmp_path: Path) -> None:
    def llmplan(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*LLMPLAN, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)

    ok = llmplan("validate", "llama-int8")
    assert ok.returncode == 0 and ok.stderr.strip().endswith("ok: 1 plan(s) valid"), ok.stderr
    typo = llmplan("run", "llama-int88")
    assert typo.returncode == 1
    (line,) = typo.stderr.strip().splitlines()
    assert line.startswith("llama-int88: no plan file and no shipped plan of that name (did you mean 'llama-int8'?)")
    assert "known: " in line and "qwen2.5-0.5b-chat" in line
    missing = llmplan("run", "nope.yaml")  # a file name stays a file: the loader names it
    assert missing.returncode == 1 and missing.stderr.strip() == "nope.yaml:1:1: file not found"


def test_run_with_no_plan_runs_the_default_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--until", "prompt", "--quiet", "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert f"run: no plan given, so the default plan llama-int8 ({DEFAULT_PLAN})" in err
    assert yaml.safe_load((tmp_path / "r" / "plan.resolved.yaml").read_text())["name"] == "llama-int8"


# --- 4. llmplan models --------------------------------------------------------------------------------------


def test_models_lists_the_cache_and_removes_only_what_it_lists(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    imported = cache / "models" / "0123456789abcdef-f2-tiny-q4"
    imported.mkdir(parents=True)
    (imported / "model.safetensors").write_bytes(b"x" * 3000)
    (cache / "models" / f".{imported.name}.source.json").write_text(json.dumps({"from": "PyPI chunk packages a .. b"}))
    joined = cache / "downloads" / "0123456789abcdef"
    joined.mkdir(parents=True)
    (joined / "tiny-q4.gguf").write_bytes(b"y" * 1000)
    mine = tmp_path / "my-model"  # the user's folder, linked into the cache: never listed, never removed
    mine.mkdir()
    (cache / "models" / "fedcba9876543210-f2-mine").symlink_to(mine)
    env = {**os.environ, "LLMPLAN_CACHE": str(cache)}

    def llmplan(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*LLMPLAN, "models", *args], env=env, capture_output=True, text=True, timeout=120)

    listed = llmplan("--json")
    assert listed.returncode == 0
    (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["name"], row["bytes"]) == ("tiny-q4", 4000)
    assert row["from"].startswith("PyPI chunk packages a .. b") and str(joined) in row["from"]
    text = llmplan()
    assert text.stdout.startswith("tiny-q4  3.9 KiB  from PyPI chunk packages") and str(cache) in text.stderr
    for name in ("../downloads", "mine", str(mine)):
        refused = llmplan("rm", name)
        assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
        assert "is not a model in" in refused.stderr and "refused" in refused.stderr
    removed = llmplan("rm", "tiny-q4")
    assert removed.returncode == 0 and removed.stdout.startswith("removed tiny-q4")
    assert not imported.exists() and not joined.exists() and mine.is_dir()
    assert llmplan("--json").stdout == ""


# --- 5. validate's memory line, and where the JSON sink wrote ------------------------------------------------


def test_a_prediction_over_the_memory_is_said_and_never_ok(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = write_plan(tmp_path, tiny)
    assert main(["validate", "--deep", str(plan), "--memory", "64KiB"]) == 1
    err = capsys.readouterr().err
    assert "(--memory): it does not fit" in err
    assert "ok:" not in err
    assert main(["validate", "--deep", str(plan), "--memory", "8G"]) == 0
    assert capsys.readouterr().err.strip().endswith("ok: 1 plan(s) valid, each within its memory")


def test_the_json_sink_says_where_it_wrote(
    tiny: Path, tmp_path: Path, data_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = cached_plan(tmp_path, tiny, seed=True)
    target = data_home / "out" / "tiny.json"
    run(plan, tmp_path / "first", "--quiet")
    assert f"wrote {target} (json, new)" in capsys.readouterr().err
    run(plan, tmp_path / "second", "--quiet")
    assert f"wrote {target} (json, replaced the earlier run's)" in capsys.readouterr().err

