"""`load.tokenizer`: tokenizer.json in both directions, special tokens, and the sandboxed chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Phase, Stage
from llmplan.llm.text import Tokenizer, TokenizerError

from .slots import InferenceContext

# Resident bytes of a loaded tokenizer per byte of its tokenizer.json (the tokenizers library's vocabulary, merges
# and tries, and ours): measured 20x for SmolLM2 (1.56 MB -> 31.6 MiB), 19.7x for Qwen2.5 (5.37 MB -> 100.8 MiB).
TOKENIZER_BYTES_PER_JSON_BYTE = 20


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

    def check(self, params: Any, deep: DeepCheck) -> None:
        """The memory the tokenizer will hold, from its tokenizer.json (nothing to add before a first import)."""
        folder = deep.facts.get("model_dir")
        json_file = Path(folder) / "tokenizer.json" if folder is not None else None
        if json_file is not None and json_file.is_file():
            deep.estimate("tokenizer", TOKENIZER_BYTES_PER_JSON_BYTE * json_file.stat().st_size)
