"""Issue 27's proof: `validate --deep` predicts the peak memory of a real load within 10 %, for every shipped
llama plan and a 16-slot serve. Measured as `llmplan bench` measures it (commands/bench/measure.py `load`:
the peak RSS sampled over the load, minus the RSS before), each load in its own process, so one plan's
freed pages never lower another's figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmplan.engine.cli import deep_memory_check
from llmplan.engine.plan import load_plan
from llmplan.engine.registry import discover

from .conftest import PLANS, REPO

CASES = [(path.name, []) for path in sorted(PLANS.glob("llama-*.yaml"))] + [
    ("llama-fp32.yaml", ["place.max_batch=16"])  # the slots `llmplan serve` runs with
]

# Mapped weights (a stored plan's GGUF, a conversion cache entry) come in as the first pass touches them (the
# tied head reads the whole table), so the measure touches every page the models hold before its last reading.
MEASURE = """
import json, sys
import torch
from llmplan.commands.bench.measure import load
from llmplan.engine.memory import rss_bytes
loaded = load(sys.argv[1], sys.argv[2:])
draft = getattr(loaded.ctx, "draft_model", None)
for model in (loaded.model, draft.runner.model if draft is not None else None):
    for tensor in [] if model is None else [*model.state_dict().values(), *model.buffers()]:
        if tensor.numel():  # a byte a page: every page in, no temporaries
            int(tensor.detach().reshape(-1).view(torch.uint8)[::4096].sum())
    for module in [] if model is None else model.modules():
        if hasattr(module, "blocks"):
            int(module.blocks.view(-1)[::4096].sum())
peak = max(loaded.peak_rss, rss_bytes())
print(json.dumps({"measured": peak - loaded.rss_before, "regions": loaded.regions}))
"""


@pytest.mark.parametrize(("plan", "overrides"), CASES, ids=[" ".join([p, *o]) for p, o in CASES])
def test_predicted_peak_is_within_10_percent_of_a_real_load(smollm2_dir: Path, plan: str, overrides: list[str]) -> None:
    path = PLANS / plan
    findings, estimates, memory = deep_memory_check(load_plan(path, discover(), overrides))
    assert findings == [] and memory is not None
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), *overrides], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    real = json.loads(done.stdout.strip().splitlines()[-1])
    assert real["regions"] == {k: v for k, v in estimates.items() if k != "tokenizer"}  # as the load placed them
    error = (memory.peak - real["measured"]) / real["measured"]
    assert abs(error) <= 0.10, f"predicted {memory.peak}, measured {real['measured']} ({error:+.1%}): {memory.peaks}"


@pytest.fixture(scope="module")
def big_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model of its own (113 MB of fp32 weights, so the few MB every load's imports take stay inside
    the bound), made once for both dtypes."""
    from tests.llm.tiny import make_tiny_llama
    from tests.stages.tiny_run import make_tokenizer

    root = tmp_path_factory.mktemp("memory-tiny")
    vocab = make_tokenizer(root / "probe")
    model_dir, _ = make_tiny_llama(root, n_layers=4, hidden=768, heads=12, kv_heads=4, vocab=vocab)
    make_tokenizer(model_dir)
    return model_dir


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_the_prediction_holds_on_a_tiny_model_with_16_slots(big_tiny: Path, tmp_path: Path, dtype: str) -> None:
    """The same check on that model, 16 slots of 256 tokens: each region exact, the peak within 10 %."""
    import yaml

    from tests.stages.tiny_run import load_stages

    stages = load_stages(big_tiny, place={"max_batch": 16, "kv_cache": {"max_tokens": 256}})
    next(s for s in stages if s["id"] == "convert")["with"]["dtype"] = dtype
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "device": "cpu", "seed": 0, "threads": 1, "stages": stages}))
    findings, estimates, memory = deep_memory_check(load_plan(path, discover(), []))
    assert findings == [] and memory is not None and estimates["kv_cache"] > 0
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    real = json.loads(done.stdout.strip().splitlines()[-1])
    assert real["regions"] == {k: v for k, v in estimates.items() if k != "tokenizer"}
    error = (memory.peak - real["measured"]) / real["measured"]
    assert abs(error) <= 0.10, f"predicted {memory.peak}, measured {real['measured']} ({error:+.1%}): {memory.peaks}"
