"""The native fused decode step against the torch modules it replaces, on tiny random Llamas.

Tolerance: both paths compute in fp32; they differ only in summation order (the fused GEMMs sum 8 lanes
then across; attention normalizes after, not during, the weighted sum), ~1e-7 relative per op. Over a few
layers and 20 steps that stays below 1e-5 relative: the bound. Greedy tokens must be identical (the tiny
models' init is wide, so their top-two logits are never within 1e-5 of each other).
"""

from __future__ import annotations

import functools

import pytest
import torch
from tiny import load_tiny, make_tiny_llama
from torch import Tensor

from llmplan.llm.generation import ModelRunner, generate
from llmplan.llm.generation.beam_search import beam_search
from llmplan.llm.generation.flat_batch import FlatBatch, Part
from llmplan.llm.generation.fused_decode import FusedDecoder
from llmplan.llm.kernels import native
from llmplan.llm.kv import KVCache, SlotCache
from llmplan.llm.model import Transformer, make_linear, quantize_weight
from llmplan.llm.sampling import Pick

pytestmark = [
    pytest.mark.skipif(native.kernels() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"),
    pytest.mark.usefixtures("isa_path"),  # each test on the AVX2 and the AVX-512 build (tests/llm/conftest.py)
]
PAD = 0
PROMPTS = [[1, 17, 99, 4, 250, 31, 8, 40, 41], [1, 5, 9], [1, 200, 13, 77, 3, 3]]
LINEARS = ("wqkv.weight", "wo.weight", "w13.weight", "w2.weight")


def greedy(logits: Tensor, seen: list[int]) -> Pick:
    token = int(logits.argmax())
    return Pick(token=token, logprob=float(logits.log_softmax(-1)[token]))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    path, _ = make_tiny_llama(tmp_path_factory.mktemp("fused"), n_layers=3, heads=8, kv_heads=2, tie=True, seed=7)
    return path


def _model(path, precision: str) -> Transformer:
    if precision == "fp32":
        return load_tiny(path)
    from safetensors.torch import load_file

    from llmplan.llm.model import ModelConfig
    from llmplan.llm.model.weights import fuse_hf_state_dict

    cfg = ModelConfig.from_file(path / "config.json")
    weights = fuse_hf_state_dict({k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}, cfg)
    # "bf16-inputs": bf16 weights whose products round x to bf16 (LINEAR_BF16_INPUTS in the fused step)
    stored = "bf16" if precision == "bf16-inputs" else precision
    quantized = {
        n: quantize_weight(w, stored) if n.endswith(LINEARS) or n == "output.weight" else w for n, w in weights.items()
    }
    factory = functools.partial(make_linear, kernel="auto", bf16_inputs=precision == "bf16-inputs")
    # bf16/fp16 weights stay 16-bit under fp32 activations, as load.to_device builds them
    return Transformer.from_weights(cfg, quantized, linear_factory=factory, keep_linear_dtype=True)


class Counting:
    """Counts the fused steps that ran, so a test knows which path it measured."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = FusedDecoder.step

        def step(decoder: FusedDecoder, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls += 1
            return original(decoder, *args, **kwargs)

        monkeypatch.setattr(FusedDecoder, "step", step)


def _generate(
    model: Transformer, prompts: list[list[int]], fused: bool, *, reference: bool = False, **cache_kw
) -> list[list[int]]:
    cache = KVCache.for_model(model, len(prompts), cache_kw.pop("max_tokens", 64), **cache_kw)
    runner = ModelRunner(model, cache, native=fused)
    if reference:
        runner.use_reference()
    gens = generate(
        model,
        cache,
        prompts,
        pickers=[greedy] * len(prompts),
        max_new_tokens=20,
        eos_ids=set(),
        pad_id=PAD,
        runner=runner,
    )
    return [g.tokens for g in gens]


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4", "bf16", "fp16", "bf16-inputs"])
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one", "padded-batch"])
def test_fused_generates_the_torch_paths_tokens(tiny_dir, precision, prompts, monkeypatch) -> None:
    model = _model(tiny_dir, precision)
    counter = Counting(monkeypatch)
    want = _generate(model, prompts, fused=False)
    assert counter.calls == 0
    assert _generate(model, prompts, fused=True) == want
    assert counter.calls == 19  # every decode step after the prefill's first token


@pytest.mark.parametrize("precision", ["fp32", "int8", "bf16", "bf16-inputs"])
def test_fused_logits_match_the_torch_path(tiny_dir, precision: str) -> None:
    model = _model(tiny_dir, precision)
    rows = []
    for fused in (False, True):
        cache = KVCache.for_model(model, 3, 40)
        runner = ModelRunner(model, cache, native=fused)
        width = max(map(len, PROMPTS))
        tokens = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
        valid = tokens != PAD
        positions = (valid.cumsum(1) - 1).clamp(min=0)
        steps = []
        with torch.inference_mode():
            runner.static_prefill(tokens, positions, cache, valid, logits=False)
            for token in (7, 99, 3, 250, 12):
                steps.append(runner.static_decode(torch.full((3, 1), token), cache.next_positions(), cache))
        rows.append(torch.cat(steps, 1))
    torch_path, fused_path = rows
    assert (fused_path - torch_path).abs().max() <= 1e-5 * torch_path.abs().max()


# The fused prefill: a left-padded batch, whole or in chunks of 4 columns (chunks that start after slot 0,
# some all padding for the short rows), against the torch modules; then decode steps over the cache it wrote.
# cap: at most 4 inputs a pass (MAX_PASS_INPUTS), so a chunk runs column by column over 3 rows.
@pytest.mark.parametrize("precision", ["fp32", "int8", "int4", "bf16", "bf16-inputs"])
@pytest.mark.parametrize(("chunk", "cap"), [(None, None), (4, None), (None, 4)])
def test_fused_prefill_matches_the_torch_prefill(
    tiny_dir, precision: str, chunk: int | None, cap: int | None, monkeypatch
) -> None:
    from llmplan.llm.generation import fused_decode

    if cap is not None:
        monkeypatch.setattr(fused_decode, "MAX_PASS_INPUTS", cap)
    model = _model(tiny_dir, precision)
    calls: list[int] = []
    original = FusedDecoder.run

    def counted(decoder, tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(tokens))
        return original(decoder, tokens, *args, **kwargs)

    monkeypatch.setattr(FusedDecoder, "run", counted)
    width = max(map(len, PROMPTS))
    tokens = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    valid = tokens != PAD
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    found = []
    for fused in (False, True):
        cache = KVCache.for_model(model, 3, 40)
        runner = ModelRunner(model, cache, native=fused)
        step = chunk or width
        with torch.inference_mode():
            for lo in range(0, width, step):
                hi = min(lo + step, width)
                part = (tokens[:, lo:hi], positions[:, lo:hi], cache, valid[:, lo:hi])
                last = runner.static_prefill(*part, logits=hi == width)
            after = [runner.static_decode(torch.full((3, 1), t), cache.next_positions(), cache) for t in (7, 99, 3)]
        assert last is not None and last.shape == (3, 1, model.cfg.vocab_size)
        found.append(torch.cat([last, *after], 1))
    torch_path, fused_path = found
    assert sum(calls) == int(valid.sum())  # the real tokens only, padding never computed
    # int4: passes of 1..8 inputs (the 3-row decode steps; column by column, a column with one real token) take
    # the kernels that round x to 16 bits per group, where an x that differs in its last bit between the paths
    # may move by a rounding step (measured 2.4e-4 and 2.5e-4); the many-rows products are fp32 in both.
    bound = 1e-3 if precision == "int4" else 1e-5
    assert (fused_path - torch_path).abs().max() <= bound * torch_path.abs().max()


def test_fused_slides_the_cache_like_the_torch_path(tiny_dir) -> None:
    model = _model(tiny_dir, "fp32")
    kw = {"max_tokens": 16, "policy": "slide", "sink_tokens": 2, "evict_chunk": 3}
    assert _generate(model, PROMPTS, fused=True, **kw) == _generate(model, PROMPTS, fused=False, **kw)


def test_fused_beam_search_finds_the_same_beams(tiny_dir, monkeypatch) -> None:
    model = _model(tiny_dir, "fp32")
    counter = Counting(monkeypatch)
    results = []
    for fused in (False, True):
        cache = KVCache.for_model(model, 4, 64)
        runner = ModelRunner(model, cache, native=fused)
        found = beam_search(model, cache, PROMPTS[0], num_beams=4, max_new_tokens=12, eos_ids={2}, runner=runner)
        results.append([(c.tokens, round(c.score, 4)) for c in found])
    assert counter.calls > 0 and results[0] == results[1]


def test_an_observer_that_hooks_the_layers_gets_the_torch_modules(tiny_dir, monkeypatch) -> None:
    model = _model(tiny_dir, "fp32")
    seen: list[int] = []
    handle = model.layers[1].attention.register_forward_hook(lambda m, i, o: seen.append(1))
    counter = Counting(monkeypatch)
    _generate(model, PROMPTS[:1], fused=True, reference=True)  # what observe asks for when it hooks
    assert counter.calls == 0 and len(seen) == 20  # the prefill and 19 decode steps ran the module
    handle.remove()
    _generate(model, PROMPTS[:1], fused=True)
    assert counter.calls == 19


def test_models_that_do_not_fit_are_refused(tiny_dir) -> None:
    cache = KVCache.for_model(_model(tiny_dir, "fp32"), 1, 16)
    assert FusedDecoder.build(_model(tiny_dir, "fp32"), cache) is not None
    bf16 = load_tiny(tiny_dir, dtype=torch.bfloat16)
    assert FusedDecoder.build(bf16, KVCache.for_model(bf16, 1, 16)) is None  # bf16 activations
    reference = load_tiny(tiny_dir, linear_factory=lambda w: make_linear(quantize_weight(w, "int8"), "reference"))
    assert FusedDecoder.build(reference, KVCache.for_model(reference, 1, 16)) is None  # a reference kernel
    fp32 = _model(tiny_dir, "fp32")
    double_cache = KVCache.for_model(fp32, 1, 16, dtype=torch.float64)
    assert FusedDecoder.build(fp32, double_cache) is None


# A 16-bit KV cache: both paths round K/V to the cache's dtype the same way (round to nearest even, as torch
# casts) and attend over the widened values, and the fused pass (prefill included) keeps running instead of
# falling back to the torch modules. Their fp32 K/V differ in summation order (~1e-7), which now and then
# moves a value across a rounding boundary: that element then differs by one 16-bit step (2^-11 relative for
# fp16, 2^-8 for bf16). Hence: almost every stored element identical, none off by more than one step (plus
# the fp32 difference itself, 1e-5 of the scale, for elements far below it), and logits within 1e-3 relative
# (measured: ~1e-5 for fp16).
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_pass_on_a_16_bit_kv_cache_matches_the_torch_path(tiny_dir, dtype: torch.dtype, monkeypatch) -> None:
    model = _model(tiny_dir, "fp32")
    counter = Counting(monkeypatch)
    assert FusedDecoder.build(model, KVCache.for_model(model, 1, 16, dtype=dtype)) is not None
    rows = []
    for fused in (False, True):
        cache = KVCache.for_model(model, 3, 40, dtype=dtype)
        runner = ModelRunner(model, cache, native=fused)
        width = max(map(len, PROMPTS))
        tokens = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
        valid = tokens != PAD
        positions = (valid.cumsum(1) - 1).clamp(min=0)
        with torch.inference_mode():
            first = runner.static_prefill(tokens, positions, cache, valid, logits=True)
            steps = [runner.static_decode(torch.full((3, 1), t), cache.next_positions(), cache) for t in (7, 99, 3)]
        assert first is not None
        rows.append((torch.cat([first, *steps], 1), cache.k.clone()))
    (torch_path, torch_k), (fused_path, fused_k) = rows
    assert counter.calls == 3  # the decode steps ran fused on the second pass only
    assert (fused_path - torch_path).abs().max() <= 1e-3 * torch_path.abs().max()
    stored = torch_k != 0
    a, b = fused_k[stored].float(), torch_k[stored].float()
    step = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    # one step, plus the paths' fp32 difference (1e-5 of the scale) for elements far below the scale
    one_step = step * torch.maximum(a.abs(), b.abs()) + 1e-5 * b.abs().max()
    assert stored.any() and (a == b).float().mean() > 0.99 and ((a - b).abs() <= one_step).all()


# Runs of 16 or more inputs of one row (prompt chunks) attend in blocks (attend_block in cpu_kernels.c: a
# block's queries against a step of 64 slots at once, an online softmax), shorter runs input by input. Prompts
# of 150, 23, 17 and 5 tokens, left-padded to 150 (the blocks start past padding slots, which they must skip;
# the longest row's later blocks take three steps, so the running maxima rescale), whole or in chunks of 20
# columns (later chunks' blocks attend over earlier chunks' slots; a row's first inputs in a chunk may stay
# single); head dims 8 (below one vector) and 96 (whole register tiles and a remainder).
LONG_PROMPTS = [[(i * 37) % 250 + 3 for i in range(150)], list(range(50, 73)), list(range(100, 117)), [1, 5, 9, 11]]


@pytest.fixture(scope="module")
def wide_head_dir(tmp_path_factory: pytest.TempPathFactory):
    path, _ = make_tiny_llama(tmp_path_factory.mktemp("hd96"), hidden=192, heads=2, kv_heads=1, seed=3)
    return path


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunk", [None, 20])
@pytest.mark.parametrize("head", ["hd8", "hd96"])
def test_prompt_chunks_attend_in_blocks_like_the_torch_path(
    tiny_dir, wide_head_dir, head: str, chunk: int | None, kv_dtype: torch.dtype
) -> None:
    model = load_tiny(tiny_dir if head == "hd8" else wide_head_dir)
    n, width = len(LONG_PROMPTS), max(map(len, LONG_PROMPTS))
    tokens = torch.tensor([[PAD] * (width - len(p)) + p for p in LONG_PROMPTS])
    valid = tokens != PAD
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    found = []
    for fused in (False, True):
        cache = KVCache.for_model(model, n, 160, dtype=kv_dtype)
        runner = ModelRunner(model, cache, native=fused)
        assert runner.backend == ("native" if fused else "torch")
        step = chunk or width
        with torch.inference_mode():
            for lo in range(0, width, step):
                hi = min(lo + step, width)
                last = runner.static_prefill(
                    tokens[:, lo:hi], positions[:, lo:hi], cache, valid[:, lo:hi], logits=hi == width
                )
            after = [runner.static_decode(torch.full((n, 1), t), cache.next_positions(), cache) for t in (7, 99)]
        assert last is not None
        found.append(torch.cat([last, *after], 1))
    torch_path, fused_path = found
    # fp16 K/V: an element the paths round to neighbouring fp16 values moves the scores by a rounding step
    bound = 1e-5 if kv_dtype == torch.float32 else 1e-3
    assert (fused_path - torch_path).abs().max() <= bound * torch_path.abs().max()


def test_a_flat_batch_with_long_chunks_gives_the_same_on_both_backends(tiny_dir) -> None:
    """A pass with a 20-input prompt chunk (blocks) beside a 3-input one and decode rows (single inputs)."""
    model = _model(tiny_dir, "fp32")
    long_a, long_b = list(range(3, 23)), list(range(30, 48))
    passes = [
        [Part(0, 0, long_a, True), Part(1, 0, [1, 5, 9], True)],
        [Part(0, 20, [7], True), Part(1, 3, long_b, True), Part(2, 0, long_a[:17], False)],
        [Part(2, 17, long_b, True), Part(0, 21, [8], True), Part(1, 21, [9], True)],
    ]
    found = []
    for fused in (False, True):
        cache = SlotCache.for_model(model, 3, 64)
        runner = ModelRunner(model, cache, native=fused)
        out = []
        with torch.inference_mode():
            for parts in passes:
                cache.claim([p.row for p in parts], [p.tokens for p in parts])
                out.append(runner.forward(FlatBatch(parts), cache))
        found.append(torch.cat(out))
    torch_logits, fused_logits = found
    assert torch_logits.shape[0] == 7
    assert (fused_logits - torch_logits).abs().max() <= 1e-5 * torch_logits.abs().max()


def test_the_backend_is_chosen_once_when_the_runner_is_built(tiny_dir) -> None:
    model = _model(tiny_dir, "fp32")
    runner = ModelRunner(model, KVCache.for_model(model, 1, 16))
    assert runner.backend == ("native" if native.kernels() is not None else "torch")
    runner.use_reference()
    assert runner.backend == "torch"
    bf16 = load_tiny(tiny_dir, dtype=torch.bfloat16)
    assert ModelRunner(bf16, KVCache.for_model(bf16, 1, 16)).backend == "torch"  # the native pass does not fit
    assert ModelRunner(model, KVCache.for_model(model, 1, 16), native=False).backend == "torch"


# One flat batch, both backends: decode rows at different lengths beside prompt chunks (one that wants no
# logits, one whose last token does), then decode rows alone. Same logits, same K/V.
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_flat_batch_gives_the_same_on_both_backends(tiny_dir, precision: str) -> None:
    model = _model(tiny_dir, precision)
    passes = [
        [Part(0, 0, [1, 17, 99, 4, 250], True), Part(1, 0, [1, 5, 9], True), Part(2, 0, [1, 200, 13], False)],
        [Part(0, 5, [7], True), Part(1, 3, [31], True), Part(2, 3, [77, 3, 3], True)],
        [Part(0, 6, [8], True), Part(2, 6, [40], True), Part(1, 4, [9], True)],
    ]
    found = []
    for fused in (False, True):
        cache = SlotCache.for_model(model, 3, 32)
        runner = ModelRunner(model, cache, native=fused)
        out = []
        with torch.inference_mode():
            for parts in passes:
                cache.claim([p.row for p in parts], [p.tokens for p in parts])
                out.append(runner.forward(FlatBatch(parts), cache))
        assert [o.shape[0] for o in out] == [2, 3, 3]
        found.append((torch.cat(out), cache.k.clone(), cache.v.clone()))
    (torch_logits, torch_k, torch_v), (fused_logits, fused_k, fused_v) = found
    assert (fused_logits - torch_logits).abs().max() <= 1e-5 * torch_logits.abs().max()
    torch.testing.assert_close(fused_k, torch_k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fused_v, torch_v, atol=1e-5, rtol=1e-4)


def test_out_of_range_token_ids_raise_instead_of_reading_past_the_table(tiny_dir) -> None:
    model = _model(tiny_dir, "fp32")
    cache = KVCache.for_model(model, 1, 16)
    with torch.inference_mode():
        model(torch.tensor([[1, 5]]), torch.tensor([[0, 1]]), cache)
        with pytest.raises(IndexError, match="token ids"):
            runner = ModelRunner(model, cache)
            runner.static_decode(torch.tensor([[model.cfg.vocab_size]]), cache.next_positions(), cache)
