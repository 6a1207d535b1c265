"""`output.detokenize`: answer ids → text, beside the prompt it answers.

Each answer is decoded in one call over all its ids, never token by token: byte-level tokens join
into UTF-8 characters (CJK, emoji), and the tokenizer's decoder applies its whitespace rules
(leading-space markers, byte fallback) to the whole sequence, exactly as a streamed decode ends up.

`Result.tokens` are the generated ids as produced (with EOS, aligned with `logprobs`), and
`completion_tokens` counts them: that is what the model generated and what usage reports. `text`
is the cleaned answer from output.postprocess, without the stop string that ended it (the way
OpenAI and vLLM return it; finish_detail stays `stop_string`). With `logprobs: N` the result
carries `token_logprobs`: per token its text, id, logprob and the N best alternatives.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import Phase, Stage
from llmplan.llm.text import Tokenizer

from .compute_tokenize import report_requests
from .slots import InferenceContext
from .types import Request, Result


class OutputDetokenize(Stage):
    """Decode each answer (and beam) to text, beside the prompt it answers."""

    name = "output.detokenize"
    phase = Phase.OUTPUT
    reads = ("answers", "requests", "tokenizer")
    writes = ("completions",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.answers is not None and ctx.requests is not None and ctx.tokenizer is not None
        requests = {r.id: r for r in ctx.requests}
        completions = [with_text(a, requests.get(a.request_id), ctx.tokenizer) for a in ctx.answers]
        report_requests(ctx, ctx.answers)  # once each: generate reported what it could already
        ctx.completions = completions
        ctx.metrics.set("completions", len(completions))
        ctx.metrics.set("chars", sum(len(c.text) for c in completions))


def with_text(answer: Result, request: Request | None, tokenizer: Tokenizer) -> Result:
    """A copy of `answer` with its text, its beams' texts and the prompt it answers."""
    text = decode_text(answer.ids, tokenizer)
    if answer.finish_detail == "stop_string":
        text = cut_at_stop(text, answer.params.get("stop") or [])
    return replace(
        answer,
        prompt=request.prompt_text if request is not None else "",
        user_text=request.user_text if request is not None else "",
        text=text,
        candidate_texts=[decode_text(ids, tokenizer) for ids in answer.candidate_ids],
        token_logprobs=token_logprobs(answer, tokenizer),
    )


def cut_at_stop(text: str, stops: list[str]) -> str:
    """The text before the first stop string (as OpenAI and vLLM return it); finish_detail stays stop_string."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(found)] if found else text


def token_logprobs(gen: Result, tokenizer: Tokenizer) -> list[dict[str, Any]] | None:
    """With `logprobs: N`: per generated token its text, id, logprob and the N best alternatives
    (OpenAI's shape: token, logprob, top_logprobs). None when no alternatives were recorded."""
    if not gen.top_logprobs:
        return None
    vocab = tokenizer.vocab_size

    def piece(token: int) -> str:
        return tokenizer.decode([token]) if 0 <= token < vocab else ""

    entries = []
    for index, token in enumerate(gen.tokens):
        top = gen.top_logprobs[index] if index < len(gen.top_logprobs) else []
        entries.append(
            {
                "token": piece(int(token)),
                "id": int(token),
                "logprob": gen.logprobs[index] if index < len(gen.logprobs) else None,
                "top_logprobs": [{"token": piece(int(i)), "id": int(i), "logprob": lp} for i, lp in top or []],
            }
        )
    return entries


def decode_text(ids: list[int], tokenizer: Tokenizer) -> str:
    if not ids:
        return ""
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)  # specials are already gone
    except ValueError as bad:  # TokenizerError: postprocess range-checked, so the tokenizer changed under us
        raise StageFailure(f"tokenizer: cannot decode answer ids ({bad})") from None
