"""The values that travel between stages through the context's slots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmplan.llm.beam_search import Candidate  # stated once, where beam search makes them
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
    origin: str  # "hf-dir" | "gguf" | "package" | "pieces"
    fingerprint: str  # hash of SHA256SUMS when present, else of the shard names and sizes
    gguf_file: Path | None = None
    first_use: Path | None = None  # a first-use record (llm/first_use.py) standing in for SHA256SUMS


@dataclass
class HostWeights:
    """A prepared shard reader: `stream(on_tensor)` pushes each wanted tensor (HF name) to the consumer.

    Tensors are not held here: the consumer (convert) keeps only what it has converted.
    """

    stream: Callable[[Callable[[str, Any], None]], Any]
    wanted: list[str]
    buffer_shards: int
    converted: dict[str, Any] | None = None  # a checkpoint saved by load.convert: its dtype and settings
    file_of: Callable[[str], Path] | None = None  # the file a tensor is read from, for messages


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
class Result:
    """One request's result, the one type carried from generation to the sinks.

    compute.generate (or cache.lookup, replaying) fills the first part and writes `generations`;
    output.postprocess copies each result and adds the ids a reader gets (`answers`); output.detokenize
    copies again and adds the text (`completions`), which output.filter may edit before the sinks.
    Each stage writes new objects, so a slot never changes under a stage that already read it.
    """

    # compute.generate
    request_id: str
    prompt_tokens: int
    tokens: list[int]  # generated ids as produced (EOS included), aligned with logprobs
    finish_reason: FinishReason
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    candidates: list[Candidate] = field(default_factory=list)  # beams, as generated
    timings: dict[str, float] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    from_cache: bool = False
    streamed: bool = False  # the text was already shown through ctx.stream as it was generated
    # For the run's own record (generations.json), not the answer: the best few tokens at each step, and
    # when each token was picked (perf_counter seconds).
    alternatives: list[list[tuple[int, float]]] | None = None
    token_times: list[float] = field(default_factory=list)
    # output.postprocess: special, template and invalid ids removed
    ids: list[int] = field(default_factory=list)
    dropped_invalid: list[int] = field(default_factory=list)
    candidate_ids: list[list[int]] = field(default_factory=list)
    # output.detokenize (and output.filter)
    prompt: str = ""
    text: str = ""
    candidate_texts: list[str] = field(default_factory=list)
    # With `logprobs: N`: per generated token {token, id, logprob, top_logprobs: [{token, id, logprob}]}.
    token_logprobs: list[dict[str, Any]] | None = None
    flagged: list[str] = field(default_factory=list)
    redacted_tokens: int | None = None  # output.filter dropped `tokens`; this many were generated

    @property
    def completion_tokens(self) -> int:
        """What the model generated (usage), also after output.filter redacted the ids."""
        return len(self.tokens) if self.redacted_tokens is None else self.redacted_tokens


def candidate_records(result: Result) -> list[dict[str, Any]]:
    """The beams as sinks and the results database show them: text, tokens, score, finish reason."""
    return [
        {
            "text": result.candidate_texts[i] if i < len(result.candidate_texts) else "",
            "tokens": list(cand.tokens),
            "score": cand.score,
            "finish_reason": cand.finish_reason,
        }
        for i, cand in enumerate(result.candidates)
    ]
