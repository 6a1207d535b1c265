"""Issue 56 on SmolLM2's own tokenizer: its end token is `<|im_end|>`, and a shape that spells it (or its other
control tokens) is refused when compiled, each beside a benign twin that compiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmplan.llm.sampling import OutputFormat, UnsupportedFormat, compile_format
from llmplan.llm.text import Tokenizer


@pytest.mark.parametrize(
    ("spelled", "twin", "says"),
    [
        ({"json_schema": {"const": "<|im_end|>"}}, {"json_schema": {"const": "im_end"}}, "end token"),
        ({"regex": "abc<\\|im_end\\|>"}, {"regex": "abc"}, "end token"),
        ({"choice": ["<|im_end|>"]}, {"choice": ["im_end"]}, "end token"),
        ({"grammar": 'root ::= "<|im_end|>"'}, {"grammar": 'root ::= "im_end"'}, "end token"),
        ({"regex": "<\\|endoftext\\|>"}, {"regex": "endoftext"}, "control token"),
        ({"choice": ["<|im_start|>"]}, {"choice": ["im_start"]}, "control token"),
    ],
)
def test_smollm2_refuses_shapes_that_spell_its_special_tokens(
    smollm2_dir: Path, spelled: dict[str, Any], twin: dict[str, Any], says: str
) -> None:
    tok = Tokenizer.from_dir(smollm2_dir)
    assert tok.decode([tok.eos_id], skip_special_tokens=False) == "<|im_end|>"
    eos = frozenset([tok.eos_id])
    with pytest.raises(UnsupportedFormat, match=says):
        compile_format(OutputFormat.of(spelled), tok, eos, tok.vocab_size)  # type: ignore[arg-type]
    compile_format(OutputFormat.of(twin), tok, eos, tok.vocab_size)  # type: ignore[arg-type]
