"""`load.tokenizer`: tokenizer.json in both directions, special tokens, and the sandboxed chat template."""

from __future__ import annotations

from typing import Any

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import Phase, Stage
from llmplan.llm.text import Tokenizer, TokenizerError

from .slots import InferenceContext


class LoadTokenizer(Stage):
    """Load tokenizer.json and tokenizer_config.json (chat template, BOS/EOS)."""

    name = "load.tokenizer"
    phase = Phase.LOAD
    reads = ("model_source",)
    writes = ("tokenizer",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.model_source is not None
        try:
            ctx.tokenizer = Tokenizer.from_dir(ctx.model_source.model_dir)
            ctx.tokenizer.check_chat_template()  # a template that does not compile is refused here, not per request
        except TokenizerError as bad:
            raise StageFailure(str(bad)) from None
        ctx.metrics.set("vocab_size", ctx.tokenizer.vocab_size)
        ctx.metrics.set("chat_template", ctx.tokenizer.has_chat_template)
