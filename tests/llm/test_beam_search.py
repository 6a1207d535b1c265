"""beam_search() against transformers' generate(num_beams=..., do_sample=False): same tokens, same scores.

Scores agree to 1e-4: both sum the same fp32 log-softmax values, but our cached decode logits differ from
transformers' by ~1e-5 (another SDPA path), which a few steps of summation can grow to a few 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from tiny import load_tiny, make_tiny_llama

from llmplan.llm.generation.beam_search import beam_search
from llmplan.llm.kv import KVCache

PAD = 3  # nonzero: transformers pads finished beams with `pad_token_id or eos[0]`, so 0 means EOS
PROMPT = [1, 17, 99, 4, 250, 31]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path, hf = make_tiny_llama(tmp_path_factory.mktemp("beam"), seed=5)
    ours = load_tiny(path)
    # An EOS that beams actually reach: a token greedy decoding produces a few steps in.
    with torch.inference_mode():
        greedy = hf.generate(
            torch.tensor([PROMPT]), do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=PAD
        )[0, len(PROMPT) :].tolist()
    return hf, ours, {greedy[3]}


CASES = [
    # num_beams, num_return_sequences, length_penalty, early_stopping, max_new_tokens
    (2, 1, 1.0, False, 10),
    (2, 2, 0.5, False, 10),
    (4, 3, 1.5, False, 12),
    (4, 4, 0.8, True, 12),
    (4, 2, 2.0, "never", 8),
    (3, 2, -0.5, False, 9),
]


@pytest.mark.parametrize(("beams", "returns", "penalty", "early", "max_new"), CASES)
def test_matches_transformers(tiny, beams: int, returns: int, penalty: float, early, max_new: int) -> None:
    hf, ours, eos = tiny
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([PROMPT]),
            do_sample=False,
            num_beams=beams,
            num_return_sequences=returns,
            length_penalty=penalty,
            early_stopping=early,
            max_new_tokens=max_new,
            eos_token_id=sorted(eos),
            pad_token_id=PAD,
            output_scores=True,
            return_dict_in_generate=True,
        )
    cache = KVCache.for_model(ours, beams, len(PROMPT) + max_new)
    got = beam_search(
        ours,
        cache,
        PROMPT,
        num_beams=beams,
        max_new_tokens=max_new,
        eos_ids=eos,
        length_penalty=penalty,
        num_return_sequences=returns,
        early_stopping=early,
    )
    assert len(got) == returns
    want = out.sequences[:, len(PROMPT) :]
    for cand, row, score in zip(got, want, out.sequences_scores, strict=True):
        padded = cand.tokens + [PAD] * (want.shape[1] - len(cand.tokens))
        assert padded == row.tolist()
        assert cand.score == pytest.approx(float(score), abs=1e-4)
        assert cand.finish_reason == ("eos" if cand.tokens[-1] in eos else "length")
    if penalty <= 1.0:  # short finished beams win: the EOS path is really exercised
        assert any(c.finish_reason == "eos" for c in got)


def test_validates_arguments(tiny) -> None:
    _, ours, eos = tiny
    cache = KVCache.for_model(ours, 2, 32)
    with pytest.raises(ValueError, match="num_beams=4"):
        beam_search(ours, cache, PROMPT, num_beams=4, max_new_tokens=4, eos_ids=eos)
    with pytest.raises(ValueError, match="num_return_sequences"):
        beam_search(ours, cache, PROMPT, num_beams=2, max_new_tokens=4, eos_ids=eos, num_return_sequences=3)
    with pytest.raises(ValueError, match="cannot hold"):
        beam_search(ours, cache, PROMPT, num_beams=2, max_new_tokens=40, eos_ids=eos)
