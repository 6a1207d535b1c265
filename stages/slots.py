"""The inference context: one typed field per slot that stages read and write.

Slot names are field names, so a stage's `reads`/`writes` are checked against this class when it is
registered, and the graph the engine derives from them is the data flow of inference:

    environment → model_source → model_config, tokenizer → shard_manifest (verified) → host_weights
    → weights (converted) → model, kv_cache, model_runner (→ draft_model) → requests → generations → answers
    → completions → deliveries, cache_record → release_report
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from llmplan.engine.context import Context
from llmplan.engine.observing import ObserveSettings

from . import observe_settings

if TYPE_CHECKING:
    from llmplan.llm.generation import DraftModel, EngineLoop, ModelRunner
    from llmplan.llm.kv import KVCache
    from llmplan.llm.model import ModelConfig, Transformer
    from llmplan.llm.text import Tokenizer
    from llmplan.llm.trust import ShardManifest

    from .types import ConvertedWeights, Environment, HostWeights, ModelSource, Request, Result


@dataclass
class InferenceContext(Context):
    Observe: ClassVar[type[ObserveSettings]] = observe_settings.Observe

    environment: Environment | None = None
    model_source: ModelSource | None = None
    model_config: ModelConfig | None = None
    tokenizer: Tokenizer | None = None
    shard_manifest: ShardManifest | None = None
    host_weights: HostWeights | None = None
    weights: ConvertedWeights | None = None
    model: Transformer | None = None
    kv_cache: KVCache | None = None
    model_runner: ModelRunner | None = None  # the model on the backend chosen at load, bound to kv_cache
    draft_model: DraftModel | None = None  # speculative decoding's draft (load.draft), its cache like kv_cache's
    # The engine loop a resident plan's owner steps (the host, serving); compute.generate submits to it.
    # None: compute.generate runs and steps a loop of its own (`llmplan run`).
    engine_loop: EngineLoop | None = None
    requests: list[Request] | None = None
    generations: list[Result] | None = None
    answers: list[Result] | None = None
    completions: list[Result] | None = None
    deliveries: list[str] | None = None
    cache_record: dict[str, Any] | None = None
    release_report: dict[str, Any] | None = None
