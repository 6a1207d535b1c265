"""The report of a real tiny-model run: every picture drawn from the run's own files, one self-contained page."""

from __future__ import annotations

import argparse
import base64
import json
import re
from html import escape
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from llmplan.commands.report import build_report, fonts
from llmplan.commands.report import command as report_command
from llmplan.commands.report.figures_generation import step_rates
from llmplan.commands.report.figures_memory import stage_spans
from llmplan.commands.report.figures_plan import stage_label
from llmplan.commands.report.figures_speculation import running_acceptance
from llmplan.commands.report.tokens import alternative_text, token_labels, token_texts
from llmplan.engine.memory import mib
from llmplan.llm.generation import speculative
from tests.commands.browser import Browser, find_chromium
from tests.stages.tiny_run import make_tiny_model_dir, run_plan, wire_observers, write_plan

OBSERVE = {"layer_timings": True, "attention": {"layers": [0, 1], "heads": [0, 1], "max_tokens": 32}}
ALL_SVGS = {
    "plan_graph.svg",
    "flow_load.svg",
    "flow_compute.svg",
    "flow_output.svg",
    "model_graph.svg",
    "memory.svg",
    "layer_timings.svg",
    "decode_steps.svg",
    "attention.svg",
    "attention_decode.svg",
    "speculation.svg",
}
EMBEDDED = ALL_SVGS - {"plan_graph.svg"}  # the plan graph is inline markup, the others data: URIs
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "report"  # screenshots (ignored by git)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real runs of a tiny model: one observing everything (sampled, 5 requests), one asking for nothing."""
    tmp = tmp_path_factory.mktemp("report")
    patch = pytest.MonkeyPatch()
    try:
        wire_observers(patch)
        # every prompt-lookup match guessed: the picture must not hang on whether guesses pay on this machine
        patch.setattr(speculative, "best_guesses", lambda p, most, cost: most)
        model_dir, _ = make_tiny_model_dir(tmp, n_layers=2)
        prompts = tmp / "prompts.jsonl"
        prompts.write_text(
            "".join(json.dumps({"id": f"q{i}", "text": f"Question number {i}: why?"}) + "\n" for i in range(5)),
            encoding="utf-8",
        )
        spec = {"tokens": 4, "ngram": 1}  # a one-token match: random tiny answers have them often
        generate = {"temperature": 0.9, "speculative": spec, "max_new_tokens": 24}
        observed = write_plan(tmp, model_dir, observe=OBSERVE, generate=generate, name="observed")
        plain = write_plan(tmp, model_dir, name="plain")
        return {
            "observed": run_plan(observed, tmp / "observed", "--prompts", str(prompts)),
            "plain": run_plan(plain, tmp / "plain"),
        }
    finally:
        patch.undo()


@pytest.fixture(scope="module")
def page(runs: dict[str, Path]) -> Path:
    return build_report(runs["observed"])


def test_every_picture_is_drawn_and_embedded(page: Path) -> None:
    assert page == page.parent.parent / "report" / "index.html"
    svgs = {p.name for p in page.parent.glob("*.svg")}
    assert svgs == ALL_SVGS
    assert not list(page.parent.glob("*.error.txt"))
    html = page.read_text(encoding="utf-8")
    assert html.count('<img src="data:image/svg+xml;base64,') == len(EMBEDDED)
    for name in EMBEDDED:
        assert base64.b64encode((page.parent / name).read_bytes()).decode() in html
    assert html.count('<svg class="plan-graph"') == 1
    for name in ALL_SVGS:  # vector pictures whose text is text (readable, measurable), not outlines
        assert "<text" in (page.parent / name).read_text(encoding="utf-8") or name != "plan_graph.svg"


def test_generation_view_shows_every_request(runs: dict[str, Path], page: Path) -> None:
    """Prompt and answer of all 5 requests (paged by 3), tokens coloured with alternatives, finish reasons."""
    html = page.read_text(encoding="utf-8")
    records = json.loads((runs["observed"] / "generations.json").read_text())
    assert len(records) == 5
    for i, record in enumerate(records):
        assert record["prompt"] and f"Question number {i}: why?" in record["prompt"]
        assert escape(record["prompt"]) in html
        assert len(record["alternatives"]) == len(record["tokens"]) and len(record["alternatives"][0]) == 5
        assert f"<h3>q{i}</h3>" in html
    assert html.count('<div class="page" data-label=') == 2  # 1–3, 4–5
    assert html.count('class="tok"') == sum(len(r["tokens"]) for r in records)
    assert "most likely here:" in html and "finish: <b>length</b>" in html


