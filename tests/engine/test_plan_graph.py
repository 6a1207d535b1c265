"""The plan's graph is built once (when the plan is bound) and its parts are values taken from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import llmplan.engine.graph as graph_module
from llmplan.engine.plan import BoundPlan, load_plan
from llmplan.engine.registry import Registry
from llmplan.engine.runner import Runner
from llmplan.engine.serving import ResidentPlan

PLAN = """\
name: toy
stages:
  - {id: numbers, uses: toy.numbers, with: {count: 3}}
  - {id: square, uses: toy.square}
  - {id: total, uses: toy.total}
  - {id: cleanup, uses: toy.cleanup}
"""

SERVED = """\
name: toy
stages:
  - {id: numbers, uses: toy.numbers, with: {count: 3}}
  - {id: ask, uses: toy.ask}
  - {id: total, uses: toy.total}
  - {id: cleanup, uses: toy.cleanup}
"""

CACHED = """\
name: toy
stages:
  - {id: numbers, uses: toy.numbers}
  - {id: square, uses: toy.square}
  - {id: lookup, uses: toy.lookup}
  - {id: total, uses: toy.total}
"""


def bind(tmp_path: Path, registry: Registry, text: str) -> BoundPlan:
    path = tmp_path / "plan.yaml"
    path.write_text(text, encoding="utf-8")
    return load_plan(path, registry)


def folder(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir()
    return tmp_path / name


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every call of the graph builder, wherever a module holds it (imported by name or through the module)."""
    original = graph_module.build_graph
    calls: list[list[str]] = []

    def counting(stages):  # type: ignore[no-untyped-def]
        calls.append([b.id for b in stages])
        return original(stages)

    for module in list(sys.modules.values()):
        if getattr(module, "build_graph", None) is original:
            monkeypatch.setattr(module, "build_graph", counting)
    return calls


def test_a_run_builds_the_graph_once(tmp_path, registry, toy_plugin, builds):
    bound = bind(tmp_path, registry, PLAN)
    assert builds == [["numbers", "square", "total", "cleanup"]]  # binding checks it, then keeps it
    result = Runner(bound, registry.context_cls(), folder(tmp_path, "run")).run()
    assert result.exit_code == 0, result.message
    assert Runner(bound, registry.context_cls(), folder(tmp_path, "again"), until="square").run().exit_code == 0
    assert len(builds) == 1
    assert toy_plugin.CALLS == ["numbers", "square", "total", "cleanup", "numbers", "square"]


def test_a_served_plan_builds_the_graph_once(tmp_path, registry, toy_plugin, builds):
    bound = bind(tmp_path, registry, SERVED)
    plan = ResidentPlan(bound, registry.context_cls, folder(tmp_path, "served"))
    try:
        assert plan.load().exit_code == 0
        answer = plan.run_request(plan.bind({"ask": {"times": 2}}))
        assert answer.context.get("ext.total") == 2 * (1 + 4 + 9)
        assert set(answer.stages) == {"ask", "total"}
        plan.unload()
    finally:
        plan.close()
    assert len(builds) == 1
    assert toy_plugin.CALLS == ["numbers", "ask", "total", "cleanup"]


def test_the_served_split_is_two_parts_of_the_plan_graph(tmp_path, registry, toy_plugin):
    bound = bind(tmp_path, registry, SERVED)
    plan = ResidentPlan(bound, registry.context_cls, folder(tmp_path, "served"))
    plan.close()
    assert plan.graph is bound.graph
    assert list(plan.resident) == ["numbers"] and list(plan.request) == ["ask", "total"]  # release in neither
    assert plan.request.dag.has_edge("ask", "total") and not plan.request.dag.has_edge("numbers", "ask")


def test_a_request_given_its_slots_skips_their_writer(tmp_path, registry, toy_plugin):
    plan = ResidentPlan(bind(tmp_path, registry, SERVED), registry.context_cls, folder(tmp_path, "served"))
    try:
        plan.load()
        answer = plan.run_request(given={"ext.squares": [5.0, 6.0]})
        assert answer.context.get("ext.total") == 11.0 and set(answer.stages) == {"total"}
    finally:
        plan.close()
    assert toy_plugin.CALLS == ["numbers", "total"]


def test_to_nodes_and_from_nodes_follow_the_edges(tmp_path, registry, toy_plugin):
    graph = bind(tmp_path, registry, PLAN).graph
    assert list(graph) == ["numbers", "square", "total", "cleanup"]
    upstream = graph.to_nodes("square")
    assert list(upstream) == ["numbers", "square"] and "total" not in upstream
    assert upstream.dag.edges["numbers", "square"]["slots"] == {"ext.numbers"}  # the whole plan's edge
    assert list(graph.from_nodes("square")) == ["square", "total"]
    assert list(graph.to_nodes("total", "cleanup")) == ["numbers", "square", "total", "cleanup"]


def test_a_part_of_a_part_sees_only_its_own_stages(tmp_path, registry, toy_plugin):
    graph = bind(tmp_path, registry, PLAN).graph
    part = graph.without(["square"])
    assert list(part) == ["numbers", "total", "cleanup"]
    assert list(part.to_nodes("total")) == ["total"]  # what it needs went through a stage left out
    assert list(graph.only(["total", "numbers", "nowhere"])) == ["numbers", "total"]  # plan order kept
    assert list(graph.where(lambda stage: stage.cls.always)) == ["cleanup"]
    assert list(graph) == ["numbers", "square", "total", "cleanup"]  # taking parts left the whole as it was


def test_depends_on_leaves_out_fill_edges(tmp_path, registry, toy_plugin):
    graph = bind(tmp_path, registry, CACHED).graph
    assert graph.dag.edges["lookup", "square"]["kinds"] == {graph_module.FILL}
    assert graph.depends_on("square") == {"numbers"}  # the lookup comes first, but decides nothing square makes
    assert graph.depends_on("total") == {"numbers", "square", "lookup"}


def test_a_requests_plan_shares_the_graph_and_holds_its_own_params(tmp_path, registry, toy_plugin):
    bound = bind(tmp_path, registry, SERVED)
    params = bound.stage("ask").cls.Params(times=3)
    mine = bound.with_params({"ask": params})
    assert mine.graph is bound.graph
    assert mine.stage("ask").params.times == 3 and bound.stage("ask").params.times == 1
