"""End to end on a tiny Llama: top-N logprobs in --json, release with observers on, a closed stdout."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import yaml

from tests.pipeline.conftest import run_plan
from tests.stages.tiny_run import make_tiny_model_dir, write_plan


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))[0]


def _full_plan(tmp_path: Path, model_dir: Path, *, sinks: list, release: bool = False, **kw) -> Path:
    plan = write_plan(tmp_path, model_dir, **kw)
    document = yaml.safe_load(plan.read_text(encoding="utf-8"))
    document["stages"] += [
        {"id": "post", "uses": "output.postprocess"},
        {"id": "text", "uses": "output.detokenize"},
        {"id": "write", "uses": "output.write", "with": {"to": sinks}},
    ]
    if release:
        document["stages"].append({"id": "release", "uses": "output.release"})
    plan.write_text(yaml.safe_dump(document, allow_unicode=True), encoding="utf-8")
    return plan


def test_json_result_has_the_top_logprobs(tmp_path: Path, model_dir: Path, capsys) -> None:
    from llmplan.engine.cli import main

    plan = _full_plan(tmp_path, model_dir, sinks=["terminal"], generate={"logprobs": 3, "max_new_tokens": 5})
    assert main(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    entries = result["token_logprobs"]
    assert [e["id"] for e in entries] == result["tokens"] and len(entries) == 5
    for entry, logprob in zip(entries, result["logprobs"], strict=True):
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] == pytest.approx(logprob)
        best = entry["top_logprobs"][0]  # greedy: the chosen token is the most likely one
        assert best["id"] == entry["id"] and best["logprob"] == pytest.approx(logprob)
        assert [a["logprob"] for a in entry["top_logprobs"]] == sorted(
            (a["logprob"] for a in entry["top_logprobs"]), reverse=True
        )


@pytest.mark.parametrize("observe", [{}, {"layer_timings": True, "attention": {"layers": [0], "heads": [0]}}])
def test_release_lets_the_model_go_even_when_observed(tmp_path: Path, model_dir: Path, monkeypatch, observe) -> None:
    from llmplan.stages import load_to_device
    from llmplan.stages import observe as observe_module

    models: list[weakref.ref] = []
    real = observe_module.begin_observing

    def spy(ctx, model, *rest):  # type: ignore[no-untyped-def]
        models.append(weakref.ref(model))
        return real(ctx, model, *rest)

    monkeypatch.setattr(load_to_device, "begin_observing", spy)
    plan = _full_plan(tmp_path, model_dir, sinks=[{"json": str(tmp_path / "out.json")}], release=True, observe=observe)
    result = run_plan(plan, tmp_path / "run")
    assert result.exit_code == 0, result.message
    assert result.context.ext.get(observe_module.OBSERVER_KEY) is None
    gc.collect()
    assert models and models[0]() is None  # nothing (no hook, no observer) keeps the model alive
    if observe:
        assert (tmp_path / "run" / "layer_timings.json").is_file()  # the observer did its work first


@pytest.mark.parametrize("json_mode", [True, False])
def test_a_closed_stdout_ends_the_run_quietly(tmp_path: Path, model_dir: Path, json_mode: bool) -> None:
    plan = _full_plan(tmp_path, model_dir, sinks=["terminal"], generate={"stream": True})
    flags = "--json" if json_mode else ""
    # `| true` closes the pipe before llmplan writes a byte, so its first write always meets EPIPE.
    command = (
        f"{sys.executable} -m llmplan run {plan} --out {tmp_path / 'run'} --quiet {flags} | true; "
        'echo "exit=${PIPESTATUS[0]}" >&2'
    )
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert done.stderr.strip().endswith("exit=141"), done.stderr
    assert "BrokenPipe" not in done.stderr and "Traceback" not in done.stderr and "error" not in done.stderr
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "closed"
