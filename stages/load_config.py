"""`load.config`: `config.json` into a typed ModelConfig; unsupported or inconsistent configs are refused."""

from __future__ import annotations

from typing import Any

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Phase, Stage
from llmplan.llm.config import ConfigError, ModelConfig

from .slots import InferenceContext


class LoadConfig(Stage):
    """Parse config.json (layers, heads, KV heads, RoPE, norms, vocabulary, special ids)."""

    name = "load.config"
    phase = Phase.LOAD
    reads = ("model_source",)
    writes = ("model_config",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.model_source is not None
        try:
            ctx.model_config = ModelConfig.from_file(ctx.model_source.model_dir / "config.json")
        except ConfigError as bad:
            raise StageFailure(str(bad)) from None
        cfg = ctx.model_config
        ctx.metrics.set("layers", cfg.n_layers)
        ctx.metrics.set("dim", cfg.dim)
        ctx.metrics.set("heads", f"{cfg.n_heads}q/{cfg.n_kv_heads}kv")
        ctx.metrics.set("vocab", cfg.vocab_size)

    def check(self, params: Any, deep: DeepCheck) -> None:
        model_dir = deep.facts.get("model_dir")
        if model_dir is None:
            return
        try:
            deep.facts["model_config"] = ModelConfig.from_file(model_dir / "config.json")
        except ConfigError as bad:
            deep.problem(str(bad))