def test_speculation_is_drawn_pass_by_pass(runs: dict[str, Path], page: Path) -> None:
    records = json.loads((runs["observed"] / "generations.json").read_text())
    speculated = [r for r in records if r["speculation"]]
    assert speculated, "no request made a guess"
    html = page.read_text(encoding="utf-8")
    svg = (page.parent / "speculation.svg").read_text(encoding="utf-8")
    for rec in speculated:
        guessed, accepted = (sum(s[i] for s in rec["speculation"]) for i in (1, 2))
        assert f"{accepted} of {guessed} guesses accepted" in svg  # the numbers are the run's own
    assert "Speculative decoding over the answer" in html
    assert running_acceptance([[0, 2, 2], [3, 2, 0], [4, 4, 1]], window=2) == [1.0, 0.5, 1 / 6]
    plain = build_report(runs["plain"])  # no speculation: no such picture
    assert not (plain.parent / "speculation.svg").exists()
    assert "Speculative decoding" not in plain.read_text(encoding="utf-8")


def test_notes_are_neutral_and_warnings_are_warnings(runs: dict[str, Path]) -> None:
    html = build_report(runs["plain"]).read_text(encoding="utf-8")
    assert '<p class="note">not asked for (plan `observe: {layer_timings: true}`)</p>' in html
    assert ".note{color:#495057" in html  # grey, not red
    assert '<p class="warning">' not in html.split("<nav>")[0] or "ended" in html


def test_page_is_self_contained(page: Path) -> None:
    html = page.read_text(encoding="utf-8")
    assert not re.search(r"https?://", html)
    # url(#id) points inside the page (the plan graph's arrow markers); any other url( would fetch something
    assert not re.search(r"<script[^>]*\bsrc=|<link\b|@import|url\((?!#)", html, re.I)


def test_missing_stages_are_shown_as_missing(runs: dict[str, Path]) -> None:
    html = build_report(runs["plain"]).read_text(encoding="utf-8")
    assert "not asked for (plan `observe: {layer_timings: true}`)" in html
    assert not (runs["plain"] / "report" / "attention.svg").exists()
    # the plan has no output stages: the output flow is drawn, hatched, without invented numbers
    assert (runs["plain"] / "report" / "flow_output.svg").exists()


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
    assert len(timings["decode"]["attention_ms"]) == 2 and timings["decode"]["passes"] > 10
    steps = json.loads((run / "steps.json").read_text())["steps"]
    assert sum(len(s["prefill"]) for s in steps) == 5 and sum(bool(s.get("decode")) for s in steps) > 0
    generation = json.loads((run / "generations.json").read_text())[0]
    assert generation["temperature"] == 0.9 and len(generation["logprobs"]) == len(generation["tokens"])


def test_step_rates_and_token_labels() -> None:
    assert step_rates([0.1, 0.2, 0.45]) == pytest.approx([10.0, 4.0])
    # byte-level tokens: "注" (e6 b3 a8) split over two tokens shows on the one that completes it
    assert token_labels([1, 2, 3], None, ["æ³", "¨", "Ġhi"]) == ["…", "注", "␣hi"]
    # a token that completes one character and begins the next; bytes cut off at the end stay bytes
    assert token_labels([1, 2, 3, 4], None, ["æ³", "¨æ", "³¨", "æ³"]) == ["…", "注…", "注", "<e6 b3>"]
    assert token_labels([5], ["a\nb"], None) == ["a\\nb"]
    texts = token_texts([1, 2], None, ["æ³", "¨"])
    assert [t.text for t in texts] == ["", "注"] and texts[1].pending == b"\xe6\xb3"


def test_alternatives_read_after_the_bytes_before_them() -> None:
    # after e6 b3, the byte a8 completes 注 and 8f completes 泏; alone, a first byte is only bytes
    assert [alternative_text(t, "\ufffd", b"\xe6\xb3") for t in ("¨", "ı")] == ["注", "泏"]
    assert alternative_text("æ", "\ufffd", b"") == "<e6>…"
    assert alternative_text("Ġthe", " the", b"") == "␣the"
    assert alternative_text(None, "plain", b"") == "plain"  # not a byte-level vocabulary: its own piece


