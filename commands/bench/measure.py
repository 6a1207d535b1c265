"""The llmplan side of `llmplan bench`: load a plan's model through the engine, then time generation.

Loading runs the plan's own stages up to its `load.to_device` stage (in-process, the real Runner), so the
figures are those of the plan: its precision, kernels, thread count and KV cache. Generation uses
`llm.generate.generate` with greedy pickers and no EOS, so every run produces exactly the tokens asked for.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmplan.engine.cli import CliError, new_context
from llmplan.engine.memory import device_peak_bytes, rss_bytes
from llmplan.engine.plan import BoundPlan, load_plan
from llmplan.engine.registry import discover
from llmplan.engine.runner import Runner
from llmplan.llm.generation import generate
from llmplan.llm.sampling import Pick, native_greedy

PLACE, CONVERT, DRAFT = "load.to_device", "load.convert", "load.draft"


def greedy(logits_row: Tensor, seen: list[int]) -> Pick:
    """The first maximum with its logprob: one native call on CPU rows (`native_greedy`, 0.12 against
    0.2-0.37 ms at Gemma 3's 262144 logits), else logsumexp instead of a full log_softmax (one reduction, no [V]
    result) and max(0), argmax's index (the first of equal maxima) in a third of its time."""
    picked = native_greedy(logits_row)
    if picked is not None:
        return picked
    best, token = logits_row.max(0)
    return Pick(token=int(token), logprob=float(best - logits_row.logsumexp(-1)))


def stage_ids(plan: str | Path, overrides: list[str]) -> dict[str, str]:
    """The ids of the plan's stages by what they use (`load.to_device` → its id), first one of each."""
    bound = load_plan(plan, discover(), overrides)
    ids: dict[str, str] = {}
    for stage in bound.stages:
        ids.setdefault(stage.spec.uses, stage.id)
    return ids


def bench_overrides(
    plan: str | Path, user: list[str], *, dtype: str | None, max_batch: int, max_tokens: int
) -> list[str]:
    """The user's --set plus what the bench needs: the grid's dtype, cache rows and tokens (unless set)."""
    ids = stage_ids(plan, user)
    if PLACE not in ids:
        raise CliError(f"{plan}: no {PLACE} stage: nothing to benchmark")
    place = ids[PLACE]
    extra: list[str] = []
    if dtype is not None:
        if CONVERT not in ids:
            raise CliError(f"{plan}: --dtype needs a {CONVERT} stage")
        extra.append(f"{ids[CONVERT]}.dtype={dtype}")
    keys = {o.partition("=")[0].strip() for o in user}
    if f"{place}.max_batch" not in keys:
        extra.append(f"{place}.max_batch={max_batch}")
    if f"{place}.kv_cache.max_tokens" not in keys:
        # Just what the runs need: the plan's 2048-token cache at 16 rows would be ~1.5 GB of zeros.
        extra.append(f"{place}.kv_cache.max_tokens={max_tokens}")
    return user + extra


@dataclass
class Loaded:
    """A model loaded through the engine, with what the load cost."""

    bound: BoundPlan
    ctx: Any
    wall_s: float
    rss_before: int
    peak_rss: int
    files: list[Path] = field(default_factory=list)

    @property
    def model(self) -> Any:
        return self.ctx.model

    @property
    def cache(self) -> Any:
        return self.ctx.kv_cache

    @property
    def regions(self) -> dict[str, int]:
        """Bytes by region as `load.to_device` recorded them: weights, kv_cache, work_buffers; and the draft
        model's (`load.draft`, its weights, KV cache and work buffers) where the plan has one."""
        regions = dict(self.metric(PLACE, "regions") or {})
        draft = self.metric(DRAFT, "draft")
        return regions | ({"draft": int(draft["bytes"])} if draft else {})

    def metric(self, uses: str, key: str) -> Any:
        for stage in self.bound.stages:
            if stage.spec.uses == uses:
                return self.ctx.metrics.get(stage.id, key)
        return None


