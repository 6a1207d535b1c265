"""A run directory read back: every file the runner and the observers write, each optional."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@dataclass
class RunData:
    run_dir: Path
    plan: dict[str, Any] | None
    stages: list[dict[str, Any]]
    metrics: dict[str, dict[str, Any]]
    memory: dict[str, Any] | None
    run: dict[str, Any] | None
    model: dict[str, Any] | None
    generations: list[dict[str, Any]] | None
    layer_timings: dict[str, Any] | None
    attention: dict[str, Any] | None
    steps: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, run_dir: Path) -> RunData:
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise FileNotFoundError(f"{run_dir}: not a run directory")
        problems = []
        plan = None
        plan_path = run_dir / "plan.resolved.yaml"
        try:
            plan = yaml.safe_load(plan_path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as bad:
            problems.append(f"plan.resolved.yaml: {bad}")
        return cls(
            run_dir=run_dir,
            plan=plan if isinstance(plan, dict) else None,
            stages=_json(run_dir / "stages.json") or [],
            metrics=_json(run_dir / "metrics.json") or {},
            memory=_json(run_dir / "memory.json"),
            run=_json(run_dir / "run.json"),
            model=_json(run_dir / "model.json"),
            generations=_json(run_dir / "generations.json"),
            layer_timings=_json(run_dir / "layer_timings.json"),
            attention=_json(run_dir / "attention.json"),
            steps=_json(run_dir / "steps.json"),
            problems=problems,
        )

    def stage_ids(self, uses: str) -> list[str]:
        """Ids of the plan's stages that use `uses` (plan order)."""
        steps = (self.plan or {}).get("stages") or []
        return [s["id"] for s in steps if isinstance(s, dict) and s.get("uses") == uses]

    def metrics_of(self, uses: str) -> dict[str, Any] | None:
        """The metrics of the first stage using `uses`, or None when the plan has no such stage (or it did not run)."""
        for stage_id in self.stage_ids(uses):
            record = self.record(stage_id)
            if record is not None and record.get("status") == "ok":
                return self.metrics.get(stage_id, {})
        return None

    def record(self, stage_id: str) -> dict[str, Any] | None:
        return next((r for r in self.stages if r.get("id") == stage_id), None)

    @property
    def observe(self) -> dict[str, Any]:
        return (self.plan or {}).get("observe") or {}

    @property
    def name(self) -> str:
        return str((self.plan or {}).get("name") or self.run_dir.name)

    @property
    def replayed(self) -> dict[str, Any] | None:
        """The cache lookup's record when this run's answers were replayed, not generated: which results, from
        which runs (`replayed_from`)."""
        for stage_id in self.stage_ids("cache.lookup"):
            lookup = self.metrics.get(stage_id) or {}
            if lookup.get("replayed"):
                return lookup.get("replayed_from") or {}
        return None

    def source_runs(self) -> list[Path]:
        """The run directories that generated the replayed answers, those that still exist."""
        found: list[Path] = []
        for source in (self.replayed or {}).get("results") or []:
            where = source.get("run_dir")
            if where and Path(where).is_dir() and Path(where) not in found:
                found.append(Path(where))
        return found

    @property
    def load_average(self) -> dict[str, Any] | None:
        return (self.run or {}).get("load_average")
