"""The values that travel between stages through the context's slots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmplan.llm.generation import (
    Candidate,  # stated once, where beam search makes them
    Generation,  # one row's output, as every generation loop makes it
    OpenAIFinish,
    openai_finish,
)
from llmplan.llm.generation.static_batch import FinishReason  # stated once, where generation ends sequences


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
    first_use: Path | None = None  # a first-use record (llm/trust/first_use.py) standing in for SHA256SUMS
    weights_from_gguf: bool = False  # the weights come from the GGUF itself (stored, or dequantized once into a
    # cached conversion): the import has no shards to read

    @property
    def name(self) -> str:
        """The model as its user knows it: a GGUF's file stem (`qwen2.5-coder-0.5b-instruct-q4_k_m`, never the
        import's cache directory), a Hub cache snapshot's repository (`HuggingFaceTB/SmolLM2-135M-Instruct`), else
        the HF directory's own name. `history`, `show` and `/v1/models` say it."""
        if self.gguf_file is not None:
            return Path(self.gguf_file).stem
        return model_dir_name(Path(self.model_dir))


def model_dir_name(model_dir: Path) -> str:
    """An HF directory's name; in a Hub cache (`models--ORG--NAME/snapshots/HASH`) the repository, ORG/NAME."""
    hub = model_dir.parent.parent.name if model_dir.parent.name == "snapshots" else ""
    if hub.startswith("models--") and hub.count("--") >= 2:
        return "/".join(hub.split("--")[1:])
    return model_dir.name


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
    bf16_inputs: bool = False  # bf16 weights' products take x rounded to bf16 (ConvertParams.bf16_inputs)
    mapping: Any = None  # dtype stored: the mapped GGUF the weights are views on (MappedGGUF)
    activation_bits: int = 8  # dtype stored: the block kernels' rounding of x (ConvertParams.activation_bits)

    def close(self) -> None:
        """Drop the mapping (output.release): its memory goes once the model holding its views is gone too."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None


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
    user_text: str = ""  # the user's words: a chat's last user message, else the text (what `history` shows)


TimedAs = Literal["phases", "search"]


@dataclass
class Result:
    """One request's result, the one type carried from generation to the sinks.

    compute.generate (or cache.lookup, replaying) fills the first part and writes `generations`;
    output.postprocess copies each result and adds the ids a reader gets (`answers`); output.detokenize
    copies again and adds the text (`completions`), which output.filter may edit before the sinks.
    Each stage writes new objects, so a slot never changes under a stage that already read it: the
    `Generation` is shared by those copies and never edited; what the filter takes away it states
    (`redacted_tokens`, `withheld`, `rejected`) and the views below apply it.
    """

    # compute.generate
    request_id: str
    generation: Generation  # the row as the generation loop left it: ids, logprobs, alternatives, timings
    top_n: int = 0  # `logprobs: N`: how many alternatives per token the answer shows (the record keeps more)
    candidates: list[Candidate] = field(default_factory=list)  # beams, as generated
    params: dict[str, Any] = field(default_factory=dict)
    # How `generation` was timed: "phases" (queue, prefill, decode: the engine loop or a static batch of
    # `batch` rows whose one prefill covered `batch_prompt` tokens), "search" (beam search: one wall clock, in
    # decode_s), None (replayed or failed before generating: nothing to report).
    timed_as: TimedAs | None = None
    batch: int = 1
    batch_prompt: int = 0
    from_cache: bool = False
    streamed: bool = False  # the text was already shown through ctx.stream as it was generated
    # With a format: {kind, sha256, summary, complete} (complete: the tokens make a whole answer under it; a row
    # cut by its length limit may not), and per step how many tokens the mask allowed (not for beams).
    format_record: dict[str, Any] | None = None
    mask_allowed: list[int] | None = None
    # output.postprocess: special, template and invalid ids removed
    ids: list[int] = field(default_factory=list)
    dropped_invalid: list[int] = field(default_factory=list)
    candidate_ids: list[list[int]] = field(default_factory=list)
    # output.detokenize (and output.filter)
    prompt: str = ""
    user_text: str = ""  # the request's user_text
    text: str = ""
    candidate_texts: list[str] = field(default_factory=list)
    # With `logprobs: N`: per generated token {token, id, logprob, top_logprobs: [{token, id, logprob}]}.
    token_logprobs: list[dict[str, Any]] | None = None
    flagged: list[str] = field(default_factory=list)
    redacted_tokens: int | None = None  # output.filter dropped the token data; this many were generated
    withheld: list[set[int]] | None = None  # output.filter: per step, the alternatives it left out
    rejected: str | None = None  # output.filter rejected the answer: this is its error

    @classmethod
    def failed(cls, request_id: str, prompt_tokens: int, error: str, **extra: Any) -> Result:
        """A request that produced nothing: its error, no timings."""
        return cls(request_id, Generation(prompt_tokens, finish_reason="error", error=error), **extra)

    @property
    def prompt_tokens(self) -> int:
        return self.generation.prompt_tokens

    @property
    def finish_detail(self) -> FinishReason:
        """How generation ended (eos, stop_string, cache_full, ...): what the stages decide on."""
        return self.generation.finish_reason or "length"

    @property
    def finish_reason(self) -> OpenAIFinish:
        """What a reader is told (OpenAI's vocabulary, llm/generation/ending.py): content_filter once a filter acted."""
        return openai_finish(self.finish_detail, filtered=bool(self.flagged) or self.rejected is not None)

    @property
    def error(self) -> str | None:
        return self.rejected if self.rejected is not None else self.generation.error

    @property
    def tokens(self) -> list[int]:
        """Generated ids as produced (EOS included), aligned with logprobs."""
        return [] if self.redacted_tokens is not None else self.generation.tokens

    @property
    def logprobs(self) -> list[float]:
        return [] if self.redacted_tokens is not None else self.generation.logprobs

    @property
    def token_times(self) -> list[float]:
        """When each token was picked (perf_counter seconds), for the run's record."""
        return self.generation.token_times

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None:
        """The N best alternatives at each step, with `logprobs: N`."""
        tops = self.generation.top_logprobs
        if self.redacted_tokens is not None or not self.top_n or not any(tops):
            return None
        return self._kept([(t or [])[: self.top_n] for t in tops])

    @property
    def alternatives(self) -> list[list[tuple[int, float]]] | None:
        """For the run's record (generations.json), not the answer: the best few tokens at each step."""
        tops = self.generation.top_logprobs
        if self.redacted_tokens is not None or not any(tops):
            return None
        return self._kept([t or [] for t in tops])

    def _kept(self, steps: list[list[tuple[int, float]]]) -> list[list[tuple[int, float]]]:
        withheld = self.withheld
        if withheld is None:
            return steps
        return [
            [(t, lp) for t, lp in step if i >= len(withheld) or int(t) not in withheld[i]]
            for i, step in enumerate(steps)
        ]

    @property
    def timings(self) -> dict[str, float]:
        """The generation's timings as the sinks write them (seconds and rates, by name)."""
        gen = self.generation
        if self.timed_as == "search":
            wall = gen.decode_s
            return {"wall_s": wall, "decode_tokens_per_s": len(gen.tokens) / wall if wall > 0 else 0.0}
        if self.timed_as is None:
            return {}
        decoded = max(len(gen.tokens) - 1, 0)
        return {
            "queue_s": gen.queued_s,  # submitted -> admitted into a slot (0 for a static batch)
            "prefill_s": gen.prefill_s,
            "ttft_s": gen.ttft_s if gen.ttft_s is not None else 0.0,
            "decode_s": gen.decode_s,
            "prefill_tokens_per_s": self.batch_prompt / gen.prefill_s if gen.prefill_s > 0 else 0.0,
            "decode_tokens_per_s": decoded / gen.decode_s if gen.decode_s > 0 else 0.0,
            "batch": float(self.batch),
        }

    @property
    def speculative(self) -> dict[str, int] | None:
        """Speculative decoding's guesses verified and accepted; None where the request did not speculate."""
        if not self.params.get("speculative") or self.timed_as != "phases":
            return None
        return {"guessed": self.generation.guessed, "accepted": self.generation.accepted}

    @property
    def completion_tokens(self) -> int:
        """What the model generated (usage), also after output.filter redacted the ids."""
        return len(self.tokens) if self.redacted_tokens is None else self.redacted_tokens


def candidate_records(result: Result) -> list[dict[str, Any]]:
    """The beams as sinks and the results database show them: text, tokens, score, finish reason and detail."""
    return [
        {
            "text": result.candidate_texts[i] if i < len(result.candidate_texts) else "",
            "tokens": list(cand.tokens),
            "score": cand.score,
            "finish_reason": openai_finish(cand.finish_reason),
            "finish_detail": cand.finish_reason,
        }
        for i, cand in enumerate(result.candidates)
    ]
