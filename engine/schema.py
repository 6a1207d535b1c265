"""JSON Schema of plans for editors (yaml-language-server), with each stage's own parameters.

`with:` is typed per stage: the schema is a union of one branch per registered stage, told apart by
`uses`, so an editor completes and checks parameters as `validate` would.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, create_model

from .plan import plan_model
from .registry import Registry
from .stage_spec import ID_PATTERN, StageSpec


def plan_schema(registry: Registry) -> dict[str, Any]:
    plan = plan_model(registry.context_cls.Observe)
    branches = []
    for name in registry.names():
        stage_cls = registry.stages[name]
        branch = create_model(  # type: ignore[call-overload]
            f"Stage_{name.replace('.', '_')}",
            __base__=StageSpec,
            uses=(Literal[name], Field(description=stage_cls.summary())),  # type: ignore[valid-type]
            with_=(stage_cls.Params, Field(default_factory=stage_cls.Params, alias="with")),
        )
        branches.append(branch)
    if not branches:
        return plan.model_json_schema(by_alias=True)
    union = branches[0] if len(branches) == 1 else _union(branches)
    typed = create_model(  # type: ignore[call-overload]
        "Plan",
        __base__=plan,
        stages=(list[union], Field(min_length=1)),  # type: ignore[valid-type]
    )
    schema = typed.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "llmplan plan"
    schema.setdefault("properties", {}).setdefault("name", {})["pattern"] = ID_PATTERN
    return schema


def _union(branches: list[Any]) -> Any:
    from typing import Annotated, Union

    return Annotated[Union[tuple(branches)], Field(discriminator="uses")]  # noqa: UP007