def test_no_cjk_font_leaves_the_labels_to_the_browser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fonts, "_candidates", lambda: [])
    font = fonts.pick_font(["注意", "hello"])
    assert font.browser and "browser" in font.note and "fonts-noto-cjk" in font.note
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


def test_page_in_headless_chromium_at_1280px(page: Path, tmp_path: Path) -> None:
    """Every figure loads; the plan graph's smallest text renders at >= 10 px; a screenshot of each section is
    kept under tests/artifacts/report/."""
    executable = find_chromium()
    if executable is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium; .ci/run installs it)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser = Browser(executable, tmp_path / "profile")
    try:
        browser.open(page.as_uri(), 1280, 900)
        loaded = browser.evaluate("document.body.getAttribute('data-figures-loaded')")
        assert loaded == f"{len(ALL_SVGS)}/{len(ALL_SVGS)}", loaded
        broken = browser.evaluate("Array.from(document.images).filter(i => !(i.naturalWidth > 0)).length")
        assert broken == 0
        sizes = browser.evaluate(
            "Array.from(document.querySelectorAll('#plan svg text')).map(t => t.getBoundingClientRect().height)"
        )
        font_px = browser.evaluate(
            "Math.min(...Array.from(document.querySelectorAll('#plan svg text'))"
            ".map(t => parseFloat(getComputedStyle(t).fontSize) * t.getScreenCTM().a))"
        )
        assert sizes and min(sizes) >= 10 and font_px >= 10, (min(sizes), font_px)
        width = browser.evaluate("document.documentElement.clientWidth")
        assert width == 1280
        sections = browser.evaluate(
            "Array.from(document.querySelectorAll('section')).map(s => { const r = s.getBoundingClientRect();"
            " return {id: s.id, x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height}; })"
        )
        assert {s["id"] for s in sections} >= {"plan", "layers", "decode", "attention", "generation", "memory"}
        for box in sections:
            shot = browser.screenshot(
                ARTIFACTS / f"{box['id']}.png",
                {"x": box["x"], "y": box["y"], "width": box["width"], "height": min(box["height"], 6000)},
            )
            assert shot.stat().st_size > 1000
        # click opens full size, click again closes
        assert browser.evaluate(
            "(() => { const f = document.querySelector('#plan figure'); f.click();"
            " const on = f.classList.contains('full'); f.click(); return on; })()"
        )
    finally:
        browser.close()


def test_replayed_run_says_so_and_shows_the_source_runs_pictures(tmp_path: Path) -> None:
    """A cached answer's page: replayed, from which run, that run's pictures; no "not run" boxes blaming the plan."""
    import yaml

    patch = pytest.MonkeyPatch()
    try:
        wire_observers(patch)
        # every prompt-lookup match guessed: the picture must not hang on whether guesses pay on this machine
        patch.setattr(speculative, "best_guesses", lambda p, most, cost: most)
        model_dir, _ = make_tiny_model_dir(tmp_path, n_layers=2)
        path = write_plan(tmp_path, model_dir, observe={"layer_timings": True}, name="cached")
        plan = yaml.safe_load(path.read_text(encoding="utf-8"))
        db = str(tmp_path / "results.sqlite")
        plan["stages"] += [
            {"id": "lookup", "uses": "cache.lookup", "with": {"db": db, "mode": "reuse"}},
            {"id": "post", "uses": "output.postprocess"},
            {"id": "detok", "uses": "output.detokenize"},
            {"id": "store", "uses": "output.cache", "with": {"db": db}},
        ]
        path.write_text(yaml.safe_dump(plan, sort_keys=False), encoding="utf-8")
        first = run_plan(path, tmp_path / "first")
        second = run_plan(path, tmp_path / "second")
    finally:
        patch.undo()
    assert json.loads((second / "metrics.json").read_text())["lookup"]["replayed"] is True
    html = build_report(second).read_text(encoding="utf-8")
    assert "Replayed from the results cache." in html and "Nothing was generated in this run" in html
    assert escape((first / "report" / "index.html").as_uri()) in html
    assert f"(from {first.name}, the run that generated the answers)" in html
    assert "skipped: answers replayed" in html  # the plan graph's label, not "not run"
    assert "not in plan / not run" not in html
    assert (second / "report" / "source" / "layer_timings.svg").is_file()


