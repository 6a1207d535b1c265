"""The continuous-batching scheduler against generation alone, on tiny random Llamas, both decode paths.

Reference: each request generated alone by the static `generate()` (batch 1). Through the scheduler a row
shares its steps with rows at other lengths, joining and leaving, so its products run in other batch shapes
and its prompt in chunks: fp32 summation order changes (~1e-7 relative), nothing else. Hence greedy tokens
identical and logprobs / logits within 1e-5 (the tiny models' init is wide: no top-two tie within 1e-5).
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from tiny import load_tiny, make_tiny_llama
from torch import Tensor

from llmplan.llm.generation import EngineLoop, ModelRunner, Scheduler, generate
from llmplan.llm.generation.flat_batch import FlatBatch
from llmplan.llm.generation.fused_decode import FusedDecoder
from llmplan.llm.generation.scheduler import GenerationRequest, Sequence
from llmplan.llm.generation.static_batch import Generation
from llmplan.llm.kernels import native
from llmplan.llm.kv import KVCache, SlotCache
from llmplan.llm.kv.layers import LayerKV
from llmplan.llm.model import Transformer, make_linear, quantize_weight
from llmplan.llm.sampling import Pick

PROMPTS = [
    [1, 17, 99, 4, 250, 31, 8, 40, 41, 9, 12],
    [1, 5, 9],
    [1, 200, 13, 77, 3, 3],
    [1, 17, 99, 4, 250, 31, 60, 61],  # shares 6 tokens with the first
    [1, 44] * 10,
    [1, 8, 8, 8],
]
NEW = [12, 5, 9, 14, 7, 3]
NATIVE = native.kernels() is not None
# With native kernels, every test runs on the AVX2 and on the AVX-512 build (tests/llm/conftest.py).
pytestmark = [pytest.mark.usefixtures("isa_path")] if NATIVE else []
PATHS = ["torch", pytest.param("fused", marks=pytest.mark.skipif(not NATIVE, reason="native kernels unavailable"))]


def greedy(logits: Tensor, seen: list[int]) -> Pick:
    token = int(logits.argmax())
    return Pick(token=token, logprob=float(logits.log_softmax(-1)[token]))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    path, _ = make_tiny_llama(tmp_path_factory.mktemp("sched"), n_layers=3, heads=8, kv_heads=2, seed=11)
    return path


@pytest.fixture(scope="module")
def fp32(tiny_dir) -> Transformer:
    return load_tiny(tiny_dir)


def make_loop(model: Transformer, cache: SlotCache, path: str = "fused", **kw) -> EngineLoop:
    """The engine loop on the backend `path` names (the native pass, where it applies, or the torch modules)."""
    return EngineLoop(ModelRunner(model, cache, native=path == "fused"), cache, **kw)


def alone(model: Transformer, prompt: list[int], new: int) -> Generation:
    cache = KVCache.for_model(model, 1, len(prompt) + new)
    return generate(model, cache, [prompt], pickers=[greedy], max_new_tokens=new, eos_ids=set(), pad_id=0)[0]


def request(prompt: list[int], new: int, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, picker=greedy, max_new_tokens=new, **kw)


def staggered(sched: EngineLoop, prompts: list[list[int]], new: list[int], every: int = 2) -> list[Sequence]:
    """Submit one request every `every` steps while the others run; step until all have ended."""
    seqs: list[Sequence] = []
    pending = list(zip(prompts, new, strict=True))
    step = 0
    while pending or sched.pending:
        if pending and step % every == 0:
            seqs.append(sched.submit(request(*pending.pop(0))))
        sched.step()
        step += 1
    return seqs


@pytest.mark.parametrize("path", PATHS)
def test_requests_arriving_at_different_steps_equal_each_alone(fp32: Transformer, path: str) -> None:
    model = fp32
    sched = make_loop(model, SlotCache.for_model(model, 3, 64), max_step_tokens=8, path=path)  # 3 slots for 6 requests
    seqs = staggered(sched, PROMPTS, NEW)
    for prompt, new, seq in zip(PROMPTS, NEW, seqs, strict=True):
        want = alone(model, prompt, new)
        got = seq.generation
        assert got.tokens == want.tokens and got.finish_reason == "length"
        # torch's CPU GEMM blocks a batch of rows differently from one row, so sums are taken in another order:
        # 1.3e-5 measured on an AVX-512 Zen 5 (fp32 eps 1.2e-7 over ~10^2 terms a dot, a few layers deep)
        assert got.logprobs == pytest.approx(want.logprobs, abs=5e-5)
    assert sched.stats.busy_max == 3 and sched.stats.finished == len(PROMPTS)
    assert sched.stats.reused_tokens >= 6  # the fourth prompt started from the first one's prefix


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_models_through_the_fused_step_equal_alone(tiny_dir, precision: str, monkeypatch) -> None:
    from safetensors.torch import load_file

    from llmplan.llm.model import ModelConfig
    from llmplan.llm.model.weights import fuse_hf_state_dict

    cfg = ModelConfig.from_file(tiny_dir / "config.json")
    weights = fuse_hf_state_dict({k: v for f in tiny_dir.glob("*.safetensors") for k, v in load_file(f).items()}, cfg)
    linear = ("wqkv.weight", "wo.weight", "w13.weight", "w2.weight", "output.weight")
    quantized = {n: quantize_weight(w, precision) if n.endswith(linear) else w for n, w in weights.items()}
    model = Transformer.from_weights(cfg, quantized, linear_factory=functools.partial(make_linear, kernel="auto"))
    calls = []
    original = FusedDecoder.step_rows
    monkeypatch.setattr(FusedDecoder, "step_rows", lambda self, *a: calls.append(1) or original(self, *a))
    seqs = staggered(make_loop(model, SlotCache.for_model(model, 4, 64), max_step_tokens=16), PROMPTS, NEW)
    assert calls, "the fused step did not run"
    for prompt, new, seq in zip(PROMPTS, NEW, seqs, strict=True):
        assert seq.generation.tokens == alone(model, prompt, new).tokens


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable")
def test_decode_rows_and_a_prompt_chunk_share_one_native_pass(fp32: Transformer, monkeypatch) -> None:
    model = fp32
    passes: list[tuple[int, int]] = []  # (inputs, logits rows) per native pass
    original = FusedDecoder.run

    def run(self, tokens, positions, rows, slots, outs):  # type: ignore[no-untyped-def]
        passes.append((len(tokens), len(outs)))
        return original(self, tokens, positions, rows, slots, outs)

    monkeypatch.setattr(FusedDecoder, "run", run)
    sched = make_loop(model, SlotCache.for_model(model, 2, 64), max_step_tokens=8, prefix_reuse=False)
    first = sched.submit(request(PROMPTS[0], 10))
    while not first.generation.tokens:
        sched.step()
    long = sched.submit(request(PROMPTS[4], 6))  # 20 tokens: 7 per step beside the decode row
    passes.clear()
    sched.step()
    assert passes == [(8, 1)]  # one decode token + a 7-token chunk, logits for the decode row only
    sched.run()
    assert passes[:3] == [(8, 1), (8, 1), (7, 2)]  # chunks of 7, 7, 6: the last one's final token gets logits
    assert first.generation.tokens == alone(model, PROMPTS[0], 10).tokens
    assert long.generation.tokens == alone(model, PROMPTS[4], 6).tokens
    assert long.generation.logprobs == pytest.approx(alone(model, PROMPTS[4], 6).logprobs, abs=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_a_cancelled_request_frees_its_slot_and_leaves_the_others_unchanged(fp32: Transformer, path: str) -> None:
    model = fp32
    sched = make_loop(model, SlotCache.for_model(model, 2, 64), max_step_tokens=32, path=path)
    first, doomed = sched.submit(request(PROMPTS[0], 12)), sched.submit(request(PROMPTS[2], 40))
    third = sched.submit(request(PROMPTS[1], 6))  # waits: both slots are taken
    for _ in range(4):
        sched.step()
    assert third.slot is None and len(doomed.generation.tokens) > 0
    sched.cancel(doomed)
    sched.step()
    assert doomed.done.is_set() and doomed.generation.finish_reason == "cancelled"
    assert third.slot == doomed.slot  # admitted into the freed slot in the same step
    sched.run()
    assert first.generation.tokens == alone(model, PROMPTS[0], 12).tokens
    assert third.generation.tokens == alone(model, PROMPTS[1], 6).tokens


def test_cancel_before_admission_ends_without_running(fp32: Transformer) -> None:
    sched = make_loop(fp32, SlotCache.for_model(fp32, 1, 64), max_step_tokens=8)
    running, queued = sched.submit(request(PROMPTS[0], 4)), sched.submit(request(PROMPTS[1], 4))
    sched.cancel(queued)
    sched.run()
    assert queued.generation.finish_reason == "cancelled" and queued.generation.tokens == []
    assert running.generation.finish_reason == "length"


@pytest.mark.parametrize("path", PATHS)
def test_a_row_with_non_finite_state_ends_alone(fp32: Transformer, path: str) -> None:
    model = fp32
    cache = SlotCache.for_model(model, 2, 64)
    sched = make_loop(model, cache, max_step_tokens=32, path=path)
    good, bad = sched.submit(request(PROMPTS[0], 10)), sched.submit(request(PROMPTS[2], 10))
    sched.step()  # both prefilled, first tokens picked
    cache.v[:, bad.slot, :, 1] = float("nan")  # one row's cached state goes bad
    sched.run()
    assert bad.generation.finish_reason == "error" and "non-finite" in (bad.generation.error or "")
    assert len(bad.generation.tokens) == 1
    assert good.generation.tokens == alone(model, PROMPTS[0], 10).tokens


@pytest.mark.parametrize("path", PATHS)
def test_out_of_memory_ends_only_the_rows_that_fail_alone(fp32: Transformer, path: str, monkeypatch) -> None:
    model = fp32
    sched = make_loop(model, SlotCache.for_model(model, 3, 64), path, max_step_tokens=64)
    seqs = [sched.submit(request(p, 8)) for p in PROMPTS[:3]]
    heavy = seqs[1]
    original = ModelRunner.forward

    def forward(self: ModelRunner, batch: FlatBatch, cache: SlotCache) -> Tensor:
        if any(p.row == heavy.slot for p in batch.parts) and len(heavy.generation.tokens) == 3:
            raise torch.OutOfMemoryError("CPU out of memory: tried to allocate 9 GiB")
        return original(self, batch, cache)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    sched.run()
    assert heavy.generation.finish_reason == "error" and "out of memory" in (heavy.generation.error or "")
    for i in (0, 2):
        assert seqs[i].generation.tokens == alone(model, PROMPTS[i], 8).tokens


@pytest.mark.parametrize("path", PATHS)
def test_prefix_reuse_gives_the_logits_of_recomputation(fp32: Transformer, path: str) -> None:
    model = fp32
    shared = [1, 30, 31, 32, 33, 34, 35, 36, 37, 38]

    def logits_of(reuse: bool) -> tuple[list[Tensor], int]:
        sched = make_loop(model, SlotCache.for_model(model, 2, 64), max_step_tokens=16, prefix_reuse=reuse, path=path)
        sched.submit(request([*shared, 50, 51], 3))  # leaves its K/V in its slot
        sched.run()
        seen: list[Tensor] = []

        def record(logits: Tensor, ids: list[int]) -> Pick:
            seen.append(logits.clone())
            return greedy(logits, ids)

        sched.submit(GenerationRequest([*shared, 70, 71, 72], record, 6))
        sched.run()
        return seen, sched.stats.reused_tokens

    reused, n = logits_of(True)
    recomputed, none = logits_of(False)
    assert n == len(shared) and none == 0
    for a, b in zip(reused, recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_prefix_is_copied_from_a_running_row(fp32: Transformer) -> None:
    cache = SlotCache.for_model(fp32, 2, 64)
    sched = make_loop(fp32, cache, max_step_tokens=32)
    first = sched.submit(request(PROMPTS[0], 10))
    sched.step()
    second = sched.submit(request(PROMPTS[3], 6))  # shares 6 tokens with the running first prompt
    sched.run()
    assert second.reused == 6 and second.slot != first.slot
    assert second.generation.tokens == alone(fp32, PROMPTS[3], 6).tokens


def test_a_long_prompt_holds_decoding_rows_back_by_one_chunk_per_step(fp32: Transformer) -> None:
    sched = make_loop(fp32, SlotCache.for_model(fp32, 2, 128), max_step_tokens=8)
    short = sched.submit(request(PROMPTS[1], 30))
    sched.step()
    tokens_before = len(short.generation.tokens)
    long = sched.submit(request(list(range(1, 90)), 2))
    steps = 0
    while not long.generation.tokens:
        sched.step()
        steps += 1
        # the short row got its token in every one of these steps
        assert len(short.generation.tokens) == tokens_before + steps
    assert steps == -(-89 // 7)  # 7 prompt tokens beside each decode token: ceil(89 / 7) steps
    sched.run()
    assert short.generation.tokens == alone(fp32, PROMPTS[1], 30).tokens
    assert long.generation.tokens == alone(fp32, list(range(1, 90)), 2).tokens


def test_a_full_slot_ends_that_row_with_cache_full(fp32: Transformer) -> None:
    sched = make_loop(fp32, SlotCache.for_model(fp32, 2, 16), max_step_tokens=32)
    small, big = sched.submit(request([1, 5], 4)), sched.submit(request(PROMPTS[0], 50))
    sched.run()
    assert big.generation.finish_reason == "cache_full" and len(big.generation.tokens) == 16 - 11 + 1
    assert small.generation.finish_reason == "length"
    with pytest.raises(ValueError, match="does not fit a slot of 16"):
        sched.submit(request(list(range(1, 20)), 2))


def test_stop_and_eos_end_rows_as_generate_does(fp32: Transformer) -> None:
    want = alone(fp32, PROMPTS[0], 12).tokens
    sched = make_loop(fp32, SlotCache.for_model(fp32, 2, 64), max_step_tokens=32)
    eos = sched.submit(request(PROMPTS[0], 12, eos_ids=frozenset({want[4]})))
    stop = sched.submit(request(PROMPTS[0], 12, stop=lambda ids: ids[-2:] == want[2:4]))
    got: list[int] = []
    streamed = sched.submit(request(PROMPTS[0], 12, on_token=got.append))
    sched.run()
    assert eos.generation.tokens == want[: want.index(want[4]) + 1] and eos.generation.finish_reason == "eos"
    assert stop.generation.tokens == want[:4] and stop.generation.finish_reason == "stop_string"
    assert got == want == streamed.generation.tokens


def test_submissions_from_other_threads_while_serving(fp32: Transformer) -> None:
    sched = make_loop(fp32, SlotCache.for_model(fp32, 4, 64), max_step_tokens=32)
    stop = threading.Event()
    worker = threading.Thread(target=sched.serve, args=(stop,), daemon=True)
    worker.start()
    try:
        seqs: list[Sequence] = []
        threads = [
            threading.Thread(target=lambda p=p, n=n: seqs.append(sched.submit(request(p, n))))
            for p, n in zip(PROMPTS, NEW, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for seq in seqs:
            assert seq.done.wait(30)
    finally:
        stop.set()
        worker.join(10)
    assert not worker.is_alive()
    for seq in seqs:
        assert seq.generation.tokens == alone(fp32, seq.request.prompt, seq.request.max_new_tokens).tokens


def test_max_step_tokens_must_leave_room_for_a_prompt_chunk(fp32: Transformer) -> None:
    with pytest.raises(ValueError, match="must exceed the running rows"):
        Scheduler(SlotCache.for_model(fp32, 4, 64), max_step_tokens=4)


def test_every_submission_wakes_whoever_steps_the_scheduler(fp32: Transformer) -> None:
    """The wake-up callback stays set across steps: an idle server admits a request at once, not after a poll."""
    sched = make_loop(fp32, SlotCache.for_model(fp32, 2, 64), max_step_tokens=32)
    woken: list[int] = []
    sched.on_work = lambda: woken.append(1)
    sched.submit(request(PROMPTS[0], 2))
    sched.run()
    sched.submit(request(PROMPTS[1], 2))
    assert len(woken) == 2


class FakeRunner:
    """A model runner that computes nothing: logits that make token (row + 1) the pick, one row per wanted part."""

    def __init__(self, vocab: int = 32) -> None:
        self.vocab, self.batches = vocab, []
        self.spans: list[tuple[float, float]] = []
        self.model = torch.nn.Module()  # the loop asks only for its device, on out-of-memory

    def forward(self, batch: FlatBatch, cache: SlotCache) -> Tensor:
        self.batches.append([(p.row, p.start, list(p.tokens), p.logits) for p in batch.parts])
        self.spans = [(0.0, 0.0)] * len(batch.parts)
        logits = torch.zeros(len(batch.wanted), self.vocab)
        for i, part in enumerate(batch.wanted):
            logits[i, batch.parts[part].row + 1] = 1.0
        return logits


def test_the_scheduler_decides_and_a_fake_runner_computes() -> None:
    """The loop with no model at all: the scheduler hands out tokens for rows, the runner gets them as one
    flat batch per step (decode rows first, then prompt chunks in budget), the post-step picks and ends."""
    store = LayerKV(1, 2, 1, 16, 2, dtype=torch.float32)
    cache = SlotCache(store, torch.zeros(2, 16, dtype=torch.bool))
    runner = FakeRunner()
    loop = EngineLoop(runner, cache, max_step_tokens=6, prefix_reuse=False)  # type: ignore[arg-type]
    first = loop.submit(request([3, 4, 5], 2))
    second = loop.submit(request([7, 8, 9, 10, 11, 12, 13], 1))
    loop.run()
    assert runner.batches[0] == [(0, 0, [3, 4, 5], True), (1, 0, [7, 8, 9], False)]  # 6 tokens: the budget
    assert runner.batches[1] == [(0, 3, [1], True), (1, 3, [10, 11, 12, 13], True)]  # a decode row rides along
    assert first.generation.tokens == [1, 1] and second.generation.tokens == [2]
    assert first.generation.finish_reason == second.generation.finish_reason == "length"
    assert len(runner.batches) == 2 and loop.stats.prefill_tokens == 10 and loop.stats.decode_tokens == 1


def test_the_scheduler_module_imports_no_model() -> None:
    """llm/generation/scheduler.py decides only: importing it loads neither the model, the native pass nor the runner."""
    import subprocess
    import sys

    code = (
        "import sys, llmplan.llm.generation.scheduler\n"
        "bad = [m for m in ('llmplan.llm.model.transformer', 'llmplan.llm.generation.fused_decode', 'llmplan.llm.generation.model_runner') if m in sys.modules]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
