"""The runner: order, measurements, promised writes, skipping, always-stages, failures, Ctrl-C."""

from __future__ import annotations

import json
from pathlib import Path

from llmplan.engine.plan import load_plan
from llmplan.engine.registry import Registry
from llmplan.engine.runner import Runner, RunResult

PLAN = """\
name: toy
stages:
  - {id: numbers, uses: toy.numbers, with: {count: 4}}
  - {id: square, uses: toy.square}
  - {id: total, uses: toy.total, with: {out: OUT}}
  - {id: cleanup, uses: toy.cleanup, with: {marker: MARK}}
"""


def run(tmp_path: Path, registry: Registry, text: str, overrides: list[str] | None = None, **kw: object) -> RunResult:
    text = text.replace("OUT", str(tmp_path / "total.json")).replace("MARK", str(tmp_path / "cleaned"))
    path = tmp_path / "plan.yaml"
    path.write_text(text, encoding="utf-8")
    bound = load_plan(path, registry, overrides)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return Runner(bound, registry.context_cls(), run_dir, **kw).run()  # type: ignore[arg-type]


def test_happy_path_runs_in_graph_order_and_records_everything(tmp_path, registry, toy_plugin):
    result = run(tmp_path, registry, PLAN)
    assert result.exit_code == 0, result.message
    assert toy_plugin.CALLS == ["numbers", "square", "total", "cleanup"]
    assert json.loads((tmp_path / "total.json").read_text()) == {"total": 1 + 4 + 9 + 16}
    stages = json.loads((result.run_dir / "stages.json").read_text())
    assert [s["id"] for s in stages] == ["numbers", "square", "total", "cleanup"]
    assert all(s["status"] == "ok" and s["wall_s"] >= 0 and s["rss_after"] > 0 for s in stages)
    events = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("stage_finished") == 4
    assert events[-1]["event"] == "run_finished" and events[-1]["status"] == "ok"
    assert json.loads((result.run_dir / "metrics.json").read_text())["total"]["total"] == 30
    assert "count: 4" in (result.run_dir / "plan.resolved.yaml").read_text()
    memory = json.loads((result.run_dir / "memory.json").read_text())
    assert {m["stage"] for m in memory["marks"]} == {"numbers", "square", "total", "cleanup"}


def test_order_follows_data_not_the_yaml(tmp_path, registry, toy_plugin):
    reordered = (
        PLAN.replace("  - {id: numbers, uses: toy.numbers, with: {count: 4}}\n", "")
        + "  - {id: numbers, uses: toy.numbers, with: {count: 4}}\n"
    )
    assert run(tmp_path, registry, reordered).exit_code == 0
    assert toy_plugin.CALLS == ["numbers", "square", "total", "cleanup"]


def test_overrides_reach_the_stage(tmp_path, registry, toy_plugin):
    result = run(tmp_path, registry, PLAN, ["numbers.count=2", "square.offset=1"])
    assert result.exit_code == 0
    assert json.loads((tmp_path / "total.json").read_text()) == {"total": 2 + 5}


def test_failure_runs_always_stages_keeps_finished_work_and_exits_1(tmp_path, registry, toy_plugin):
    result = run(tmp_path, registry, PLAN, ["total.fail=true"])
    assert result.exit_code == 1
    assert result.message == f"stage 'total' (toy.total): {tmp_path / 'total.json'}: refused to write (fail: true)"
    assert toy_plugin.CALLS == ["numbers", "square", "total", "cleanup"]
    assert (tmp_path / "cleaned").read_text() == "cleaned"
    statuses = {s["id"]: s["status"] for s in json.loads((result.run_dir / "stages.json").read_text())}
    assert statuses == {"numbers": "ok", "square": "ok", "total": "failed", "cleanup": "ok"}


def test_ctrl_c_runs_cleanup_and_exits_130(tmp_path, registry, toy_plugin):
    text = PLAN.replace("uses: toy.square", "uses: toy.interrupt")
    result = run(tmp_path, registry, text)
    assert result.exit_code == 130 and result.status == "interrupted"
    assert toy_plugin.CALLS == ["numbers", "interrupt", "cleanup"]
    assert (tmp_path / "cleaned").exists()
    statuses = {s["id"]: s["status"] for s in json.loads((result.run_dir / "stages.json").read_text())}
    assert statuses["total"] == "not_run"


def test_a_bug_is_one_line_and_the_traceback_goes_to_the_run_dir(tmp_path, registry, toy_plugin):
    result = run(tmp_path, registry, PLAN.replace("uses: toy.square", "uses: toy.crash"))
    assert result.exit_code == 1
    assert (
        result.message
        == "stage 'square' (toy.crash): failed unexpectedly (division by zero); run with --debug for the traceback"
    )
    assert "Traceback" in (result.run_dir / "traceback.txt").read_text()


def test_a_stage_that_breaks_its_promise_fails_the_run(tmp_path, registry, toy_plugin):
    result = run(tmp_path, registry, PLAN.replace("uses: toy.numbers, with: {count: 4}", "uses: toy.liar"))
    assert result.exit_code == 1
    assert result.message == "stage 'numbers' (toy.liar) did not write ext.numbers"
    assert toy_plugin.CALLS == ["liar", "cleanup"]


def test_a_filled_slot_skips_its_producer_and_what_only_it_needed(tmp_path, registry, toy_plugin):
    text = PLAN + "  - {id: lookup, uses: toy.lookup, with: {hit: true}}\n"
    result = run(tmp_path, registry, text)
    assert result.exit_code == 0, result.message
    assert toy_plugin.CALLS == ["lookup", "total", "cleanup"]
    assert json.loads((tmp_path / "total.json").read_text()) == {"total": 100.0}
    statuses = {r.id: r.status for r in result.records}
    assert statuses["numbers"] == statuses["square"] == "skipped"


def test_a_cache_miss_runs_everything(tmp_path, registry, toy_plugin):
    text = PLAN + "  - {id: lookup, uses: toy.lookup, with: {hit: false}}\n"
    assert run(tmp_path, registry, text).exit_code == 0
    assert toy_plugin.CALLS == ["lookup", "numbers", "square", "total", "cleanup"]


def test_until_runs_only_the_stage_and_its_ancestors(tmp_path, registry, toy_plugin):
    result = run(tmp_path, registry, PLAN, until="square")
    assert result.exit_code == 0
    assert toy_plugin.CALLS == ["numbers", "square"]
    assert not (tmp_path / "total.json").exists()
