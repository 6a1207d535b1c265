"""`load.draft`: the draft model of speculative decoding (`speculative: {method: draft}`), another plan's model.

The draft is named by a plan, not by a folder: the plan says how that model is found, checked and converted
(an int4 copy of the target's own weights is the usual draft: `plans/llama-fp32-draft.yaml`), and its load
runs as that plan's own stages up to its `load.to_device`, with the KV cache shaped like the target's (the
same slots and tokens: draft slot i mirrors target slot i). A draft is of use only if its tokens are the
target's: the two vocabularies must agree id for id (a draft with a longer, padded head is fine; its tokens
past the target's vocabulary are never guessed).

Checked at `validate`: the draft plan exists, is a valid plan and has a `load.to_device` stage (a plan that
names itself, directly or through others, is refused). The vocabulary is checked at load.
"""

from __future__ import annotations

import contextlib
import contextvars
import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from llmplan.engine.findings import PlanError, StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage
from llmplan.llm.generation import DraftModel
from llmplan.llm.kv import SlotCache

from .slots import InferenceContext

PLACEMENT = "load.to_device"
_checking: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("draft_plans_checked", default=())


class DraftParams(Params):
    plan: str = Field(
        min_length=1, description="the draft model's plan (relative to this plan's folder): loaded up to its placement"
    )

    @field_validator("plan")
    @classmethod
    def _a_plan(cls, value: str, info: ValidationInfo) -> str:
        base = (info.context or {}).get("plan_dir")
        path = Path(value) if Path(value).is_absolute() or not base else Path(base) / value
        if not path.is_file():
            raise ValueError(f"no plan file {str(path)!r}")
        resolved = str(path.resolve())
        if resolved in _checking.get():
            raise ValueError(f"{value!r} names a plan whose draft is this plan again (a cycle)")
        token = _checking.set((*_checking.get(), resolved))
        try:
            placement_id(bind_draft(path))
        except PlanError as bad:
            first = bad.findings[0]
            raise ValueError(f"{value}:{first.line}: {first.message}") from None
        finally:
            _checking.reset(token)
        return resolved


def bind_draft(path: Path, overrides: list[str] | None = None) -> Any:
    from llmplan.engine.plan import load_plan
    from llmplan.engine.registry import discover

    return load_plan(path, discover(), overrides)


def placement_id(bound: Any) -> str:
    """The id of the plan's `load.to_device` stage; PlanError-free plans without one are refused."""
    for stage in bound.stages:
        if stage.spec.uses == PLACEMENT:
            return str(stage.id)
    raise ValueError(f"the draft plan has no {PLACEMENT} stage: it never places a model")


def same_vocabulary(target: Any, draft: Any) -> str | None:
    """Why two tokenizers' vocabularies differ (the first id whose token differs), or None when they agree."""
    for index in range(min(target.vocab_size, draft.vocab_size)):
        mine, theirs = target.id_to_token(index), draft.id_to_token(index)
        if mine != theirs:
            return f"token {index} is {mine!r} in the model, {theirs!r} in the draft"
    return None


def vocabulary_gap(known: int, takes: int) -> str | None:
    """Why the draft's model cannot read the model's tokens: its embedding takes ids below `takes`, the model's
    tokenizer writes ids below `known` (a longer draft head is fine), or None."""
    if takes < known:
        return (
            f"its model takes token ids below {takes}, the model's vocabulary holds {known}: a draft must take "
            "every token the model may write (give a draft of the model's vocabulary)"
        )
    return None


