"""Fixtures for the output-phase tests: a small real byte-level BPE tokenizer, contexts, and plans
bound with a few fake upstream stages (source, weights, generate) so the real output stages run
inside the real engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
from pydantic import Field

from llmplan.engine.plan import BoundPlan, bind
from llmplan.engine.registry import Registry
from llmplan.engine.stage import Params, Phase, Stage
from llmplan.engine.yaml_source import load_text
from llmplan.llm.text import Tokenizer
from llmplan.stages.cache_stages import CacheLookup, OutputCache
from llmplan.stages.output_detokenize import OutputDetokenize
from llmplan.stages.output_filter import OutputFilter
from llmplan.stages.output_postprocess import OutputPostprocess
from llmplan.stages.output_release import OutputRelease
from llmplan.stages.output_write import OutputWrite
from llmplan.stages.slots import InferenceContext
from llmplan.stages.types import Generation, ModelSource, Request, Result
from tests.stages.tiny_run import train_byte_bpe

SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The sky is blue. The grass is green! Is it? Yes, it is.",
    "  leading spaces\n\ttabs and\nnew lines\n\n",
    "日本語のテキスト。天空是蓝色的。草是绿色的！你好吗？",
    "emoji 🎉👍🏽😀 and more 🚀 text",
    "Hello world. Hello there, classic class of words.",
    "pi is 3.14 and e is 2.71 and so on",
]

CALLS: list[str] = []  # what the fake stages ran, in order


def build_tokenizer_dir(folder: Path) -> Path:
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False}
    train_byte_bpe(folder, CORPUS * 4, SPECIALS, config)
    return folder


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture
def ctx(tokenizer: Tokenizer) -> InferenceContext:
    context = InferenceContext()
    context.log = structlog.get_logger()
    context.tokenizer = tokenizer
    return context


GENERATION_FIELDS = {f.name for f in dataclasses.fields(Generation)}
TIMING_FIELDS = {"queued_s", "prefill_s", "ttft_s", "decode_s"}


def make_generation(
    tokenizer: Tokenizer, request_id: str, text: str, *, finish: str = "eos", prompt_tokens: int = 5, **extra: Any
) -> Result:
    """A result as compute.generate makes it: Generation's fields (logprobs, ttft_s, …) go to its generation,
    the rest to the Result; given a timing, it was timed by phases."""
    ids = tokenizer.encode(text)
    if finish == "eos":
        assert tokenizer.eos_id is not None
        ids = [*ids, tokenizer.eos_id]
    row = {k: extra.pop(k) for k in list(extra) if k in GENERATION_FIELDS}
    if TIMING_FIELDS & set(row):
        extra.setdefault("timed_as", "phases")
    generation = Generation(prompt_tokens, ids, finish_reason=finish, **row)  # type: ignore[arg-type]
    return Result(request_id, generation, **extra)


def make_request(tokenizer: Tokenizer, request_id: str, prompt: str, **overrides: Any) -> Request:
    return Request(request_id, tokenizer.encode(prompt), prompt, "text", overrides=dict(overrides))


# --- fake upstream stages, so plans bind and run in the real engine ------------------------------


class FakeSourceParams(Params):
    tokenizer_dir: str
    fingerprint: str = "fp-1"
    prompts: list[str] = Field(default_factory=lambda: ["Tell me about the sky."])


class FakeSource(Stage):
    """Model source, tokenizer and requests in one (the real ones are other engineers' stages)."""

    name = "fake.source"
    phase = Phase.LOAD
    Params = FakeSourceParams
    writes = ("model_source", "tokenizer", "requests")

    def run(self, ctx: InferenceContext, params: Any) -> None:
        CALLS.append("source")
        ctx.model_source = ModelSource(Path(params.tokenizer_dir), "hf-dir", params.fingerprint)
        ctx.tokenizer = Tokenizer.from_dir(params.tokenizer_dir)
        ctx.requests = [Request(f"r{i}", ctx.tokenizer.encode(p), p, "text") for i, p in enumerate(params.prompts)]


class FakeWeights(Stage):
    name = "fake.weights"
    phase = Phase.LOAD
    reads = ("model_source",)
    writes = ("weights",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        from llmplan.stages.types import ConvertedWeights

        CALLS.append("weights")
        ctx.weights = ConvertedWeights({}, "float32", 0)


class FakeGenerateParams(Params):
    temperature: float = 1.0
    max_new_tokens: int = 16
    answer: str = "The sky is blue."


class FakeGenerate(Stage):
    name = "fake.generate"
    phase = Phase.COMPUTE
    Params = FakeGenerateParams
    reads = ("requests", "weights", "tokenizer")
    writes = ("generations",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        CALLS.append("generate")
        assert ctx.requests is not None and ctx.tokenizer is not None
        ctx.generations = [
            make_generation(
                ctx.tokenizer,
                r.id,
                f"{params.answer} ({r.id})",
                prompt_tokens=len(r.prompt_ids),
                logprobs=[-0.5] * (len(ctx.tokenizer.encode(f"{params.answer} ({r.id})")) + 1),
                ttft_s=0.01,
                prefill_s=0.01,
                decode_s=0.05,
                batch_prompt=5,
            )
            for r in ctx.requests
        ]


OUTPUT_STAGES = (
    OutputPostprocess,
    OutputDetokenize,
    OutputFilter,
    OutputWrite,
    OutputCache,
    CacheLookup,
    OutputRelease,
)


@pytest.fixture
def registry() -> Registry:
    reg = Registry(context_cls=InferenceContext)
    for cls in (FakeSource, FakeWeights, FakeGenerate, *OUTPUT_STAGES):
        reg.add(cls)
    CALLS.clear()
    return reg


@pytest.fixture
def make_plan(registry: Registry) -> Callable[..., BoundPlan]:
    def make(text: str, overrides: list[str] | None = None) -> BoundPlan:
        return bind(load_text(text, "plan.yaml"), registry, overrides)

    return make


@pytest.fixture
def gen() -> Callable[..., Result]:
    """make_generation, as a fixture (test modules should not import conftest)."""
    return make_generation


@pytest.fixture
def req() -> Callable[..., Request]:
    return make_request
