"""The figures of llm/evaluation/quality.py on passes whose answers are known."""

from __future__ import annotations

import math

import pytest
import torch

from llmplan.llm.evaluation import quality


def a_pass(logits: torch.Tensor, layers: int = 2) -> quality.Pass:
    hidden = [torch.arange(logits.shape[0] * 3, dtype=torch.float32).reshape(-1, 3) + i for i in range(layers)]
    return quality.Pass(torch.log_softmax(logits, -1), hidden)


def test_chunks_are_whole_and_consecutive() -> None:
    ids = list(range(10))
    assert quality.chunks(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert quality.chunks(ids, 4, limit=1) == [[0, 1, 2, 3]]
    assert quality.chunks(ids, 11) == []
    with pytest.raises(ValueError, match="at least 4"):
        quality.chunks(ids, 3)


def test_perplexity_is_the_exp_of_the_mean_nll_of_the_scored_half() -> None:
    chunk = [0, 1, 2, 3, 4, 5, 6, 7]
    start = quality.first_scored(len(chunk))  # logits at 3..6 predict tokens 4..7
    logits = torch.randn(len(chunk) - 1 - start, 8, generator=torch.Generator().manual_seed(0))
    ppl = quality.Perplexity()
    ppl.add(a_pass(logits), chunk)
    expected = -torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor([4, 5, 6, 7])].double().mean()
    summary = ppl.summary()
    assert summary["tokens_scored"] == 4
    assert summary["nll"] == pytest.approx(float(expected), rel=1e-9)
    assert summary["perplexity"] == pytest.approx(math.exp(float(expected)), rel=1e-9)


def test_divergence_of_a_model_from_itself_is_zero_and_from_another_is_torchs_kl() -> None:
    g = torch.Generator().manual_seed(1)
    ref_logits, our_logits = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    same = quality.Divergence()
    same.add(a_pass(ref_logits), a_pass(ref_logits))
    assert same.summary()["kl_mean"] == 0 and same.summary()["top1_agreement"] == 1
    assert same.summary()["layer_drift"] == [0.0, 0.0]

    other = quality.Divergence()
    ours, ref = a_pass(our_logits), a_pass(ref_logits)
    ours.hidden[1] = ours.hidden[1] * 1.1
    other.add(ours, ref)
    expected = torch.nn.functional.kl_div(ours.logprobs, ref.logprobs, log_target=True, reduction="none").sum(-1)
    summary = other.summary()
    assert summary["kl_mean"] == pytest.approx(float(expected.mean()), rel=1e-5)
    assert summary["kl_max"] == pytest.approx(float(expected.max()), rel=1e-5)
    top1 = float((our_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    assert summary["top1_agreement"] == top1
    h = ref.hidden[1]
    assert summary["layer_drift"][0] == 0.0
    assert summary["layer_drift"][1] == pytest.approx(float((0.1 * h).norm() / h.norm()), rel=1e-5)


def test_same_token_rate_counts_positions() -> None:
    assert quality.same_token_rate([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 1.0
    assert quality.same_token_rate([[1, 2, 9, 4], [5]], [[1, 2, 3, 4], [6]]) == 3 / 5
    assert quality.same_token_rate([[1]], [[1, 2]]) == 0.5  # a shorter continuation misses the rest
