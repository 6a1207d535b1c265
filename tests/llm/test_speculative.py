"""Speculative decoding (llm/generation/speculative.py) through the engine loop, against the same loop without it.

Exactness: a row's answer must not depend on whether it speculated. The tiny random models here seldom
repeat themselves, so most rows pick with `echo`: the token PERIOD back (text that quotes itself, which
prompt lookup guesses right) unless the model's argmax is a multiple of 4, then that argmax (which it
guesses wrong). Its tokens thus depend on the logits of every position, the K/V of rejected guesses
included if they leaked, and its logprobs are the model's: both must equal the plain loop's (1e-5 relative,
the summation-order noise of other batch shapes). Pure greedy rows run beside them. The pass costs stay the
prior there (`PriorCosts`), so which guesses are made does not hang on the machine's timings.

Distribution: sampled answers with and without speculation (different seeds) have next-token histograms
within a total-variation distance that sampling noise stays far below, and a wrong acceptance rule (take a
guess whenever the sampler would allow it) lands far above it.

A draft model (llm/generation/draft_model.py) is held to the same: the same rows and pickers under a draft of the same
weights in int8 (mostly right), the fp32 model under an int8 target, and echo rows, which the draft's argmax
often gets wrong; its own cache must hold the row's text after each use, rejected guesses cut off; with a
draft that guesses the bigram chain's likeliest token, sampled answers keep the chain's exact distribution.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from archs import make_tiny
from tiny import load_tiny, make_tiny_llama
from torch import Tensor

from llmplan.llm.generation import DraftModel, EngineLoop, ModelRunner, Scheduler, engine_loop, speculative
from llmplan.llm.generation.flat_batch import FlatBatch
from llmplan.llm.generation.scheduler import GenerationRequest, Sequence
from llmplan.llm.generation.speculative import (
    DRAFT_PRIOR,
    DraftGuesser,
    NgramIndex,
    PassCosts,
    Speculator,
    best_guesses,
)
from llmplan.llm.kernels import native
from llmplan.llm.kv import SlotCache
from llmplan.llm.kv.layers import LayerKV
from llmplan.llm.model import Transformer, make_linear, quantize_weight
from llmplan.llm.sampling import Pick, SamplingParams, Speculation, build_picker

NATIVE = native.kernels() is not None
PATHS = ["torch", pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="native kernels unavailable"))]
PERIOD = 5
PROMPTS = [
    [1, 17, 99, 4, 250, 31, 8, 40, 41, 9, 12],
    [1, 5, 9, 60, 61, 62, 63, 5, 9],
    [1, 200, 13, 77, 3, 3],
    [1, 44] * 10,
]
SPEC = Speculation(tokens=4, ngram=3)


def echo(logits: Tensor, seen: list[int]) -> Pick:
    best = int(logits.argmax())
    token = seen[-PERIOD] if best % 4 else best
    return Pick(token=token, logprob=float(logits.log_softmax(-1)[token]))


def greedy(logits: Tensor, seen: list[int]) -> Pick:
    token = int(logits.argmax())
    return Pick(token=token, logprob=float(logits.log_softmax(-1)[token]))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = make_tiny_llama(tmp_path_factory.mktemp("spec"), n_layers=3, heads=8, kv_heads=2, seed=11)
    return path


@pytest.fixture(scope="module")
def fp32(tiny_dir: Path) -> Transformer:
    return load_tiny(tiny_dir)


@pytest.fixture(scope="module")
def int8(tiny_dir: Path) -> Transformer:
    from safetensors.torch import load_file

    from llmplan.llm.model import ModelConfig
    from llmplan.llm.model.weights import fuse_hf_state_dict

    cfg = ModelConfig.from_file(tiny_dir / "config.json")
    weights = fuse_hf_state_dict({k: v for f in tiny_dir.glob("*.safetensors") for k, v in load_file(f).items()}, cfg)
    linear = ("wqkv.weight", "wo.weight", "w13.weight", "w2.weight", "output.weight")
    quantized = {n: quantize_weight(w, "int8") if n.endswith(linear) else w for n, w in weights.items()}
    return Transformer.from_weights(cfg, quantized, linear_factory=functools.partial(make_linear, kernel="auto"))


@pytest.fixture
def eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every guess that pays at all is made (no margin): rows whose matches are seldom right guess too."""
    monkeypatch.setattr(speculative, "MARGIN", 1.0)