def test_memory_predicted_beside_measured(runs: dict[str, Path], page: Path, tmp_path: Path) -> None:
    """Issue 27: each region's prediction (validate --deep's formulas, recorded by the run) beside the bytes the
    run held, and the predicted peaks beside the RSS the run reached."""
    from llmplan.commands.report.figures_memory_plan import draw_memory_plan
    from llmplan.commands.report.run_data import RunData

    run = RunData.load(runs["observed"])
    (figure,) = draw_memory_plan(run, tmp_path)
    rows = {
        cells[0]: cells[1:]
        for cells in (re.findall(r"<t[hd]>([^<]*)</t[hd]>", row) for row in figure.html.split("<tr>")[2:])
    }
    regions = run.metrics_of("load.to_device")["regions"]
    for name, size in regions.items():
        predicted, measured, diff = rows[name.replace("_", " ")]
        assert measured == escape(mib(size)) and predicted == measured and diff == "+0.0%"
    convert = run.metrics_of("load.convert")
    assert convert["predicted_bytes"] == regions["weights"]  # the formula against the tensors themselves
    predicted, measured, _ = rows["peak while converting"]
    assert predicted == mib(convert["predicted_peak_bytes"]) and measured != "-"
    assert "Memory: predicted and measured" in page.read_text(encoding="utf-8")


def test_run_report_turns_on_what_its_pictures_need(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain plan (no `observe:`) run with --report: every picture drawn, said in one line; without
    --report the same plan observes nothing more (runs["plain"])."""
    from llmplan.engine.cli import main

    wire_observers(monkeypatch)
    plan = runs["plain"].parent / "plain.yaml"
    before = plan.read_bytes()
    capsys.readouterr()
    assert main(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet", "--report"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    said = [line for line in err if "records" in line]
    assert said == [
        "report: this run also records per-layer timings and attention weights for its pictures"
        " (observe.layer_timings, observe.attention)"
    ], err
    page = (tmp_path / "run" / "report" / "index.html").read_text(encoding="utf-8")
    assert "Not drawn." not in page
    assert {"layer_timings.svg", "attention.svg"} <= {p.name for p in (tmp_path / "run" / "report").glob("*.svg")}
    assert plan.read_bytes() == before  # the plan file is not changed, only this run's settings
    plain = (runs["plain"] / "plan.resolved.yaml").read_text(encoding="utf-8")
    assert "layer_timings: false" in plain and "attention: null" in plain  # no report, nothing more observed


def test_report_run_decodes_on_the_path_an_unobserved_run_takes(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--report` observes attention after the generation, not by hooking it: the generation keeps the backend
    the unobserved run has (the fused native pass where the kernels are built; it moved to the torch modules,
    2.5x slower), and the page still has the heatmaps and the per-layer timings, saying how they were taken."""
    from llmplan.engine.cli import main
    from llmplan.llm.kernels import native

    wire_observers(monkeypatch)
    plan = runs["plain"].parent / "plain.yaml"
    assert main(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet", "--report"]) == 0
    backend = {
        name: json.loads((run / "metrics.json").read_text())["generate"]["backend"]
        for name, run in (("plain", runs["plain"]), ("report", tmp_path / "run"))
    }
    expected = "native" if native.kernels() is not None else "torch"
    assert backend == {"plain": expected, "report": expected}
    timings = json.loads((tmp_path / "run" / "layer_timings.json").read_text())
    assert set(timings["decode"]["paths"]) == {"fused" if expected == "native" else "torch"}
    attention = json.loads((tmp_path / "run" / "attention.json").read_text())
    assert attention["maps"] and attention["decode"]["maps"] and "after the run" in attention["taken"]
    report = tmp_path / "run" / "report"
    assert {"layer_timings.svg", "attention.svg", "attention_decode.svg"} <= {p.name for p in report.glob("*.svg")}
    page = (report / "index.html").read_text(encoding="utf-8")
    assert "outside the timed generation" in page and "decoded on the torch modules" not in page
