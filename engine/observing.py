"""What a plan's `observe:` block may ask for: the engine's part, and the hook that lets a plugin add its own.

The engine samples memory itself (the runner's sampler thread), so `memory_interval_ms` is its field. What
else can be observed (per-layer timings, attention maps) is the inference plugin's business: its context
class names a subclass of `ObserveSettings` (`Context.Observe`), and the plan schema takes that subclass.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .strict import strict_numbers


class Settings(BaseModel):
    """A block of plan settings: unknown keys are errors; numbers are numbers (no `true` -> 1)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return strict_numbers(cls, value, info)


class ObserveSettings(Settings):
    """What to record beyond the always-on stage timings."""

    memory_interval_ms: int = Field(50, ge=0, le=10_000, description="RSS/device memory sampling; 0 = off")