class PriorCosts(PassCosts):
    """Pass costs that stay the prior: the rows' guesses then depend on their text alone."""

    def add(self, inputs: int, seconds: float) -> None:
        pass


def run_all(
    model: Transformer,
    requests: list[GenerationRequest],
    *,
    path: str = "torch",
    slots: int = 3,
    max_tokens: int = 128,
    chunk: int | None = None,
    every: int = 2,
    **scheduling: int,
) -> tuple[list[Sequence], EngineLoop]:
    """Submit one request every `every` steps while the others run (rows join and leave mid-speculation)."""
    cache = SlotCache.for_model(model, slots, max_tokens, chunk=chunk)
    loop = EngineLoop(ModelRunner(model, cache, native=path == "native"), cache, **scheduling)
    loop.scheduler.pass_costs = PriorCosts()  # how many guesses pay must not hang on this machine's timings
    if path == "native" and loop.runner.backend != "native":
        pytest.skip(f"the native pass refuses {model.cfg.model_type}")
    seqs, pending, step = [], list(requests), 0
    while pending or loop.pending:
        if pending and step % every == 0:
            seqs.append(loop.submit(pending.pop(0)))
        loop.step()
        step += 1
    return seqs, loop


def requests(spec: Speculation | None, new: int = 40, **kw) -> list[GenerationRequest]:
    pickers = [echo, echo, greedy, echo]
    return [
        GenerationRequest(prompt=p, picker=pick, max_new_tokens=new, speculation=spec, **kw)
        for p, pick in zip(PROMPTS, pickers, strict=True)
    ]


def assert_same(plain: list[Sequence], spec: list[Sequence]) -> None:
    for want, got in zip(plain, spec, strict=True):
        assert got.generation.tokens == want.generation.tokens
        assert got.generation.finish_reason == want.generation.finish_reason
        assert got.generation.logprobs == pytest.approx(want.generation.logprobs, rel=1e-5, abs=1e-5)


# --- the proposer and its back-off ------------------------------------------------------------------------


def test_lookup_copies_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(3)
    seen = [7, 1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 8, 2, 3]
    # suffix (8?) 2, 3: the 3-gram [8, 2, 3] never occurred; [2, 3] last ended at position 9: 4, 5, 6 follow
    assert index.guesses(seen, 3) == [4, 5, 6]
    assert index.guesses([*seen, 4], 2) == [5, 6]  # grown by one token: the 3-gram [2, 3, 4] matches
    assert NgramIndex(2).guesses([5, 6, 7], 4) == []  # nothing repeats: no guess
    assert NgramIndex(1).guesses([5, 6, 5], 4) == [6, 5]  # only as many as there are after the match


def test_guesses_are_made_only_where_they_pay() -> None:
    prior = lambda k: 1 + 0.15 * k  # noqa: E731  (a 2-input pass: 1.15x a one-input one)
    assert best_guesses(0.1, 4, prior) == 0  # 1.1 tokens for 1.15x: a plain step delivers more per second
    assert best_guesses(0.3, 4, prior) == 0  # 1.3 tokens for 1.15x: 13 % more, within the margin (15 %)
    assert best_guesses(0.4, 4, prior) == 1  # 1.4 for 1.15x pays, 1.56 for 1.3x less so
    assert best_guesses(0.9, 4, prior) == 4
    assert best_guesses(0.9, 4, lambda k: 1 + 3 * k) == 0  # guesses that cost a pass each never pay
    assert best_guesses(0.9, 0, prior) == 0  # no room


