"""`load.config`: `config.json` into a typed ModelConfig; unsupported or inconsistent configs are refused."""

from __future__ import annotations

from typing import Any

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Phase, Stage
from llmplan.llm.model import ConfigError, ModelConfig

from .env_check import available_memory
from .slots import InferenceContext

# The smallest precision a plan can choose (int4) stores half a byte per weight: a config whose
# weights need more than the machine has even then is refused before anything is allocated for it.
MIN_BYTES_PER_WEIGHT = 0.5


def check_size(cfg: ModelConfig, path: Any, device: str) -> None:
    """Refuse a config that describes a model that cannot fit (e.g. num_hidden_layers: 1e9)."""
    need = int(cfg.parameter_count() * MIN_BYTES_PER_WEIGHT)
    what, available = available_memory(device)
    if need > available:
        raise StageFailure(
            f"{path}: describes {cfg.parameter_count():,} weights (num_hidden_layers {cfg.n_layers}, "
            f"hidden_size {cfg.dim}, vocab_size {cfg.vocab_size}): at least {need / (1 << 30):.1f} GiB "
            f"even as int4, more than the {available / (1 << 30):.1f} GiB of {what}; refused"
        )


class LoadConfig(Stage):
    """Parse config.json (layers, heads, KV heads, RoPE, norms, vocabulary, special ids)."""

    name = "load.config"
    phase = Phase.LOAD
    reads = ("model_source",)
    writes = ("model_config",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.model_source is not None
        try:
            cfg = ModelConfig.from_file(ctx.model_source.model_dir / "config.json")
        except ConfigError as bad:
            raise StageFailure(str(bad)) from None
        check_size(cfg, ctx.model_source.model_dir / "config.json", ctx.device or "cpu")
        ctx.model_config = cfg
        ctx.metrics.set("layers", cfg.n_layers)
        ctx.metrics.set("dim", cfg.dim)
        ctx.metrics.set("heads", f"{cfg.n_heads}q/{cfg.n_kv_heads}kv")
        ctx.metrics.set("vocab", cfg.vocab_size)

    def check(self, params: Any, deep: DeepCheck) -> None:
        model_dir = deep.facts.get("model_dir")
        if model_dir is None:
            return
        try:
            cfg = ModelConfig.from_file(model_dir / "config.json")
            check_size(cfg, model_dir / "config.json", deep.facts.get("device", "cpu"))
        except (ConfigError, StageFailure) as bad:
            deep.problem(str(bad))
            return
        deep.facts["model_config"] = cfg
