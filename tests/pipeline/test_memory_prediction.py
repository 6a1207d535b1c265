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

MEASURE = """
import json, sys
from llmplan.commands.bench.measure import load
loaded = load(sys.argv[1], sys.argv[2:])
print(json.dumps({"measured": loaded.peak_rss - loaded.rss_before, "regions": loaded.regions}))
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
    assert real["regions"] == estimates  # each region as the load placed it
    error = (memory.peak - real["measured"]) / real["measured"]
    assert abs(error) <= 0.10, f"predicted {memory.peak}, measured {real['measured']} ({error:+.1%}): {memory.peaks}"
