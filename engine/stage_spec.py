"""A plan's step as written (`StageSpec`, the YAML's schema) and as bound to its plugin (`BoundStage`).

Below both the plan (plan.py, which validates and binds) and the stage graph (graph.py, which orders bound
stages), so neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .stage import Stage

ID_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StageSpec(Strict):
    id: str = Field(pattern=ID_PATTERN, description="unique name of this step; --set and --until use it")
    uses: str = Field(min_length=1, description="the registered stage to run (see `llmplan stages`)")
    with_: dict[str, Any] = Field(default_factory=dict, alias="with", description="the stage's parameters")
    after: list[str] = Field(default_factory=list, description="extra ordering: run after these stage ids")
    description: str = ""


@dataclass
class BoundStage:
    """A plan step joined to its registered class and validated parameters."""

    index: int
    spec: StageSpec
    cls: type[Stage]
    params: Any

    @property
    def id(self) -> str:
        return self.spec.id
