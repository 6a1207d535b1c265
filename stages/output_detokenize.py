"""`output.detokenize`: answer ids → text, and everything a reader needs around it (a Completion).

Each answer is decoded in one call over all its ids, never token by token: byte-level tokens join
into UTF-8 characters (CJK, emoji), and the tokenizer's decoder applies its whitespace rules
(leading-space markers, byte fallback) to the whole sequence, exactly as a streamed decode ends up.

`Completion.tokens` are the generated ids as produced (with EOS, aligned with `logprobs`), and
`completion_tokens` counts them: that is what the model generated and what usage reports. `text`
is the cleaned answer from output.postprocess.
"""

from __future__ import annotations

from typing import Any

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import Phase, Stage
from llmplan.llm.tokenizer import Tokenizer

from .compute_tokenize import report_requests
from .slots import InferenceContext
from .types import Answer, Completion, GenerationResult, Request


class OutputDetokenize(Stage):
    """Decode each answer (and beam) to text; assemble completions with usage and timings."""

    name = "output.detokenize"
    phase = Phase.OUTPUT
    reads = ("answers", "generations", "requests", "tokenizer")
    writes = ("completions",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.answers is not None and ctx.generations is not None
        assert ctx.requests is not None and ctx.tokenizer is not None
        answers = {a.request_id: a for a in ctx.answers}
        requests = {r.id: r for r in ctx.requests}
        completions = []
        for gen in ctx.generations:
            answer = answers.get(gen.request_id)
            if answer is None:
                raise StageFailure(f"answers: no answer for request {gen.request_id!r} (postprocess output is stale)")
            completions.append(build_completion(gen, answer, requests.get(gen.request_id), ctx.tokenizer))
        report_requests(ctx, ctx.generations)  # once each: generate reported what it could already
        ctx.completions = completions
        ctx.metrics.set("completions", len(completions))
        ctx.metrics.set("chars", sum(len(c.text) for c in completions))


def build_completion(
    gen: GenerationResult, answer: Answer, request: Request | None, tokenizer: Tokenizer
) -> Completion:
    candidates = []
    for index, cand in enumerate(gen.candidates):
        ids = answer.candidates[index] if index < len(answer.candidates) else []
        candidates.append(
            {
                "text": decode_text(ids, tokenizer),
                "tokens": list(cand.tokens),
                "score": float(cand.score),
                "finish_reason": cand.finish_reason,
            }
        )
    return Completion(
        request_id=gen.request_id,
        prompt=request.prompt_text if request is not None else "",
        text=decode_text(answer.ids, tokenizer),
        finish_reason=gen.finish_reason,
        prompt_tokens=gen.prompt_tokens,
        completion_tokens=len(gen.tokens),
        tokens=list(gen.tokens),
        logprobs=list(gen.logprobs) if gen.logprobs else None,
        candidates=candidates,
        timings=dict(gen.timings),
        error=gen.error,
        from_cache=gen.from_cache,
        streamed=gen.streamed,
    )


def decode_text(ids: list[int], tokenizer: Tokenizer) -> str:
    if not ids:
        return ""
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)  # specials are already gone
    except ValueError as bad:  # TokenizerError: postprocess range-checked, so the tokenizer changed under us
        raise StageFailure(f"tokenizer: cannot decode answer ids ({bad})") from None
