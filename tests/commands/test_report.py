"""The report of a real tiny-model run: every picture drawn from the run's own files, one self-contained page."""

from __future__ import annotations

import argparse
import base64
import json
import re
import shutil
import subprocess
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from llmplan.commands.report import build_report, fonts
from llmplan.commands.report import command as report_command
from llmplan.commands.report.figures_generation import step_rates
from llmplan.commands.report.figures_memory import stage_spans
from llmplan.commands.report.figures_plan import stage_label
from llmplan.commands.report.tokens import token_labels
from tests.stages.tiny_run import make_tiny_model_dir, run_plan, wire_observers, write_plan

OBSERVE = {"layer_timings": True, "attention": {"layers": [0, 1], "heads": [0, 1], "max_tokens": 32}}
ALL_PNGS = {
    "plan_graph.png",
    "flow_load.png",
    "flow_compute.png",
    "flow_output.png",
    "model_graph.png",
    "memory.png",
    "layer_timings.png",
    "attention.png",
    "generation.png",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real runs of a tiny model: one observing everything (sampled), one asking for nothing."""
    tmp = tmp_path_factory.mktemp("report")
    patch = pytest.MonkeyPatch()
    try:
        wire_observers(patch)
        model_dir, _ = make_tiny_model_dir(tmp, n_layers=2)
        observed = write_plan(tmp, model_dir, observe=OBSERVE, generate={"temperature": 0.9}, name="observed")
        plain = write_plan(tmp, model_dir, name="plain")
        return {"observed": run_plan(observed, tmp / "observed"), "plain": run_plan(plain, tmp / "plain")}
    finally:
        patch.undo()


@pytest.fixture(scope="module")
def page(runs: dict[str, Path]) -> Path:
    return build_report(runs["observed"])


def test_every_picture_is_drawn_and_embedded(page: Path) -> None:
    assert page == page.parent.parent / "report" / "index.html"
    pngs = {p.name for p in page.parent.glob("*.png")}
    assert pngs == ALL_PNGS
    assert not list(page.parent.glob("*.error.txt"))
    html = page.read_text(encoding="utf-8")
    assert html.count('<img src="data:image/png;base64,') == len(ALL_PNGS)
    for name in ALL_PNGS:
        assert base64.b64encode((page.parent / name).read_bytes()).decode() in html


def test_page_is_self_contained(page: Path) -> None:
    html = page.read_text(encoding="utf-8")
    assert not re.search(r"https?://", html)
    assert not re.search(r"<script[^>]*\bsrc=|<link\b|@import|url\(", html, re.I)


def test_missing_stages_are_shown_as_missing(runs: dict[str, Path]) -> None:
    html = build_report(runs["plain"]).read_text(encoding="utf-8")
    assert "not asked for (plan `observe: {layer_timings: true}`)" in html
    assert not (runs["plain"] / "report" / "attention.png").exists()
    # the plan has no output stages: the output flow is drawn, hatched, without invented numbers
    assert (runs["plain"] / "report" / "flow_output.png").exists()


def test_heatmap_rows_sum_to_one(runs: dict[str, Path]) -> None:
    attention = json.loads((runs["observed"] / "attention.json").read_text())
    assert len(attention["maps"]) == 4
    for m in attention["maps"]:
        for row in m["weights"]:
            assert sum(row) == pytest.approx(1.0, abs=1e-5)


def test_numbers_come_from_the_run(runs: dict[str, Path]) -> None:
    run = runs["observed"]
    stages = json.loads((run / "stages.json").read_text())
    place = next(s for s in stages if s["id"] == "place")
    assert stage_label(place).startswith(f"{place['wall_s']:.3f} s, RSS ")
    memory = json.loads((run / "memory.json").read_text())
    spans = stage_spans(memory["marks"])
    assert [s[0] for s in spans] == [s["id"] for s in stages if s["status"] == "ok"]
    timings = json.loads((run / "layer_timings.json").read_text())
    assert len(timings["prefill"]["attention_s"]) == len(timings["decode"]["mlp_s"]) == 2
    generation = json.loads((run / "generations.json").read_text())[0]
    assert generation["temperature"] == 0.9 and len(generation["logprobs"]) == len(generation["tokens"])


def test_step_rates_and_token_labels() -> None:
    assert step_rates([0.1, 0.2, 0.45]) == pytest.approx([10.0, 4.0])
    # byte-level tokens: "注" (e6 b3 a8) split over two tokens shows its bytes, then the character
    assert token_labels([1, 2, 3], None, ["æ³", "¨", "Ġhi"]) == ["<e6 b3>", "注", "␣hi"]
    assert token_labels([5], ["a\nb"], None) == ["a\\nb"]


def test_cjk_font_fallback_escapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fonts, "_candidates", lambda: [])
    font = fonts.pick_font(["注意", "hello"])
    assert font.escaped and "fonts-noto-cjk" in font.note
    assert fonts.drawable("注a", font) == "\\u6ce8a"
    assert not fonts.pick_font(["plain ascii"]).note


def test_report_command(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    report_command.register(parser.add_subparsers())
    args = parser.parse_args(["report", str(runs["plain"]), "--out", str(tmp_path / "out")])
    assert args.handler(args) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == tmp_path / "out" / "index.html" and printed.is_file()


def test_report_command_through_the_cli(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    if not any(p.name == "report" for p in entry_points(group="llmplan.commands")):
        pytest.skip("entry point llmplan.commands:report not installed yet (pyproject wiring)")
    from llmplan.engine.cli import main

    assert main(["report", str(runs["plain"])]) == 0
    assert Path(capsys.readouterr().out.strip()) == runs["plain"] / "report" / "index.html"
    assert main(["report", str(runs["plain"] / "nope")]) == 1


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def test_page_loads_in_headless_chromium(page: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium)")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    done = subprocess.run(
        [browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=False
    )
    found: Any = re.search(r"<title>(\d+)/(\d+) images</title>", done.stdout)
    assert found, f"the page's load script did not run: {done.stderr[-500:]}"
    assert found.group(1) == found.group(2) == str(len(ALL_PNGS))
