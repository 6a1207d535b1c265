"""The sampler chain: each step against transformers' logits processors (the oracle), plus statistics."""

from __future__ import annotations

import math

import pytest
import torch

from llmplan.llm.sampling import build_picker
from llmplan.llm.sampling.chain import (
    SamplingParams,
    StepContext,
    frequency_presence_penalty,
    min_p,
    no_repeat_ngram,
    repetition_penalty,
    temperature,
    top_k,
    top_p,
)

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

V = 64
LOGITS = torch.tensor([3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])  # a fixed small vocabulary
DRAWS = 4000


def _random_case(seed: int) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=g) * 3
    seen = torch.randint(0, V, (20,), generator=g).tolist()
    return logits, seen


def _hf(processor, logits: torch.Tensor, seen: list[int]) -> torch.Tensor:
    return processor(torch.tensor([seen]), logits.clone()[None])[0]


def _draws(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = DRAWS) -> torch.Tensor:
    picker = build_picker(params, prompt_len=0)
    counts = torch.zeros(logits.numel())
    for _ in range(n):
        counts[picker(logits, []).token] += 1
    return counts


# --- each step equals the transformers processor on random logits ----------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf(seed: int, penalty: float) -> None:
    logits, seen = _random_case(seed)
    ours = repetition_penalty(logits.clone(), StepContext(seen, prompt_len=0), penalty)
    torch.testing.assert_close(ours, _hf(RepetitionPenaltyLogitsProcessor(penalty), logits, seen), rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_matches_hf(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    for _ in range(5):
        logits = torch.randn(8, generator=g)
        seen = torch.randint(0, 8, (15,), generator=g).tolist()  # small vocab: repeats are likely
        ours = no_repeat_ngram(logits.clone(), StepContext(seen, 0), n)
        torch.testing.assert_close(ours, _hf(NoRepeatNGramLogitsProcessor(n), logits, seen), rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(3))
def test_warpers_match_hf(seed: int) -> None:
    logits, seen = _random_case(seed)
    ctx = StepContext(seen, 0)
    for t in (0.3, 1.7):
        torch.testing.assert_close(temperature(logits.clone(), ctx, t), _hf(TemperatureLogitsWarper(t), logits, seen))
    for k in (1, 5, 63, 64, 100):
        torch.testing.assert_close(top_k(logits.clone(), ctx, k), _hf(TopKLogitsWarper(k), logits, seen))
    for p in (0.05, 0.5, 0.9, 0.999):
        torch.testing.assert_close(top_p(logits.clone(), ctx, p), _hf(TopPLogitsWarper(p), logits, seen))
    for m in (0.01, 0.2, 0.9, 1.0):
        torch.testing.assert_close(min_p(logits.clone(), ctx, m), _hf(MinPLogitsWarper(m), logits, seen))


def test_top_p_after_top_k_matches_hf_chain() -> None:
    logits, seen = _random_case(7)
    ctx = StepContext(seen, 0)
    ours = top_p(top_k(logits.clone(), ctx, 10), ctx, 0.8)
    theirs = _hf(TopPLogitsWarper(0.8), _hf(TopKLogitsWarper(10), logits, seen), seen)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("spread", [0.5, 3.0, 8.0])  # flat (nucleus past the candidates), peaked, very peaked
def test_top_p_over_a_real_vocabulary_matches_hf(spread: float) -> None:
    # 49152 logits, SmolLM2's vocabulary: the top-k shortcut when the nucleus lies in the top 1024, the full
    # sort when it does not; either must keep exactly HF's set
    gen = torch.Generator().manual_seed(int(spread * 10))
    logits = torch.randn(49152, generator=gen) * spread
    ctx = StepContext([], 0)
    for p in (0.5, 0.9, 0.95):
        torch.testing.assert_close(top_p(logits.clone(), ctx, p), _hf(TopPLogitsWarper(p), logits, []))


def test_top_p_boundary_token_is_kept() -> None:
    # probs 0.5, 0.3, 0.2: p=0.6 needs the 0.3 token to reach the mass (HF keeps the boundary token)
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    kept = torch.isfinite(top_p(logits.clone(), StepContext([], 0), 0.6))
    assert kept.tolist() == [True, True, False]
    kept = torch.isfinite(top_p(logits.clone(), StepContext([], 0), 0.5))
    assert kept.tolist() == [True, False, False]


def test_frequency_presence_penalty_counts_generated_only() -> None:
    logits = torch.zeros(6)
    ctx = StepContext(seen=[1, 1, 2, 3, 3, 3, 4], prompt_len=3)  # generated: 3, 3, 3, 4
    out = frequency_presence_penalty(logits, ctx, frequency=0.5, presence=0.25)
    assert out.tolist() == [0.0, 0.0, 0.0, -(0.5 * 3 + 0.25), -(0.5 + 0.25), 0.0]


# --- the picker: statistics with fixed seeds ----------------------------------------------------------


def test_greedy_is_argmax_after_penalties() -> None:
    picker = build_picker(SamplingParams(temperature=0), prompt_len=0)
    assert picker(LOGITS, []).token == 0
    penalized = build_picker(SamplingParams(temperature=0, repetition_penalty=10.0), prompt_len=0)
    assert penalized(LOGITS, [0]).token == 1
    banned = build_picker(SamplingParams(temperature=0, no_repeat_ngram_size=2), prompt_len=0)
    assert banned(LOGITS, [5, 0, 5]).token == 1  # "5 0" occurred, so 0 after 5 is banned


def test_top_k_draws_only_from_k_best() -> None:
    counts = _draws(SamplingParams(temperature=1.0, top_k=3, seed=1))
    assert counts[3:].sum() == 0
    assert (counts[:3] > 0).all()


def test_top_p_draws_only_from_nucleus() -> None:
    probs = LOGITS.softmax(-1)
    p = 0.8
    nucleus = int((probs.cumsum(-1) < p).sum()) + 1  # smallest prefix reaching p, boundary included
    counts = _draws(SamplingParams(temperature=1.0, top_p=p, seed=2))
    assert counts[nucleus:].sum() == 0
    assert (counts[:nucleus] > 0).all()


def test_min_p_draws_only_above_threshold() -> None:
    probs = LOGITS.softmax(-1)
    allowed = probs >= 0.1 * probs.max()
    counts = _draws(SamplingParams(temperature=1.0, min_p=0.1, seed=3))
    assert counts[~allowed].sum() == 0
    assert (counts[allowed] > 0).all()


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_distribution(t: float) -> None:
    expected = (LOGITS / t).softmax(-1) * DRAWS
    counts = _draws(SamplingParams(temperature=t, seed=4))
    # Pearson chi-square over the cells with expected count >= 5 (9 dof at most): the 0.999 quantile of
    # chi2(9) is 27.9, so a correct sampler fails this with probability < 0.1% (and the seed is fixed)
    cells = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[cells]).sum().item()
    assert chi2 < 27.9, chi2


def test_same_seed_same_tokens_and_reset() -> None:
    params = SamplingParams(temperature=1.5, top_k=8, seed=1234)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0))
    a, b = build_picker(params), build_picker(params)
    first = [a(logits, [1, 2]).token for _ in range(50)]
    assert first == [b(logits, [1, 2]).token for _ in range(50)]
    a.reset()
    assert first == [a(logits, [1, 2]).token for _ in range(50)]
    other = build_picker(SamplingParams(temperature=1.5, top_k=8, seed=99))
    assert first != [other(logits, [1, 2]).token for _ in range(50)]


