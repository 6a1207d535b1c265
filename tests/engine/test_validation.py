"""Malformed plans: each gets one clear finding with file, line, column and field path."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmplan.engine.findings import PlanError
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import Registry

GOOD = """\
name: toy
stages:
  - id: numbers
    uses: toy.numbers
    with: {count: 3}
  - id: square
    uses: toy.square
  - id: total
    uses: toy.total
"""


def findings_for(text: str, tmp_path: Path, registry: Registry, overrides: list[str] | None = None) -> list[str]:
    path = tmp_path / "plan.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PlanError) as caught:
        load_plan(path, registry, overrides)
    return [str(f).replace(str(path), "plan.yaml") for f in caught.value.findings]


CASES = [
    # --- YAML syntax and safety -------------------------------------------------------------------
    ("unclosed-flow", "name: toy\nstages: [\n", "plan.yaml:3:1: YAML syntax error: expected the node content"),
    ("tab-indent", "name: toy\nstages:\n\t- id: x\n", "plan.yaml:3:1: YAML syntax error: found character '\\t'"),
    (
        "bad-mapping",
        "name: toy\n  stages: 1\n",
        "plan.yaml:2:9: YAML syntax error: mapping values are not allowed here",
    ),
    ("empty", "", "plan.yaml:1:1: a plan must be a mapping with `name` and `stages` (got empty)"),
    ("list-top", "- 1\n- 2\n", "plan.yaml:1:1: a plan must be a mapping with `name` and `stages` (got list)"),
    ("two-docs", "name: a\n---\nname: b\n", "plan.yaml:3:1: a plan file holds one YAML document, found several"),
    (
        "python-tag",
        "name: toy\nstages: !!python/object/apply:os.system ['echo pwned']\n",
        "plan.yaml:2:9: stages: unsupported tag 'tag:yaml.org,2002:python/object/apply:os.system'",
    ),
    ("custom-tag", "name: !include other.yaml\nstages: []\n", "plan.yaml:1:7: name: unsupported tag '!include'"),
    (
        "alias-bomb",
        "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
        "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
        "the plan expands to more than 50000 values (an alias bomb?); refused",
    ),
    (
        "duplicate-key",
        GOOD.replace("uses: toy.square", "uses: toy.square\n    uses: toy.total"),
        "plan.yaml:8:5: stages[1].uses: duplicate key 'uses'",
    ),
    (
        "merge-key",
        "base: &b {count: 1}\nname: toy\nstages:\n  - {id: n, uses: toy.numbers, with: {<<: *b}}\n",
        "plan.yaml:4:39: stages[0].with: merge keys ('<<') are not supported in plans",
    ),
    # --- plan schema ------------------------------------------------------------------------------
    ("missing-name", GOOD.replace("name: toy\n", ""), "plan.yaml:1:1: name: required field is missing"),
    ("missing-stages", "name: toy\n", "plan.yaml:1:1: stages: required field is missing"),
    ("empty-stages", "name: toy\nstages: []\n", "plan.yaml:2:9: stages: must have at least 1 item(s) (got [])"),
    ("unknown-top-key", GOOD + "stagez: 1\n", "plan.yaml:10:1: stagez: unknown field (did you mean 'stages'?)"),
    ("bad-name", GOOD.replace("name: toy", "name: 'my plan!'"), "plan.yaml:1:7: name: must match"),
    (
        "bad-device",
        GOOD + "device: gpu\n",
        "plan.yaml:10:9: device: must match ^(auto|cpu|cuda(:\\d+)?|mps)$ (got 'gpu')",
    ),
    ("negative-seed", GOOD + "seed: -1\n", "plan.yaml:10:7: seed: must be >= 0 (got -1)"),
    ("threads-type", GOOD + "threads: many\n", "plan.yaml:10:10: threads: must be an integer (got 'many')"),
    ("version", "version: 2\n" + GOOD, "plan.yaml:1:10: version: must be one of 1 (got 2)"),
    (
        "observe-range",
        GOOD + "observe: {memory_interval_ms: -5}\n",
        "plan.yaml:10:31: observe.memory_interval_ms: must be >= 0 (got -5)",
    ),
    (
        "stage-not-mapping",
        "name: toy\nstages:\n  - toy.numbers\n",
        "plan.yaml:3:5: stages[0]: must be a mapping (got 'toy.numbers')",
    ),
    (
        "stage-missing-id",
        GOOD.replace("  - id: square\n    uses: toy.square", "  - uses: toy.square"),
        "plan.yaml:6:5: stages[1].id: required field is missing",
    ),
    (
        "stage-missing-uses",
        GOOD.replace("    uses: toy.total\n", ""),
        "plan.yaml:8:5: stages[2].uses: required field is missing",
    ),
    (
        "stage-unknown-key",
        GOOD.replace("uses: toy.square", "uses: toy.square\n    whith: {}"),
        "plan.yaml:8:5: stages[1].whith: unknown field (did you mean 'with'?)",
    ),
    ("bad-id", GOOD.replace("id: square", "id: 'sq uare'"), "plan.yaml:6:9: stages[1].id: must match"),
    # --- stage parameters -------------------------------------------------------------------------
    (
        "unknown-uses",
        GOOD.replace("uses: toy.square", "uses: toy.sqare"),
        "plan.yaml:7:11: stages[1].uses: unknown stage 'toy.sqare' (did you mean 'toy.square'?); see `llmplan stages`",
    ),
    (
        "broken-plugin",
        GOOD.replace("uses: toy.square", "uses: toy.broken"),
        "plan.yaml:7:11: stages[1].uses: plugin 'toy.broken' failed to load",
    ),
    (
        "param-range",
        GOOD.replace("count: 3", "count: 5000"),
        "plan.yaml:5:19: stages[0].with.count: must be <= 1000 (got 5000)",
    ),
    (
        "param-type",
        GOOD.replace("count: 3", "count: three"),
        "plan.yaml:5:19: stages[0].with.count: must be an integer (got 'three')",
    ),
    (
        "param-unknown",
        GOOD.replace("count: 3", "cuont: 3"),
        "plan.yaml:5:12: stages[0].with.cuont: unknown field (did you mean 'count'?)",
    ),
    (
        "param-literal",
        GOOD.replace("count: 3", "mode: sideways"),
        "plan.yaml:5:18: stages[0].with.mode: must be one of 'up' or 'down' (got 'sideways')",
    ),
    (
        "param-bool",
        GOOD.replace("uses: toy.total", "uses: toy.total\n    with: {fail: maybe}"),
        "plan.yaml:10:18: stages[2].with.fail: must be true or false (got 'maybe')",
    ),
    (
        "param-float",
        GOOD.replace("uses: toy.square", "uses: toy.square\n    with: {offset: 11.5}"),
        "plan.yaml:8:20: stages[1].with.offset: must be <= 10.0 (got 11.5)",
    ),
    (
        "with-not-mapping",
        GOOD.replace("with: {count: 3}", "with: 3"),
        "plan.yaml:5:11: stages[0].with: must be a mapping (got 3)",
    ),
    # --- the graph --------------------------------------------------------------------------------
    (
        "duplicate-id",
        GOOD.replace("id: total", "id: square"),
        "plan.yaml:8:9: stages[2].id: duplicate stage id 'square' (first used by stages[1])",
    ),
    (
        "cycle",
        GOOD.replace("with: {count: 3}", "with: {count: 3}\n    after: [total]"),
        "plan.yaml:3:9: stages[0].id: cycle between stages: numbers -> square -> total -> numbers",
    ),
    (
        "missing-producer",
        GOOD.replace("  - id: numbers\n    uses: toy.numbers\n    with: {count: 3}\n", ""),
        "plan.yaml:4:11: stages[0].uses: stage 'square' reads 'ext.numbers' but no stage in the plan writes it; "
        "add a stage that writes it (toy.liar, toy.numbers)",
    ),
    (
        "conflicting-writers",
        GOOD + "  - id: more\n    uses: toy.numbers\n",
        "plan.yaml:11:11: stages[3].uses: stages 'numbers' and 'more' both write 'ext.numbers' with no order between "
        "them; add `after: [numbers]` to one",
    ),
    (
        "after-unknown",
        GOOD.replace("uses: toy.total", "uses: toy.total\n    after: [nope]"),
        "plan.yaml:10:13: stages[2].after[0]: no stage with id 'nope'",
    ),
    (
        "after-self",
        GOOD.replace("uses: toy.total", "uses: toy.total\n    after: [total]"),
        "plan.yaml:10:13: stages[2].after[0]: a stage cannot run after itself",
    ),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_plan_is_reported_with_position(text: str, expected: str, tmp_path: Path, registry: Registry) -> None:
    found = findings_for(text, tmp_path, registry)
    assert any(expected in line for line in found), found


def test_recursive_alias_is_refused(tmp_path: Path, registry: Registry) -> None:
    found = findings_for("name: toy\nstages: &s\n  - *s\n", tmp_path, registry)
    assert any("recursive alias" in line for line in found), found


def test_oversized_file_is_refused_before_parsing(tmp_path: Path, registry: Registry) -> None:
    found = findings_for("name: toy\n" + "# pad\n" * 200_000, tmp_path, registry)
    assert found == ["plan.yaml:1:1: plan file is 1200010 bytes; the limit is 1048576"]


def test_missing_file(tmp_path: Path, registry: Registry) -> None:
    with pytest.raises(PlanError) as caught:
        load_plan(tmp_path / "nope.yaml", registry)
    assert str(caught.value.findings[0]).endswith("nope.yaml:1:1: file not found")


def test_every_problem_is_reported_at_once(tmp_path: Path, registry: Registry) -> None:
    text = GOOD.replace("count: 3", "count: 0").replace("uses: toy.square", "uses: toy.square\n    with: {offset: 99}")
    text += "seed: -3\n"
    found = findings_for(text, tmp_path, registry)
    assert len(found) == 3, found
    assert [line.split(": ")[1] for line in found] == ["stages[0].with.count", "stages[1].with.offset", "seed"]


def test_override_errors_name_the_override(tmp_path: Path, registry: Registry) -> None:
    found = findings_for(GOOD, tmp_path, registry, ["numbers.count=2000"])
    assert found == ["--set:1:1: numbers.count: must be <= 1000 (got 2000)"]
    found = findings_for(GOOD, tmp_path, registry, ["numbrs.count=2"])
    assert found == ["--set:1:1: numbrs.count: no stage with id 'numbrs' (did you mean 'numbers'?)"]
    found = findings_for(GOOD, tmp_path, registry, ["numbers"])
    assert found == ["--set:1:1: numbers: expected STAGE_ID.PARAM=VALUE"]


def test_good_plan_binds_with_typed_params(tmp_path: Path, registry: Registry) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(GOOD, encoding="utf-8")
    bound = load_plan(path, registry, ["numbers.count=7", "square.offset=0.5", "seed=3"])
    assert bound.plan.seed == 3
    assert bound.stage("numbers").params.count == 7
    assert bound.stage("square").params.offset == 0.5
    assert "count: 7" in bound.resolved_yaml()
