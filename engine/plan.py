"""Plans: the Pydantic schema of a YAML plan, `--set` overrides, and validation into a bound plan.

Validation never stops at the first problem: it collects every finding it can (schema, each stage's
parameters, the graph) so that `llmplan validate` reports them all at once, each with its position.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, create_model, field_validator

from .findings import Finding, PlanError, format_path
from .findings import Path as FieldPath
from .graph import PlanGraph, build_graph, dag_findings, link_findings
from .messages import describe, suggest
from .observing import ObserveSettings
from .registry import Registry
from .stage_spec import ID_PATTERN, BoundStage, StageSpec, Strict
from .strict import strict_numbers
from .yaml_source import Source, load_file, load_text

MAX_STAGES = 200


class _Numbers(Strict):
    """Numeric fields take numbers only (no `true` -> 1); not on StageSpec, whose `uses` is a discriminator."""

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return strict_numbers(cls, value, info)


# "auto" (a running cluster found from this machine), "local" (start one in this process), ray://HOST:PORT
# (Ray Client) or HOST:PORT (a head node's GCS address), as `ray.init(address=...)` takes them.
RAY_ADDRESS = r"^(auto|local|ray://[A-Za-z0-9._\-\[\]:]+:\d{1,5}|[A-Za-z0-9._\-\[\]:]+:\d{1,5})$"


class Executor(_Numbers):
    """Where the request stages run: in this process (local) or on a Ray cluster, N replicas of the plan."""

    kind: Literal["local", "ray"] = Field("local", description="local: this process; ray: Ray Data replicas")
    address: str | None = Field(
        None, description="Ray cluster: auto | local | ray://HOST:PORT | HOST:PORT; None = start one here"
    )
    replicas: int = Field(1, ge=1, le=4096, description="copies of the plan, each loading the model once")
    threads_per_replica: int = Field(1, ge=1, le=512, description="CPUs Ray reserves for a replica; its torch threads")
    gpus_per_replica: float = Field(0, ge=0, le=64, description="GPUs Ray reserves for a replica (fractions allowed)")
    batch_size: int = Field(16, ge=1, le=65536, description="requests handed to a replica at a time")
    max_restarts: int = Field(3, ge=0, le=1000, description="times Ray restarts a replica that died")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and not re.match(RAY_ADDRESS, value):
            raise ValueError(f"expected auto, local, ray://HOST:PORT or HOST:PORT (got {value!r})")
        return value


class Plan(_Numbers):
    version: Literal[1] = 1
    name: str = Field(pattern=ID_PATTERN)
    description: str = ""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    threads: int | None = Field(None, ge=1, le=512, description="CPU threads for torch; None = library default")
    runs_dir: str = Field("runs", description="where run directories go; a relative path is under the data home")
    observe: ObserveSettings = Field(default_factory=ObserveSettings)
    executor: Executor = Field(default_factory=Executor, description="where requests run (llmplan run)")
    stages: list[StageSpec] = Field(min_length=1, max_length=MAX_STAGES)

    @field_validator("runs_dir")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("must not contain NUL")
        return value


@cache
def plan_model(observe: type[ObserveSettings]) -> type[Plan]:
    """The plan schema with the `observe:` block the installed context plugin defines (`Context.Observe`)."""
    if observe is ObserveSettings:
        return Plan
    return create_model(  # type: ignore[call-overload, no-any-return]
        "Plan", __base__=Plan, observe=(observe, Field(default_factory=observe))
    )


@dataclass
class BoundPlan:
    """A validated plan; `graph` is its stage graph, built once (by `bind`, or here when made by hand)."""

    plan: Plan
    stages: list[BoundStage]
    source: Source
    raw: dict[str, Any]
    graph: PlanGraph = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.graph is None:

            self.graph = PlanGraph.build(self.stages)

    def with_params(self, params: Mapping[str, Any]) -> BoundPlan:
        """This plan with some stages' parameters replaced (one request's own); the graph is shared, not rebuilt:
        the structure is the plan's, the parameters are read from `stage(id)`."""
        stages = [replace(b, params=params[b.id]) if b.id in params else b for b in self.stages]
        return replace(self, stages=stages)

    def stage(self, stage_id: str) -> BoundStage:
        for bound in self.stages:
            if bound.id == stage_id:
                return bound
        raise KeyError(stage_id)

    def resolved_yaml(self) -> str:
        """The plan as it ran: overrides applied, every default filled in."""
        data = self.plan.model_dump(mode="json", by_alias=True, exclude={"stages"})
        data["stages"] = [
            {
                "id": b.id,
                "uses": b.spec.uses,
                "with": b.params.model_dump(mode="json"),
                **({"after": b.spec.after} if b.spec.after else {}),
            }
            for b in self.stages
        ]
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