def test_prompt_len_defaults_to_first_call() -> None:
    picker = build_picker(SamplingParams(temperature=0, frequency_penalty=2.0))
    logits = torch.tensor([1.0, 0.9, 0.0])
    assert picker(logits, [0, 0, 0]).token == 0  # prompt tokens are not frequency-penalized
    assert picker.prompt_len == 3
    assert picker(logits, [0, 0, 0, 0]).token == 1  # the generated 0 is


def test_logprob_is_raw_log_softmax_and_top_n() -> None:
    params = SamplingParams(temperature=0.7, top_k=2, repetition_penalty=1.5, logprobs_top_n=3, seed=0)
    pick = build_picker(params, prompt_len=0)(LOGITS, [0])
    raw = LOGITS.log_softmax(-1)
    assert math.isclose(pick.logprob, raw[pick.token].item(), rel_tol=1e-6)
    assert pick.top is not None and [i for i, _ in pick.top] == [0, 1, 2]
    for i, lp in pick.top:
        assert math.isclose(lp, raw[i].item(), rel_tol=1e-6)
    assert build_picker(SamplingParams(), prompt_len=0)(LOGITS, []).top is None


def test_picker_does_not_modify_caller_logits() -> None:
    logits = LOGITS.clone()
    build_picker(SamplingParams(repetition_penalty=2.0, top_k=2, temperature=0.5, seed=0))(logits, [0, 1])
    assert torch.equal(logits, LOGITS)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_k", 1.5),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("no_repeat_ngram_size", -1),
        ("logprobs_top_n", -2),
        ("seed", "x"),
        ("frequency_penalty", math.inf),
    ],
)
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
