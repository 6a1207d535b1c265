"""One replica of a plan on a Ray worker: the resident stages load once, in the constructor; every batch of
requests runs the plan's request stages (generation through the scheduler) and comes back as rows.

Ray Data calls it as a callable class (`map_batches`); it imports no Ray itself. The requests arrive already
tokenized by the driver (`given`), so the tokenize stage does not run here; the stages that write outside the
replica (output.write's sinks, the results database) and the cache lookup are the driver's (one writer), so
they do not run here either. Each request comes back as one row: its result object (`llmplan.result/v2`), the
results-database row with this replica's cache key, and where and how fast it ran.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llmplan.engine.cli import new_context
from llmplan.engine.plan import BoundPlan, bind
from llmplan.engine.registry import discover
from llmplan.engine.serving import ResidentPlan
from llmplan.engine.stage import Phase
from llmplan.engine.yaml_source import Source
from llmplan.stages import completion_rendering as output_format
from llmplan.stages.cache_stages import generation_params, key_context, request_key, result_row
from llmplan.stages.types import Request

GENERATE, TOKENIZE, DETOKENIZE = "compute.generate", "compute.tokenize", "output.detokenize"
DRIVER_STAGES = frozenset({"output.write", "output.cache", "cache.lookup"})  # run by the driver, or not at all


class ReplicaError(Exception):
    """The replica cannot run this plan; the message says why (the driver shows it as one line)."""


def key_stage(bound: BoundPlan) -> str:
    """The generation stage the results database keys on: output.cache's `generate_stage`, else the plan's
    compute.generate stage (what the local cache stages would use)."""
    for stage in bound.stages:
        if stage.spec.uses in ("output.cache", "cache.lookup"):
            return str(stage.params.generate_stage)
    return next(s.id for s in bound.stages if s.spec.uses == GENERATE)


def encode_request(request: Request) -> str:
    return json.dumps(dataclasses.asdict(request), ensure_ascii=False)


def decode_request(text: str) -> Request:
    return Request(**json.loads(text))


class PlanReplica:
    def __init__(self, plan_file: str, plan_data: dict[str, Any], overrides: Sequence[str], cwd: str) -> None:
        if Path(cwd).is_dir():  # the plan's relative paths mean here what they meant to the driver
            os.chdir(cwd)
        registry = discover()
        bound = bind(Source(plan_file, plan_data), registry, list(overrides))
        self.run_dir = Path(tempfile.mkdtemp(prefix="llmplan-replica-"))
        atexit.register(shutil.rmtree, self.run_dir, True)
        # json_mode: a replica never streams text to a terminal
        self.plan = ResidentPlan(bound, lambda: new_context(registry, bound, json_mode=True), self.run_dir)
        if self.plan.stage_by_use(DETOKENIZE) is None:
            raise ReplicaError(f"{plan_file}: the ray executor needs an {DETOKENIZE} stage (it makes the results)")
        started = time.perf_counter()
        loaded = self.plan.load()
        if loaded.exit_code:
            raise ReplicaError(f"loading the plan failed: {loaded.message}")
        self.load_s = sum(r.wall_s for r in loaded.records if r.phase == str(Phase.LOAD))
        self.start_s = time.perf_counter() - started
        self.skip = {s for s in self.plan.request_order if self.plan.graph.nodes[s]["stage"].spec.uses in DRIVER_STAGES}
        ctx = self.plan.context
        assert ctx is not None and ctx.model_source is not None
        self.key_stage = key_stage(bound)
        self.key_context = key_context(ctx, self.key_stage)
        self.model = ctx.model_source.fingerprint
        self.name = bound.plan.name
        self.replica = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        requests = [decode_request(str(text)) for text in batch["request"]]
        started = time.perf_counter()
        run = self.plan.run_request(skip=self.skip, given={"requests": requests})
        ctx = run.context
        wall = time.perf_counter() - started
        gen_params, seed = generation_params(ctx, self.key_stage)
        keys = {r.id: request_key(ctx, r, gen_params, seed, self.key_context) for r in requests}
        completions = ctx.completions or []
        results = [
            output_format.result_object(c, plan=self.name, model=self.model, load_s=self.load_s) for c in completions
        ]
        rows = [dataclasses.asdict(result_row(c, keys.get(c.request_id))) for c in completions]
        notices, n = json.dumps(ctx.notices, ensure_ascii=False), len(completions)
        return {
            "id": np.array([c.request_id for c in completions], dtype=object),
            "result": np.array([json.dumps(r, ensure_ascii=False, default=str) for r in results], dtype=object),
            "row": np.array([json.dumps(r, ensure_ascii=False, default=str) for r in rows], dtype=object),
            "generated": np.array([c.completion_tokens for c in completions], dtype=np.int64),
            "replica": np.array([self.replica] * len(completions), dtype=object),
            # per batch, on its first row only: what happened to the inputs, and the batch's wall time
            "notices": np.array(([notices] + ["[]"] * (n - 1))[:n], dtype=object),
            "batch_s": np.array(([wall] + [0.0] * (n - 1))[:n], dtype=np.float64),
        }
