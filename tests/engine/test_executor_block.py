"""The plan's `executor:` block: validated like every other field, overridden by `llmplan run`'s flags, and
handed to the executor plugin it names (the engine imports none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmplan.engine.cli import build_parser, main, plan_overrides
from llmplan.engine.findings import PlanError
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import Registry
from llmplan.engine.yaml_source import load_file

PLAN = """\
name: toy
executor: {kind: ray, replicas: 2, address: auto}
stages:
  - {id: numbers, uses: toy.numbers, with: {count: 3}}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_block_is_read_and_defaults_to_local(tmp_path: Path, registry: Registry) -> None:
    bound = load_plan(_write(tmp_path, PLAN), registry)
    executor = bound.plan.executor
    assert (executor.kind, executor.replicas, executor.address, executor.threads_per_replica) == ("ray", 2, "auto", 1)
    plain = load_plan(
        _write(tmp_path, PLAN.replace("executor: {kind: ray, replicas: 2, address: auto}\n", "")), registry
    )
    assert plain.plan.executor.kind == "local"
    assert "executor:" in bound.resolved_yaml()


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ("{kind: spark}", "plan.yaml:2:18: executor.kind: must be one of 'local' or 'ray' (got 'spark')"),
        ("{kind: ray, replicas: 0}", "plan.yaml:2:33: executor.replicas: must be >= 1 (got 0)"),
        ("{kind: ray, gpus_per_replica: -1}", "plan.yaml:2:41: executor.gpus_per_replica: must be >= 0.0 (got -1)"),
        (
            "{kind: ray, address: 'http://head'}",
            "plan.yaml:2:32: executor.address: expected auto, local, ray://HOST:PORT or HOST:PORT (got 'http://head')",
        ),
        ("{kind: ray, replica: 2}", "plan.yaml:2:23: executor.replica: unknown field (did you mean 'replicas'?)"),
    ],
)
def test_a_wrong_value_is_one_finding_with_its_position(
    tmp_path: Path, registry: Registry, block: str, expected: str
) -> None:
    path = _write(tmp_path, PLAN.replace("{kind: ray, replicas: 2, address: auto}", block))
    with pytest.raises(PlanError) as caught:
        load_plan(path, registry)
    found = [str(f).replace(str(path), "plan.yaml") for f in caught.value.findings]
    assert len(found) == 1 and found[0].startswith(expected), found


def test_run_flags_override_the_block(tmp_path: Path, registry: Registry) -> None:
    path = _write(tmp_path, PLAN)
    args = build_parser().parse_args(
        ["run", str(path), "--executor", "ray", "--address", "ray://head:10001", "--replicas", "8",
         "--threads-per-replica", "4", "--gpus-per-replica", "0.5"]
    )  # fmt: skip
    executor = load_plan(path, registry, plan_overrides(args, registry, load_file(path))).plan.executor
    assert (executor.address, executor.replicas, executor.threads_per_replica, executor.gpus_per_replica) == (
        "ray://head:10001",
        8,
        4,
        0.5,
    )


def test_validate_checks_the_block(tmp_path: Path, registry: Registry, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, PLAN.replace("replicas: 2", "replicas: many"))
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().out.strip() == f"{path}:2:33: executor.replicas: must be an integer (got 'many')"


def test_until_does_not_go_with_another_executor(
    tmp_path: Path, registry: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", str(_write(tmp_path, PLAN)), "--until", "numbers", "--out", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "--until runs part of the plan in this process; it does not go with executor 'ray'"
    ]


def test_an_executor_nobody_provides_is_one_line(
    tmp_path: Path, registry: Registry, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmplan.engine import executors

    monkeypatch.setattr(executors, "entry_points", lambda group: [])
    assert main(["run", str(_write(tmp_path, PLAN)), "--out", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "executor 'ray': no installed package provides it (pip install 'llmplan[ray]')"
    ]