def test_a_row_stops_guessing_where_matches_go_wrong_and_resumes_where_they_come_right() -> None:
    spec = Speculator(tokens=4, ngram=2)
    seen = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3

    def right_until_guessing() -> tuple[list[int], int]:
        checked = 0
        while not (guesses := spec.propose(seen, 100)):  # plain steps: the guess it did not make was right
            spec.observe(1)  # what followed the match [8, 9]
            checked += 1
        return guesses, checked

    assert spec.propose(seen, 100) == []  # the prior (p = 0.25) does not clear the margin: it watches first
    guesses, checked = right_until_guessing()
    assert guesses == [1, 2, 3, 4][: len(guesses)] and 1 <= checked <= 5
    passes = 0
    while guesses := spec.propose(seen, 100):  # every guess rejected: fewer, then none
        spec.record(0, len(guesses), 0)
        passes += 1
    assert 1 <= passes <= 6 and spec.propose(seen, 100) == []
    guesses, again = right_until_guessing()  # right again: it guesses again
    assert guesses and 1 <= again <= 8
    spec.observe(1)  # nothing left unmade: observing changes nothing
    assert spec.checked == checked + again
    assert spec.propose(seen, 0) == []  # never more than the room


def test_a_one_gram_match_that_fails_does_not_stop_a_longer_one() -> None:
    spec, seen = Speculator(tokens=4, ngram=3), [5, 9, 5]
    for _ in range(10):  # the 1-gram [5] guesses 9, the answer goes on otherwise
        spec.record(0, 1, 0) if spec.propose(seen, 100) else spec.observe(0)
    assert spec.acceptance(1) < 0.1 and spec.acceptance(3) == 0.25  # the 3-gram's estimate is untouched
    longer = [*seen, 7, 8, 9, 1, 7, 8, 9]
    assert spec.propose(longer, 100) == []  # the 3-gram at its prior: watched first
    spec.observe(1)  # its continuation was right: the 3-gram guesses, the 1-gram's failures aside
    assert spec.propose(longer, 100)[:1] == [1]


def test_measured_pass_costs_steer_the_guesses() -> None:
    costs = PassCosts()
    assert costs.relative(1, 2) == pytest.approx(1.3)  # nothing measured: the prior
    for _ in range(20):
        costs.add(1, 0.010)
        costs.add(2, 0.011)
        costs.add(3, 0.030)  # a third input costs a second pass (an AVX2 group of 2 rows full)
    assert costs.relative(1, 1) == pytest.approx(1.1, rel=0.05)
    assert costs.relative(1, 2) == pytest.approx(3.0, rel=0.1)
    assert costs.relative(1, 3) == pytest.approx(1.45)  # 4 inputs, never measured: the prior
    assert best_guesses(0.8, 2, lambda k: costs.relative(1, k)) == 1
    costs.add(1, 0.100)  # the machine got 10x busier: one-input passes slow first
    costs.add(2, 0.100)
    assert costs.relative(1, 1) < 1.5  # compared with the recent one-input passes, not the old ones
    for _ in range(200):  # a width not run for a while drifts back to the prior: it is tried again
        costs.add(1, 0.010)
    assert costs.relative(1, 2) == pytest.approx(1.3, rel=0.1)


# --- exactness --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("eager")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_answers_equal_the_plain_loop_batched(fp32: Transformer, int8: Transformer, path: str, precision: str) -> None:
    model = fp32 if precision == "fp32" else int8
    if precision == "int8" and path == "torch":
        pytest.skip("int8 linears run on the native kernels either way; the native pass is the one to check")
    plain, _ = run_all(model, requests(None), path=path, max_step_tokens=12)
    spec, loop = run_all(model, requests(SPEC), path=path, max_step_tokens=12)
    assert_same(plain, spec)
    gens = [s.generation for s in spec]
    assert all(g.guessed > 0 for g in gens)
    assert 0 < loop.stats.accepted_tokens < loop.stats.guessed_tokens  # guesses kept and guesses rejected
    assert sum(g.decode_steps for g in gens) < sum(s.generation.decode_steps for s in plain)  # fewer passes
    for g in gens:
        assert (g.guessed, g.accepted) == tuple(map(sum, zip(*[(k, a) for _, k, a in g.speculation], strict=True)))


