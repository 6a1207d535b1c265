"""The inference plugin's part of a plan's `observe:` block (the engine's part is memory sampling)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from llmplan.engine.observing import ObserveSettings, Settings

# A negative head would wrap around (head -1 silently became head 8): refused, not reinterpreted.
# Layers keep their documented Python-style negative index (-1 = the last layer).
Index = Annotated[int, Field(ge=0)]


class AttentionCapture(Settings):
    layers: list[int] = Field(default_factory=lambda: [0], max_length=64)
    heads: list[Index] = Field(default_factory=lambda: [0], max_length=64)
    max_tokens: int = Field(64, ge=1, le=512)


class Observe(ObserveSettings):
    """What to record beyond the always-on stage timings and memory."""

    layer_timings: bool = Field(False, description="per-layer attention/MLP times (hooks; off = no hooks)")
    attention: AttentionCapture | None = Field(None, description="capture attention weights for heatmaps")
