"""run_requests, the library's front door for generation: the loop it chooses, what it refuses, what it returns."""

from __future__ import annotations

import pytest
from tiny import load_tiny, make_tiny_llama

from llmplan.llm.generation import (
    CannotRun,
    LoopOptions,
    ModelRunner,
    PromptRequest,
    Refused,
    Vocabulary,
    run_requests,
    serving_loop,
)
from llmplan.llm.kv import KVCache
from llmplan.llm.sampling import SamplingParams

PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 5], [1, 200, 13, 77]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    path, _ = make_tiny_llama(tmp_path_factory.mktemp("door"), seed=3)
    return load_tiny(path)


def _vocab(model) -> Vocabulary:
    return Vocabulary(tokenizer=None, eos_ids=frozenset(), pad_id=0, vocab_size=model.cfg.vocab_size)


def _greedy(max_new: int = 6) -> list[PromptRequest]:
    return [PromptRequest(p, SamplingParams.trusted(max_new_tokens=max_new), tag=i) for i, p in enumerate(PROMPTS)]


def test_the_engine_loop_and_static_batches_agree_on_greedy_tokens(model) -> None:
    cache = KVCache.for_model(model, len(PROMPTS), 64)
    runner = ModelRunner(model, cache)
    looped = run_requests(runner, cache, _greedy(), LoopOptions(), _vocab(model))
    static = run_requests(runner, cache, _greedy(), LoopOptions(static_batches=True), _vocab(model))
    assert looped.loop is not None and static.loop is None
    assert [o.generation.tokens for o in looped.outcomes] == [o.generation.tokens for o in static.outcomes]
    assert all(len(o.generation.tokens) == 6 for o in looped.outcomes)
    assert [o.batch for o in static.outcomes] == [3, 3, 3]


def test_beams_return_candidates_and_never_run_beside_a_served_loop(model) -> None:
    cache = KVCache.for_model(model, 2, 64)
    runner = ModelRunner(model, cache)
    beams = LoopOptions(num_beams=2, num_return_sequences=2)
    (one,) = run_requests(runner, cache, _greedy()[:1], beams, _vocab(model)).outcomes
    assert len(one.candidates) == 2 and one.generation.tokens == one.candidates[0].tokens
    served = serving_loop(runner, cache, LoopOptions())
    with pytest.raises(CannotRun, match="beside a served engine loop"):
        run_requests(runner, cache, _greedy()[:1], beams, _vocab(model), served=served)


def test_a_prompt_with_no_room_is_refused_unless_the_caller_cuts_it(model) -> None:
    cache = KVCache.for_model(model, 1, 6)
    runner = ModelRunner(model, cache)
    with pytest.raises(Refused, match="prompt has 7 tokens; the limit is 5"):
        run_requests(runner, cache, _greedy()[:1], LoopOptions(), _vocab(model))
    (cut,) = run_requests(
        runner, cache, _greedy(1)[:1], LoopOptions(), _vocab(model), fit=lambda i, limit: PROMPTS[i][-limit:]
    ).outcomes
    assert cut.generation.prompt_tokens == 5 and len(cut.generation.tokens) == 1


def test_a_sliding_cache_or_beams_are_never_served(model) -> None:
    slide = KVCache.for_model(model, 2, 64, policy="slide")
    with pytest.raises(CannotRun, match="slide"):
        serving_loop(ModelRunner(model, slide), slide, LoopOptions())
    cache = KVCache.for_model(model, 2, 64)
    with pytest.raises(CannotRun, match="beam search"):
        serving_loop(ModelRunner(model, cache), cache, LoopOptions(num_beams=2))


def test_beam_search_refuses_sampled_defaults() -> None:
    assert "temperature 0" in (LoopOptions(num_beams=2).refusal(SamplingParams(temperature=0.7)) or "")
    assert LoopOptions(num_beams=2).refusal(SamplingParams()) is None