# --- overrides ---------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """'generate.temperature=0' -> (['generate', 'temperature'], 0); the value is a YAML scalar."""
    if "=" not in text:
        raise PlanError([Finding("--set", 1, 1, text, "expected STAGE_ID.PARAM=VALUE")])
    key, _, value_text = text.partition("=")
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise PlanError([Finding("--set", 1, 1, text, "expected STAGE_ID.PARAM=VALUE")])
    try:
        value = load_text(value_text, "--set").data if value_text.strip() else ""
    except PlanError as bad:
        raise PlanError([Finding("--set", 1, 1, key, f"bad value: {bad.findings[0].message}")]) from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[tuple[list[str], Any]]) -> dict[str, Any]:
    """Apply `--set` overrides: a stage id then a path inside its `with`, or a top-level plan key."""
    data = copy.deepcopy(data)
    stages = data.get("stages") if isinstance(data.get("stages"), list) else []
    ids = [s.get("id") for s in stages if isinstance(s, dict)]
    for parts, value in overrides:
        head, rest = parts[0], parts[1:]
        if head in ids and rest:
            stage = stages[ids.index(head)]
            target = stage.setdefault("with", {})
            if not isinstance(target, dict):
                raise PlanError([Finding("--set", 1, 1, ".".join(parts), "the stage's `with` is not a mapping")])
        elif head in Plan.model_fields and head != "stages":
            target, rest = data, parts
        else:
            hint = suggest(head, [i for i in ids if isinstance(i, str)])
            raise PlanError([Finding("--set", 1, 1, ".".join(parts), f"no stage with id {head!r}{hint}")])
        for key in rest[:-1]:
            nxt = target.setdefault(key, {})
            if not isinstance(nxt, dict):
                raise PlanError([Finding("--set", 1, 1, ".".join(parts), f"{key!r} is not a mapping")])
            target = nxt
        target[rest[-1]] = value
    return data


# --- validation --------------------------------------------------------------------------------


def load_plan(
    path: str | Path,
    registry: Registry,
    overrides: list[str] | None = None,
) -> BoundPlan:
    """Load, override, validate and bind a plan; raise PlanError with every finding."""
    return bind(load_file(path), registry, overrides)


def bind(source: Source, registry: Registry, overrides: list[str] | None = None) -> BoundPlan:

    if not isinstance(source.data, dict):
        kind = "empty" if source.data is None else type(source.data).__name__
        raise PlanError([source.finding((), f"a plan must be a mapping with `name` and `stages` (got {kind})")])
    parsed = [parse_override(text) for text in overrides or []]
    data = apply_overrides(source.data, parsed)
    overridden = {tuple(p) for p, _ in parsed}

    findings: list[Finding] = []
    plan: Plan | None = None
    schema = plan_model(registry.context_cls.Observe)
    try:
        plan = schema.model_validate(data)
    except ValidationError as bad:
        findings += _findings(bad, source, (), schema, data, overridden)
    if plan is None:
        # Schema errors elsewhere must not hide errors in stage parameters: validate those we can.
        for index, raw in enumerate(data.get("stages") or [] if isinstance(data.get("stages"), list) else []):
            if isinstance(raw, dict) and isinstance(raw.get("uses"), str):
                _, problems = _stage_params(index, raw.get("uses"), raw.get("with") or {}, source, registry, overridden)
                findings += problems
        raise PlanError(_dedupe(findings))

    bound: list[BoundStage] = []
    for index, spec in enumerate(plan.stages):
        stage_cls = registry.get(spec.uses)
        params, problems = _stage_params(index, spec.uses, spec.with_, source, registry, overridden)
        findings += problems
        if stage_cls is not None and not problems:
            bound.append(BoundStage(index, spec, stage_cls, params))
    if not findings:
        findings += link_findings(bound, source, registry)
    dag = None
    if not findings:
        dag = build_graph(bound)  # the plan's one graph: checked here, then kept by the bound plan
        findings += dag_findings(dag, bound, source)
    if findings or dag is None:
        raise PlanError(_dedupe(findings))
    return BoundPlan(plan=plan, stages=bound, source=source, raw=data, graph=PlanGraph(dag))