@pytest.mark.parametrize("path", PATHS)
def test_batch_one_equals_the_plain_loop_and_the_slot_ends_where_it_would(fp32: Transformer, path: str) -> None:
    for prompt in PROMPTS:
        req = functools.partial(GenerationRequest, prompt=prompt, picker=echo, max_new_tokens=30)
        (plain,), plain_loop = run_all(fp32, [req()], path=path, slots=1)
        (spec,), spec_loop = run_all(fp32, [req(speculation=SPEC)], path=path, slots=1)
        assert_same([plain], [spec])
        # the rejected guesses' K/V are gone: the slot holds what a row without speculation leaves
        assert spec_loop.cache.held[0] == plain_loop.cache.held[0] == prompt + spec.generation.tokens[:-1]
        assert spec_loop.cache.lengths[0] == len(prompt) + len(spec.generation.tokens) - 1
        assert int(spec_loop.cache.valid[0].sum()) == spec_loop.cache.lengths[0]


@pytest.mark.parametrize("path", PATHS)
def test_sliding_window_rings_stay_correct(tmp_path: Path, path: str) -> None:
    """Gemma 3's sliding layers as rings of window 16 + chunk 8 slots, wrapped many times over 40 + 60
    tokens, each pass writing the last token and up to 7 guesses (the most one write takes)."""
    model = load_tiny(make_tiny(tmp_path, "gemma3_text")[0])
    reqs = functools.partial(requests, new=60)
    plain, _ = run_all(model, reqs(None), path=path, chunk=8, max_step_tokens=16)
    spec, loop = run_all(model, reqs(Speculation(tokens=16, ngram=2)), path=path, chunk=8, max_step_tokens=16)
    assert any(loop.cache.store.rings)
    assert_same(plain, spec)
    assert loop.stats.accepted_tokens > 0
    assert max(k for s in spec for _, k, _ in s.generation.speculation) <= 7  # max_write - 1


def test_stop_rules_apply_to_accepted_tokens_exactly(fp32: Transformer) -> None:
    """EOS among the guesses, a stop condition, and every token limit end a row where the plain loop ends it;
    streaming delivers the same tokens in the same order."""
    plain_run, _ = run_all(fp32, requests(None, new=40))
    pattern = plain_run[0].generation.tokens
    eos = frozenset({pattern[17]})
    pair = pattern[23:25]

    def stop(ids: list[int]) -> bool:
        return ids[-2:] == pair

    for kw in ({"eos_ids": eos}, {"stop": stop}, *({"new": n} for n in (1, 2, 3, 6, 11))):
        new = kw.pop("new", 40)
        streams: dict[bool, list[list[int]]] = {False: [[] for _ in PROMPTS], True: [[] for _ in PROMPTS]}
        outs = {}
        for speculating in (False, True):
            reqs = requests(SPEC if speculating else None, new=new, **kw)
            for req, stream in zip(reqs, streams[speculating], strict=True):
                req.on_token = stream.append
            outs[speculating], _ = run_all(fp32, reqs)
        assert_same(outs[False], outs[True])
        assert streams[True] == streams[False] == [s.generation.tokens for s in outs[True]]
        assert all(len(s.generation.tokens) <= new for s in outs[True])
    assert outs[True][0].generation.finish_reason == "length"


def test_a_full_slot_gets_no_guesses_past_its_end(fp32: Transformer) -> None:
    prompt = [1, 44] * 10
    plain, _ = run_all(
        fp32, [GenerationRequest(prompt=prompt, picker=echo, max_new_tokens=100)], slots=1, max_tokens=32
    )
    spec, _ = run_all(
        fp32,
        [GenerationRequest(prompt=prompt, picker=echo, max_new_tokens=100, speculation=SPEC)],
        slots=1,
        max_tokens=32,
    )
    assert_same(plain, spec)
    assert spec[0].generation.finish_reason == "cache_full"


# --- the distribution of sampled answers --------------------------------------------------------------------

VOCAB, SAMPLES, NEW_SAMPLED = 6, 4000, 4
# next | last: a + 1 with probability 0.5, a + 2 with 0.2, each other token 0.1 (as logits)
BIGRAM = torch.tensor([[{1: 0.5, 2: 0.2}.get((b - a) % VOCAB, 0.1) for b in range(VOCAB)] for a in range(VOCAB)]).log()


