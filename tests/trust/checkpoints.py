"""A tiny, really sharded Llama checkpoint with a complete SHA256SUMS, and a plan that loads it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from llmplan.llm.trust.manifest import write_sha256sums
from tests.stages.tiny_run import load_stages

LISTED = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json")


def make_checkpoint(root: Path) -> Path:
    """3 layers, several shards, a trained tokenizer; SHA256SUMS over every file the load reads."""
    from tests.llm.tiny import make_tiny_llama
    from tests.stages.tiny_run import make_tokenizer

    vocab = make_tokenizer(root / "probe")
    model_dir, _ = make_tiny_llama(root, n_layers=3, vocab=vocab, hidden=64, heads=4, kv_heads=2, max_shard_size="60KB")
    make_tokenizer(model_dir)
    names = [p.name for p in model_dir.glob("*.safetensors")] + [n for n in LISTED if (model_dir / n).exists()]
    write_sha256sums(model_dir, names)
    return model_dir


def plan_for(
    tmp: Path,
    model_dir: Path,
    *,
    hashes: str = "required",
    extra: list[dict[str, Any]] | None = None,
    max_new_tokens: int = 4,
    name: str = "trust",
) -> Path:
    plan: dict[str, Any] = {
        "name": name,
        "device": "cpu",
        "seed": 0,
        "threads": 1,
        "observe": {"memory_interval_ms": 0},
        "stages": [
            *load_stages(model_dir, hashes=hashes, place={"kv_cache": {"max_tokens": 64}}),
            {"id": "prompt", "uses": "compute.tokenize", "with": {"messages": [{"role": "user", "content": "Hello"}]}},
            {
                "id": "generate",
                "uses": "compute.generate",
                "with": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, "stream": False},
            },
            *(extra or []),
        ],
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False), encoding="utf-8")
    return path


def private_cache_home(root: Path) -> Iterator[Path]:
    """LLMPLAN_CACHE pointed at `root` while the caller's fixture lives (the hash key and records go there), with
    the compiled kernels copied in so that nothing is rebuilt; the old value restored afterwards."""
    real = Path(os.environ.get("LLMPLAN_CACHE") or Path.home() / ".cache" / "llmplan") / "kernels"
    if real.is_dir():
        shutil.copytree(real, root / "kernels")
    old = os.environ.get("LLMPLAN_CACHE")
    os.environ["LLMPLAN_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("LLMPLAN_CACHE", None)
    else:
        os.environ["LLMPLAN_CACHE"] = old
