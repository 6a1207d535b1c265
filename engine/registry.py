"""Stage plugins and the context class, discovered through entry points.

Built-in stages are registered exactly like third-party ones (group `llmplan.stages`), so the engine
has no list of stages of its own. Each class is checked when it is registered: a name, a Params
model that forbids unknown keys, and slots that exist on the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

from pydantic import BaseModel

from .context import Context
from .stage import Stage

STAGE_GROUP = "llmplan.stages"
CONTEXT_GROUP = "llmplan.context"


class RegistryError(Exception):
    pass


@dataclass
class Registry:
    context_cls: type[Context] = Context
    stages: dict[str, type[Stage]] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)  # entry point name -> why it failed to load

    def add(self, stage_cls: type[Stage], name: str | None = None) -> None:
        name = name or getattr(stage_cls, "name", None)
        if not name:
            raise RegistryError(f"{stage_cls.__qualname__}: a stage needs a `name`")
        if not (isinstance(stage_cls, type) and issubclass(stage_cls, Stage)):
            raise RegistryError(f"{name}: {stage_cls!r} is not a Stage subclass")
        params = stage_cls.Params
        if not (isinstance(params, type) and issubclass(params, BaseModel)):
            raise RegistryError(f"{name}: Params must be a pydantic model")
        if params.model_config.get("extra") != "forbid":
            raise RegistryError(f"{name}: Params must forbid unknown keys (extra='forbid')")
        declared = (*stage_cls.reads, *stage_cls.optional_reads, *stage_cls.writes, *stage_cls.fills, *stage_cls.edits)
        for slot in declared:
            if not self.context_cls.is_slot(slot):
                known = ", ".join(sorted(self.context_cls.slot_names()))
                raise RegistryError(f"{name}: unknown context slot {slot!r} (slots: {known}; or use 'ext.*')")
        if name in self.stages and self.stages[name] is not stage_cls:
            raise RegistryError(f"{name}: registered twice ({self.stages[name].__module__} and {stage_cls.__module__})")
        self.stages[name] = stage_cls

    def get(self, name: str) -> type[Stage] | None:
        return self.stages.get(name)

    def names(self) -> list[str]:
        return sorted(self.stages)


def discover() -> Registry:
    """Load the context class and every stage plugin installed in this environment."""
    context_cls: type[Context] = Context
    contexts = list(entry_points(group=CONTEXT_GROUP))
    if contexts:
        context_cls = _load(contexts[0])
    registry = Registry(context_cls=context_cls)
    for point in entry_points(group=STAGE_GROUP):
        try:
            registry.add(_load(point), point.name)
        except Exception as bad:  # a broken plugin must not take the others down
            registry.broken[point.name] = f"{point.value}: {bad}"
    return registry


def _load(point: EntryPoint) -> type:
    return point.load()