class BigramRunner:
    """A model runner whose logits at an input are BIGRAM's row of that input's token: the exact distribution
    of every generated position is then known (a Markov chain), so the samples are checked against it."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self.model = torch.nn.Module()  # the loop asks only for its device, on out-of-memory

    def forward(self, batch: FlatBatch, cache: SlotCache) -> Tensor:
        self.spans = [(0.0, 0.0)] * len(batch.parts)
        return BIGRAM[batch.tokens[batch.outs]]


def exact(last: int, position: int) -> Tensor:
    """The distribution of generated token `position` (0 first) after a prompt ending in `last`."""
    step = BIGRAM.softmax(-1)
    return torch.linalg.matrix_power(step, position + 1)[last]


def bigram_cache(rows: int = 32) -> SlotCache:
    return SlotCache(LayerKV(1, rows, 1, 128, 2, dtype=torch.float32), torch.zeros(rows, 128, dtype=torch.bool))


def sampled(
    prompt: list[int], spec: Speculation | None, seeds: range, *, draft: bool = False
) -> tuple[list[list[int]], EngineLoop]:
    """One sampled answer per seed from the bigram chain, all in one loop; with `draft`, a bigram draft."""
    guesser = DraftModel(BigramRunner(), bigram_cache(), BIGRAM.shape[0]) if draft else None  # type: ignore[arg-type]
    loop = EngineLoop(BigramRunner(), bigram_cache(), prefix_reuse=False, draft=guesser)  # type: ignore[arg-type]
    seqs = [
        loop.submit(
            GenerationRequest(
                prompt=prompt,
                picker=build_picker(SamplingParams(temperature=1.0, seed=seed), len(prompt)),
                max_new_tokens=NEW_SAMPLED,
                speculation=spec,
            )
        )
        for seed in seeds
    ]
    loop.run()
    return [s.generation.tokens for s in seqs], loop


def tv_from_exact(samples: list[list[int]], last: int, position: int) -> float:
    counts = torch.bincount(torch.tensor([s[position] for s in samples]), minlength=VOCAB).float()
    return 0.5 * float((counts / len(samples) - exact(last, position)).abs().sum())


def wrong_accept(draw: torch.Generator, pick, logits, guesses, seen, deliver):  # type: ignore[no-untyped-def]
    """A broken verifier (the control), the classic slip: accept guess g with probability p(g), but on a
    rejection draw from p itself instead of p without g, so g comes out more often than p(g)."""
    delivered = 0
    for i in range(len(guesses) + 1):
        taken = i < len(guesses) and float(torch.rand(1, generator=draw)) < float(logits[i].softmax(-1)[guesses[i]])
        chosen = Pick(guesses[i], 0.0) if taken else pick(logits[i], seen)
        delivered += 1
        if not deliver(chosen) or i == len(guesses) or chosen.token != guesses[i]:
            break
    return delivered


# 0 1 2 3 4 5 0 1 ...: the guess after a is a + 1, the likeliest token, accepted about half the time.
PAIRS_PROMPT = list(range(VOCAB)) * 4


def test_sampled_answers_keep_the_distribution_of_plain_sampling() -> None:
    """Every generated position after the first (those come from verify passes) against its exact
    distribution: sampling noise at 4000 draws over 6 tokens is ~0.015 in TV; the bound is 0.04, and the
    wrong rule below lands above 0.08."""
    last = PAIRS_PROMPT[-1]
    plain, _ = sampled(PAIRS_PROMPT, None, range(SAMPLES))
    spec, loop = sampled(PAIRS_PROMPT, Speculation(tokens=3, ngram=1), range(SAMPLES, 2 * SAMPLES))
    rate = loop.stats.accepted_tokens / loop.stats.guessed_tokens
    assert loop.stats.guessed_tokens > SAMPLES and 0.3 < rate < 0.7  # both branches of the rule, often
    for position in range(NEW_SAMPLED):
        assert tv_from_exact(plain, last, position) < 0.04
        assert tv_from_exact(spec, last, position) < 0.04


def test_the_check_catches_a_wrong_acceptance_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_loop, "accept", functools.partial(wrong_accept, torch.Generator().manual_seed(0)))
    spec, _ = sampled(PAIRS_PROMPT, Speculation(tokens=3, ngram=1), range(SAMPLES, 2 * SAMPLES))
    assert max(tv_from_exact(spec, PAIRS_PROMPT[-1], p) for p in range(1, NEW_SAMPLED)) > 0.08


# --- a draft model ---------------------------------------------------------------------------------------

DRAFT = Speculation(method="draft", tokens=4)


def draft_of(model: Transformer, path: str, slots: int = 3, max_tokens: int = 128) -> DraftModel:
    cache = SlotCache.for_model(model, slots, max_tokens)
    return DraftModel(ModelRunner(model, cache, native=path == "native"), cache, model.cfg.vocab_size)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pair", ["fp32 under int8 draft", "int8 under fp32 draft"])
def test_draft_answers_equal_the_plain_loop_batched(fp32: Transformer, int8: Transformer, path: str, pair: str) -> None:
    target, guesser = (fp32, int8) if pair.startswith("fp32") else (int8, fp32)
    if path == "torch" and pair.startswith("int8"):
        pytest.skip("int8 linears run on the native kernels either way; the native pass is the one to check")
    plain, _ = run_all(target, requests(None), path=path, max_step_tokens=12)
    draft = draft_of(guesser, path)
    spec, loop = run_all(target, requests(DRAFT), path=path, max_step_tokens=12, draft=draft)
    assert_same(plain, spec)
    gens = [s.generation for s in spec]
    assert all(g.guessed > 0 for g in gens)
    assert 0 < loop.stats.accepted_tokens < loop.stats.guessed_tokens  # guesses kept and guesses rejected
    assert sum(g.decode_steps for g in gens) < sum(s.generation.decode_steps for s in plain)  # fewer passes
    greedy_row = gens[2]  # a greedy row under a draft of the same weights: most guesses right
    assert greedy_row.accepted / greedy_row.guessed > 0.6
    for g in gens:
        assert (g.guessed, g.accepted) == tuple(map(sum, zip(*[(k, a) for _, k, a in g.speculation], strict=True)))


@pytest.mark.parametrize("path", PATHS)
def test_draft_batch_one_equals_the_plain_loop_and_the_draft_holds_the_text(
    fp32: Transformer, int8: Transformer, path: str
) -> None:
    for prompt, pick in zip(PROMPTS, (echo, greedy, echo, greedy), strict=True):
        req = functools.partial(GenerationRequest, prompt=prompt, picker=pick, max_new_tokens=30)
        (plain,), plain_loop = run_all(fp32, [req()], path=path, slots=1)
        draft = draft_of(int8, path, slots=1)
        (spec,), spec_loop = run_all(fp32, [req(speculation=DRAFT)], path=path, slots=1, draft=draft)
        assert_same([plain], [spec])
        text = prompt + spec.generation.tokens[:-1]
        assert spec_loop.cache.held[0] == plain_loop.cache.held[0] == text
        # the draft's slot: a prefix of the text, rejected guesses cut off (they are cut when it next drafts)
        held = draft.cache.held[0]
        kept = draft.cache.common_prefix(0, text)
        assert kept >= len(prompt)  # the prompt ran on the draft with the target's prefill
        assert len(held) - kept <= DRAFT.tokens - 1  # past the text at most the last pass's guesses
        assert int(draft.cache.valid[0].sum()) == draft.cache.lengths[0] == len(held)


def test_the_draft_runs_the_prompt_with_the_target_in_chunks(fp32: Transformer, int8: Transformer) -> None:
    """A prompt in chunks of 4: the draft follows each chunk in the same step, so by the first decode step its
    cache holds the whole prompt, and only the new token runs before the first guess."""
    prompt = PROMPTS[0]
    draft = draft_of(int8, "torch", slots=1)
    cache = SlotCache.for_model(fp32, 1, 128)
    loop = EngineLoop(ModelRunner(fp32, cache, native=False), cache, draft=draft, prefill_chunk=4, max_step_tokens=5)
    loop.scheduler.pass_costs = PriorCosts()
    loop.submit(GenerationRequest(prompt=prompt, picker=greedy, max_new_tokens=8, speculation=DRAFT))
    steps = 0
    while loop.cache.lengths[0] < len(prompt):
        loop.step()
        steps += 1
        assert draft.cache.held[0] == prompt[: loop.cache.lengths[0]]
    assert steps == 3 and draft.steps == 3  # 4 + 4 + 3 prompt tokens, one draft pass each
    loop.run()


def test_a_draft_request_without_a_draft_model_is_refused(fp32: Transformer) -> None:
    cache = SlotCache.for_model(fp32, 2, 64)
    loop = EngineLoop(ModelRunner(fp32, cache, native=False), cache)
    with pytest.raises(ValueError, match=r"load\.draft"):
        loop.submit(GenerationRequest(prompt=[1, 2, 3], picker=greedy, max_new_tokens=4, speculation=DRAFT))
    small = draft_of(fp32, "torch", slots=1)
    with pytest.raises(ValueError, match="1 slots, the target's 2"):
        Scheduler(cache, draft=small)


def test_a_row_stops_drafting_where_guesses_fail_and_tries_again_later() -> None:
    guesser = DraftGuesser(tokens=4)
    prior = lambda k: 1 + 0.15 * k  # noqa: E731
    assert guesser.plan(100, prior, 0.3) >= 1  # the prior (p = 0.6) pays for a guess
    rounds = 0
    while k := guesser.plan(100, prior, 0.3):  # every guess rejected: fewer, then none
        guesser.record(0, k, 0)
        rounds += 1
    assert 1 <= rounds <= 4 and guesser.acceptance() < 0.6
    plain = 0
    while not guesser.plan(100, prior, 0.3):  # plain steps: the estimate drifts back, it tries again
        guesser.observe(0)
        plain += 1
    assert 3 <= plain <= 40
    assert guesser.plan(100, prior, 3.0) == 0  # a draft step as dear as 3 target passes never pays
    assert guesser.plan(0, prior, 0.3) == 0  # no room
    assert guesser.acceptance() <= DRAFT_PRIOR[0] / DRAFT_PRIOR[1]


def test_sampled_answers_with_a_draft_keep_the_distribution_of_plain_sampling() -> None:
    """The draft guesses the chain's likeliest next token (a + 1, p = 0.45 at T 1): accepted about half the
    time; every generated position against its exact distribution, bound as for prompt lookup."""
    samples, loop = sampled(PAIRS_PROMPT, Speculation(method="draft", tokens=3), range(SAMPLES), draft=True)
    rate = loop.stats.accepted_tokens / loop.stats.guessed_tokens
    assert loop.stats.guessed_tokens > SAMPLES and 0.3 < rate < 0.7  # both branches of the rule, often
    for position in range(NEW_SAMPLED):
        assert tv_from_exact(samples, PAIRS_PROMPT[-1], position) < 0.04


def test_a_draft_out_of_memory_leaves_the_answers_as_they_are(fp32: Transformer, int8: Transformer) -> None:
    """Every third draft pass fails for memory: those rows decode on with the guesses made so far (or none),
    the draft's cache stays consistent, and the answers are the plain loop's."""
    draft = draft_of(int8, "torch")
    real, calls = draft.runner.forward, [0]

    def sometimes(batch: FlatBatch, cache: SlotCache) -> torch.Tensor:
        calls[0] += 1
        if calls[0] % 3 == 0:
            raise torch.OutOfMemoryError("out of memory (the test's)")
        return real(batch, cache)

    draft.runner.forward = sometimes  # type: ignore[method-assign]
    plain, _ = run_all(fp32, requests(None), max_step_tokens=12)
    spec, loop = run_all(fp32, requests(DRAFT), max_step_tokens=12, draft=draft)
    assert_same(plain, spec)
    assert calls[0] >= 6 and loop.stats.guessed_tokens > 0
    for slot in range(draft.cache.slots):
        assert int(draft.cache.valid[slot].sum()) == draft.cache.lengths[slot] == len(draft.cache.held[slot])