def _stage_params(
    index: int,
    uses: Any,
    params: Any,
    source: Source,
    registry: Registry,
    overridden: set[tuple[str, ...]],
) -> tuple[Any, list[Finding]]:
    """A stage's `with:` validated once, by its Params: the parameters, or None and what is wrong with them."""
    stage_cls = registry.get(uses) if isinstance(uses, str) else None
    where: FieldPath = ("stages", index)
    if stage_cls is None:
        if isinstance(uses, str) and uses in registry.broken:
            return None, [source.finding((*where, "uses"), f"plugin {uses!r} failed to load: {registry.broken[uses]}")]
        hint = suggest(str(uses), registry.names())
        return None, [source.finding((*where, "uses"), f"unknown stage {uses!r}{hint}; see `llmplan stages`")]
    if not isinstance(params, dict):
        return None, [source.finding((*where, "with"), f"must be a mapping (got {type(params).__name__})")]
    try:
        # A parameter may name a file relative to the plan (a format's JSON Schema): the context says where.
        context = {"plan_dir": str(Path(source.file).resolve().parent)}
        return stage_cls.Params.model_validate(params, context=context), []
    except ValidationError as bad:
        return None, _findings(bad, source, (*where, "with"), stage_cls.Params, params, overridden, stage_index=index)


def _findings(
    error: ValidationError,
    source: Source,
    prefix: FieldPath,
    model: type[BaseModel],
    data: Any,
    overridden: set[tuple[str, ...]],
    stage_index: int | None = None,
) -> list[Finding]:
    found = []
    for item in error.errors():
        loc = tuple(part for part in item["loc"] if not _is_union_branch(part))
        # An error may say where inside the value it lies (a schema keyword): `field_path`, under the field.
        inner = getattr((item.get("ctx") or {}).get("error"), "field_path", ())
        path = (*prefix, *loc, *inner)
        allowed = _allowed_keys(model, loc[:-1]) if item["type"] == "extra_forbidden" else ()
        message = describe(item, allowed)
        is_key = item["type"] == "extra_forbidden" or bool(inner)
        override = _override_for(source, path, overridden, stage_index)
        if override is not None:
            found.append(Finding("--set", 1, 1, override, message))
        else:
            found.append(source.finding(path, message, key=is_key, field_text=format_path(path)))
    return found


def _is_union_branch(part: Any) -> bool:
    # pydantic puts union branch names ("int", "list[str]", "function-after[...]") in the loc
    return isinstance(part, str) and ("[" in part or part in {"int", "str", "float", "bool", "none"})


def _override_for(
    source: Source, path: FieldPath, overridden: set[tuple[str, ...]], stage_index: int | None
) -> str | None:
    """If a finding concerns a value set by --set, name the override instead of a file position."""
    if not overridden:
        return None
    data = source.data if isinstance(source.data, dict) else {}
    stages = data.get("stages") if isinstance(data.get("stages"), list) else []
    if stage_index is not None and stage_index < len(stages) and isinstance(stages[stage_index], dict):
        stage_id = stages[stage_index].get("id")
        inner = tuple(str(p) for p in path[3:])
        for parts in overridden:
            if parts[0] == stage_id and tuple(parts[1:]) == inner[: len(parts) - 1]:
                return ".".join(parts)
    else:
        flat = tuple(str(p) for p in path)
        for parts in overridden:
            if tuple(parts) == flat[: len(parts)]:
                return ".".join(parts)
    return None


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = _model_of(field.annotation)
        if current is None:
            return []
    fields = getattr(current, "model_fields", {})
    return [f.alias or name for name, f in fields.items()]


def _model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen: set[str] = set()
    unique = []
    for finding in findings:
        if str(finding) not in seen:
            seen.add(str(finding))
            unique.append(finding)
    return sorted(unique, key=lambda f: (f.file, f.line, f.column))