class LoadDraft(Stage):
    """Load another plan's model as the draft of speculative decoding, its KV cache shaped like this plan's."""

    name = "load.draft"
    phase = Phase.LOAD
    Params = DraftParams
    reads = ("kv_cache", "tokenizer", "model_config")
    writes = ("draft_model",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        from llmplan.engine.runner import Runner
        from llmplan.llm.text import Tokenizer

        cache, cfg, tokenizer = ctx.kv_cache, ctx.model_config, ctx.tokenizer
        assert cache is not None and cfg is not None and tokenizer is not None
        path = Path(params.plan)
        place = placement_id(bind_draft(path))
        # The draft's cache mirrors the target's: as many slots, as many tokens a slot.
        shape = [f"{place}.max_batch={cache.max_batch}", f"{place}.kv_cache.max_tokens={cache.max_tokens}"]
        try:
            bound = bind_draft(path, shape)
        except PlanError as bad:
            raise StageFailure(f"draft plan {path.name}: {bad.findings[0].message}") from None
        draft = InferenceContext()
        draft.json_mode = ctx.json_mode
        with tempfile.TemporaryDirectory(prefix="llmplan-draft-") as tmp:
            result = Runner(bound, draft, Path(tmp), until=place, cleanup=False).run()
        if result.status != "ok":
            raise StageFailure(f"draft plan {path.name}: {result.message}")
        assert draft.model is not None and draft.kv_cache is not None and draft.model_runner is not None
        if draft.tokenizer is None:  # its tokenizer stage need not be upstream of its placement
            assert draft.model_source is not None
            draft.tokenizer = Tokenizer.from_dir(draft.model_source.model_dir)
        differs = same_vocabulary(tokenizer, draft.tokenizer)
        if differs is not None:
            raise StageFailure(f"draft plan {path.name}: its vocabulary is not the model's ({differs})")
        gap = vocabulary_gap(tokenizer.vocab_size, draft.model.cfg.vocab_size)
        if gap is not None:  # else the first token past the draft's ids fails in its embedding, mid-answer
            raise StageFailure(f"plan {path.name}: {gap}")
        slots = SlotCache.over(draft.kv_cache)
        ctx.draft_model = DraftModel(draft.model_runner, slots, cfg.vocab_size)
        regions = draft.metrics.get(place, "regions") or {}
        ctx.metrics.set("draft", {"plan": str(path), "bytes": int(sum(regions.values())), "regions": regions})

    def check(self, params: Any, deep: DeepCheck) -> None:
        """The draft plan's own deep checks, shaped like this plan's cache: its bytes are a region of this
        plan ("draft"), and its load a moment that holds this plan's steady bytes and the draft's peak."""
        from llmplan.engine.cli import deep_memory_check

        path = Path(params.plan)
        place = placement_id(bind_draft(path))
        shape = [f"{place}.max_batch={deep.facts.get('max_batch', 1)}"]
        if "max_tokens" in deep.facts:
            shape.append(f"{place}.kv_cache.max_tokens={deep.facts['max_tokens']}")
        facts: dict[str, Any] = {}
        findings, estimates, planned = deep_memory_check(bind_draft(path, shape), memory=1 << 62, facts=facts)
        for finding in findings:
            deep.problem(f"draft plan {path.name}:{finding.line}: {finding.message}", "plan")
        gap = _deep_vocabulary_gap(deep.facts, facts)
        if gap is not None:
            deep.problem(f"draft plan {path.name}: {gap}", "plan")
        if not estimates:
            return
        steady_before = sum(deep.estimates.values())
        draft_bytes = sum(v for region, v in estimates.items() if region != "tokenizer")  # what the draft places
        deep.estimate("draft", draft_bytes)
        deep.estimate("tokenizer", estimates.get("tokenizer", 0))  # its own, loaded for the vocabulary check
        draft_peak = planned.peak if planned is not None else draft_bytes  # its conversion's, or its steady bytes
        # mapped weights (a conversion cache entry, a GGUF) are not resident until the first pass touches them
        untouched = sum(deep.file_backed.values())
        deep.peak("loading the draft", steady_before - untouched + draft_peak)


def _deep_vocabulary_gap(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """At `validate --deep`: the draft's config against the model's tokenizer (its config where the tokenizer
    cannot be read), when both were readable; an unreadable one is the other stages' finding."""
    draft_cfg, model_dir = theirs.get("model_config"), ours.get("model_dir")
    if draft_cfg is None:
        return None
    known = getattr(ours.get("model_config"), "vocab_size", None)
    if model_dir is not None:
        from llmplan.llm.text import Tokenizer

        with contextlib.suppress(Exception):  # a tokenizer that cannot be read is load.tokenizer's finding
            known = Tokenizer.from_dir(model_dir).vocab_size
    return None if known is None else vocabulary_gap(known, draft_cfg.vocab_size)
