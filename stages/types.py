"""The values that travel between stages through the context's slots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmplan.llm.generate import FinishReason  # stated once, where generation ends sequences


@dataclass(frozen=True)
class Environment:
    python: str
    torch: str
    packages: dict[str, str]
    device: str  # "cpu" | "cuda:0" | …
    device_name: str
    threads: int
    device_memory_bytes: int | None


@dataclass(frozen=True)
class ModelSource:
    """Where the HF-format model directory is, how it got there, and a fingerprint of its weights."""

    model_dir: Path
    origin: str  # "hf-dir" | "gguf" | "package"
    fingerprint: str  # hash of SHA256SUMS when present, else of the shard names and sizes
    gguf_file: Path | None = None


@dataclass
class HostWeights:
    """A prepared shard reader: `stream(on_tensor)` pushes each wanted tensor (HF name) to the consumer.

    Tensors are not held here: the consumer (convert) keeps only what it has converted.
    """

    stream: Callable[[Callable[[str, Any], None]], Any]
    wanted: list[str]
    buffer_shards: int
    converted: dict[str, Any] | None = None  # a checkpoint saved by load.convert: its dtype and settings


@dataclass
class ConvertedWeights:
    """Fused, converted weights under the model's internal names (tensors or quantized objects)."""

    tensors: dict[str, Any]
    dtype: str
    nbytes: int
    errors: dict[str, float] = field(default_factory=dict)  # relative Frobenius error per tensor
    kernel: str = "auto"  # "reference" forces the plain weight-only matmuls


@dataclass
class Request:
    """One prompt, tokenized, with its own generation overrides."""

    id: str
    prompt_ids: list[int]
    prompt_text: str
    kind: Literal["chat", "text"]
    overrides: dict[str, Any] = field(default_factory=dict)
    truncated: int = 0  # how many prompt tokens were dropped to fit the context
    source: str = ""  # where it came from, for messages: "prompts.jsonl:3" or "request 'prompt'"
    noticed_truncation: int = 0  # how much of `truncated` was already reported (ctx.notice)


@dataclass
class Candidate:
    tokens: list[int]
    score: float
    finish_reason: FinishReason


@dataclass
class GenerationResult:
    request_id: str
    prompt_tokens: int
    tokens: list[int]
    finish_reason: FinishReason
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    candidates: list[Candidate] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    from_cache: bool = False
    streamed: bool = False  # the text was already shown through ctx.stream as it was generated
    # For the run's own record (generations.json), not the answer: the best few tokens at each step, and
    # when each token was picked (perf_counter seconds).
    alternatives: list[list[tuple[int, float]]] | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class Answer:
    """Generated ids cleaned for display: special/template tokens and invalid ids removed."""

    request_id: str
    ids: list[int]
    dropped_invalid: list[int] = field(default_factory=list)
    candidates: list[list[int]] = field(default_factory=list)


@dataclass
class Completion:
    """What a user reads: the text of one request, with everything needed to format it."""

    request_id: str
    prompt: str
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    tokens: list[int]
    logprobs: list[float] | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    from_cache: bool = False
    flagged: list[str] = field(default_factory=list)
    # With `logprobs: N`: per generated token {token, id, logprob, top_logprobs: [{token, id, logprob}]}.
    token_logprobs: list[dict[str, Any]] | None = None
    streamed: bool = False  # already shown on the terminal by the generate stage; not printed twice
