"""Issue 27: a `llmplan serve --slots 16` holds the bytes `validate --deep` predicts for 16 slots, and still
holds them after 16 concurrent requests: per region, for a tiny checkpoint of the llama, Qwen2 and Gemma 3
families (the real models' peak RSS is benchmarks/memory_plan.py's)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from llmplan.commands.serve.app import ServerSettings
from llmplan.engine.cli import deep_memory_check
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover

from .conftest import LiveServer, hold_after, write_serve_plan

SLOTS = 16
FAMILIES = ["llama", "qwen2", "gemma3_text"]  # the shipped plans' families


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.llm.archs import make_tiny
    from tests.stages.tiny_run import make_tiny_model_dir, make_tokenizer

    root = tmp_path_factory.mktemp(f"serve-memory-{request.param}")
    if request.param == "llama":
        return make_tiny_model_dir(root, n_layers=2)[0]
    vocab = make_tokenizer(root / "tok-probe")  # the model's vocabulary covers the tokenizer's
    found, _ = make_tiny(root, request.param, vocab_size=vocab)
    make_tokenizer(found)
    return found


def cache_bytes(cache: object) -> int:
    """The KV cache's tensors, counted from the tensors themselves."""
    store = cache.store  # type: ignore[attr-defined]
    held = sum(k.nbytes + v.nbytes for k, v in store.groups)
    return held + sum(t.nbytes for t in (cache.valid, cache.pos, cache.next_pos))  # type: ignore[attr-defined]


def test_a_16_slot_serve_holds_the_predicted_regions_through_16_concurrent_requests(
    model_dir: Path, tmp_path: Path
) -> None:
    plan = write_serve_plan(tmp_path, model_dir, slots=2, context=64)  # --slots 16 replaces the plan's 2
    findings, estimates, _ = deep_memory_check(load_plan(plan, discover(), [f"place.max_batch={SLOTS}"]))
    assert findings == []
    with LiveServer(plan, ServerSettings(max_queue=64), slots=SLOTS) as served:
        ctx = served.host.plan.context
        placed = {region: n for region, n in estimates.items() if region != "tokenizer"}  # not a placed region
        assert ctx.metrics.get("place", "regions") == placed
        cache, model = ctx.kv_cache, ctx.model
        assert cache_bytes(cache) == estimates["kv_cache"]
        answers: dict[int, int] = {}

        def ask(i: int) -> None:
            body = {"model": "m", "prompt": f"request {i}: the", "max_tokens": 12, "ignore_eos": True}
            done = httpx.post(f"{served.url}/completions", json=body, timeout=60, trust_env=False)
            answers[i] = done.status_code if done.status_code != 200 else done.json()["usage"]["completion_tokens"]

        gate = hold_after(served.host.loop, 0)  # no step until all 16 are in: they run side by side
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(SLOTS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        # pending, not in_flight: a request is in flight before its stages submit it to the loop
        while served.host.loop.pending < SLOTS and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        for t in threads:
            t.join(60)
        assert answers == {i: 12 for i in range(SLOTS)}
        assert served.host.scheduler.stats.busy_max == SLOTS  # all 16 were in their slots at once
        # nothing grew or was reallocated under the load: the cache and the weights are the predicted bytes
        assert cache_bytes(cache) == estimates["kv_cache"] and ctx.kv_cache is cache
        assert sum({p.data_ptr(): p.nbytes for p in model.parameters()}.values()) <= estimates["weights"]