def load(plan: str | Path, overrides: list[str]) -> Loaded:
    """Run the plan up to its `load.to_device` stage (its `load.draft`, which comes after, where it has one) in
    this process; the peak RSS is sampled meanwhile."""
    from .stats import PeakRSS

    registry = discover()
    bound = load_plan(plan, registry, overrides)
    place = next(s.id for s in bound.stages if s.spec.uses == PLACE)
    place = next((s.id for s in bound.stages if s.spec.uses == DRAFT), place)
    ctx = new_context(registry, bound, json_mode=True)
    run_dir = Path(tempfile.mkdtemp(prefix="llmplan-bench-"))
    gc.collect()
    before = rss_bytes()
    try:
        with PeakRSS() as peak:
            start = time.perf_counter()
            result = Runner(bound, ctx, run_dir, until=place).run()
            wall = time.perf_counter() - start
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if result.exit_code:
        raise CliError(f"loading {plan} failed: {result.message}")
    return Loaded(bound, ctx, wall, before, peak.peak, files=model_files(ctx))


def model_files(ctx: Any) -> list[Path]:
    """The files a load reads: everything in the model directory, and the GGUF it came from."""
    source = ctx.model_source
    if source is None:
        return []
    files = [p for p in Path(source.model_dir).iterdir() if p.is_file()]
    if source.gguf_file is not None and Path(source.gguf_file).is_file():
        files.append(Path(source.gguf_file))
    return files


def drop_page_cache(files: list[Path]) -> bool:
    """Ask the kernel to drop these files' cached pages (posix_fadvise DONTNEED); False if unsupported.

    Advisory: pages mapped by a live process stay. We check /proc/meminfo's `Cached` fell by about the
    files' size and report False when it did not, rather than claim a cold load that was not.
    """
    if not hasattr(os, "posix_fadvise") or not files:
        return False
    cached_before = _meminfo_cached()
    total = 0
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += path.stat().st_size
        except OSError:
            return False
        finally:
            os.close(fd)
    cached_after = _meminfo_cached()
    if cached_before is None or cached_after is None:
        return True  # no /proc/meminfo to check against: trust the call
    # other processes add to the cache meanwhile: half the files' size dropped counts as success
    return cached_before - cached_after >= total // 2


def _meminfo_cached() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Cached:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Equal-length prompts of random ids (no padding; ids away from the specials at the ends)."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = min(100, vocab // 4), max(min(100, vocab // 4) + 1, vocab - min(100, vocab // 4))
    return torch.randint(lo, hi, (batch, length), generator=gen).tolist()


def run_once(model: Any, cache: Any, prompts: list[list[int]], gen_tokens: int) -> dict[str, Any]:
    """One generate() call: prefill tok/s, decode tok/s (aggregate over rows), TTFT; and the tokens."""
    batch, width = len(prompts), len(prompts[0])
    if device_peak_bytes() is not None:
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        gens = generate(
            model,
            cache,
            prompts,
            pickers=[greedy] * batch,
            max_new_tokens=gen_tokens,
            eos_ids=set(),
            pad_id=0,
        )
    first = gens[0]
    if any(g.finish_reason != "length" or len(g.tokens) != gen_tokens for g in gens):
        reasons = sorted({str(g.finish_reason) for g in gens})
        raise CliError(f"a run did not generate {gen_tokens} tokens per row (finish: {', '.join(reasons)})")
    steps = first.decode_steps  # gen_tokens - 1: the first token comes from the prefill
    return {
        "prefill_s": first.prefill_s,
        "prefill_tok_s": batch * width / first.prefill_s,
        "ttft_s": first.ttft_s,
        "decode_tok_s": batch * steps / first.decode_s if steps and first.decode_s > 0 else None,
        "decode_ms_per_step": 1000 * first.decode_s / steps if steps else None,
        "peak_device_bytes": device_peak_bytes(),
        "tokens": [g.tokens for g in gens],
    }
