"""generate(): batching, padding, the cache policies, finish reasons and error isolation, greedy vs HF."""

from __future__ import annotations

import pytest
import torch
from tiny import load_tiny, make_tiny_llama
from torch import Tensor

from llmplan.llm.generation import ModelRunner, generate
from llmplan.llm.generation.static_batch import Generation
from llmplan.llm.kv import KVCache
from llmplan.llm.model import Transformer
from llmplan.llm.model.rope import apply_rope
from llmplan.llm.sampling import Pick

PAD, EOS = 0, 2
PROMPTS = [[1, 17, 99, 4, 250, 31, 8], [1, 5], [1, 200, 13, 77]]


def greedy(logits: Tensor, seen: list[int]) -> Pick:
    token = int(logits.argmax())
    return Pick(token=token, logprob=float(logits.log_softmax(-1)[token]), top=None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path, hf = make_tiny_llama(tmp_path_factory.mktemp("gen"), seed=3)
    return hf, load_tiny(path)


def run(
    model: Transformer,
    prompts: list[list[int]],
    max_new: int | list[int] = 12,
    *,
    cache_tokens: int = 64,
    eos: set[int] | None = None,
    **kwargs,
) -> list[Generation]:
    inner = getattr(model, "model", model)  # the real model under a _Faulty wrapper
    cache = kwargs.pop("cache", None) or KVCache.for_model(inner, len(prompts), cache_tokens)
    if inner is not model:  # every step goes through the wrapper's __call__, where the fault is injected
        kwargs["runner"] = ModelRunner(model, cache, native=False)  # type: ignore[arg-type]
    return generate(
        model,
        cache,
        prompts,
        pickers=[greedy] * len(prompts),
        max_new_tokens=max_new,
        eos_ids={EOS} if eos is None else eos,
        pad_id=PAD,
        **kwargs,
    )


def test_batched_equals_one_by_one_and_transformers(tiny) -> None:
    hf, ours = tiny
    batched = run(ours, PROMPTS)
    for prompt, gen in zip(PROMPTS, batched, strict=True):
        alone = run(ours, [prompt])[0]
        assert gen.tokens == alone.tokens and gen.finish_reason == alone.finish_reason
        assert gen.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert gen.prompt_tokens == len(prompt)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    with torch.inference_mode():
        want = hf.generate(
            ids,
            attention_mask=(ids != PAD).long(),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )[:, width:].tolist()
    for gen, row in zip(batched, want, strict=True):
        expected = row[: row.index(EOS) + 1] if EOS in row else row
        assert gen.tokens == expected
        assert gen.finish_reason == ("eos" if EOS in row else "length")


def test_chunked_prefill_generates_the_same(tiny) -> None:
    _, ours = tiny
    one = run(ours, PROMPTS)
    chunked = run(ours, PROMPTS, prefill_chunk=3)
    assert [g.tokens for g in chunked] == [g.tokens for g in one]


def test_finish_reasons_streaming_and_timings(tiny) -> None:
    _, ours = tiny
    free = run(ours, PROMPTS, 8, eos=set())
    eos_token = free[0].tokens[3]  # make row 0 stop at its 4th token
    streamed: list[tuple[int, int]] = []
    gens = run(
        ours,
        PROMPTS,
        [8, 8, 0],
        eos={eos_token},
        stop_fn=lambda row, ids: row == 1 and len(ids) == 2,
        on_token=lambda r, t: streamed.append((r, t)),
    )
    first = free[0].tokens.index(eos_token)
    assert gens[0].finish_reason == "eos" and gens[0].tokens == free[0].tokens[: first + 1]
    assert gens[1].finish_reason == "stop_string" and gens[1].tokens == free[1].tokens[:2]
    assert gens[2].finish_reason == "length" and gens[2].tokens == []
    assert sorted(streamed) == sorted((r, t) for r, g in enumerate(gens) for t in g.tokens)
    by_length = run(ours, PROMPTS[:1], 5, eos=set())[0]
    assert by_length.finish_reason == "length" and len(by_length.tokens) == 5
    assert by_length.decode_steps == 4 and by_length.prefill_s > 0
    assert by_length.ttft_s is not None and by_length.ttft_s >= by_length.prefill_s
    assert len(by_length.logprobs) == len(by_length.top_logprobs) == 5
    assert all(lp <= 0 for lp in by_length.logprobs)


def test_cache_full_with_stop_policy(tiny) -> None:
    _, ours = tiny
    gens = run(ours, [PROMPTS[0], PROMPTS[1]], 50, eos=set(), cache_tokens=12)
    # 7 prompt slots; the first token comes from prefill, each further one needs a slot: 1 + 5.
    assert [g.finish_reason for g in gens] == ["cache_full", "cache_full"]
    assert [len(g.tokens) for g in gens] == [6, 6]
    assert run(ours, [list(range(1, 20))], 5, cache_tokens=12)[0].finish_reason == "cache_full"


def _layer0_kv(model: Transformer, tokens: list[int]) -> tuple[Tensor, Tensor]:
    """Layer-0 K (unrotated) and V per token [kv_heads, n, head_dim]: they depend on the token alone."""
    attn = model.layers[0].attention
    x = model.layers[0].attention_norm(model.tok_embeddings(torch.tensor(tokens)))
    _, k, v = attn.wqkv(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    shape = (len(tokens), attn.n_kv_heads, attn.head_dim)
    return k.view(shape).transpose(0, 1), v.view(shape).transpose(0, 1)


def test_slide_keeps_sinks_and_drops_the_oldest(tiny) -> None:
    _, ours = tiny
    prompts = [PROMPTS[0], PROMPTS[1]]  # the second row is left-padded by 5
    cache = KVCache.for_model(ours, 2, 16, policy="slide", sink_tokens=2, evict_chunk=3)
    gens = run(ours, prompts, 30, eos=set(), cache=cache)
    assert [g.finish_reason for g in gens] == ["length", "length"] and all(len(g.tokens) == 30 for g in gens)
    assert cache.evicted > 0 and cache.length <= 16
    with torch.inference_mode():
        for row, (prompt, gen) in enumerate(zip(prompts, gens, strict=True)):
            fed = prompt + gen.tokens[:-1]  # the last pick is never fed back
            valid = cache.valid[row, : cache.length]
            n = int(valid.sum())
            kept = fed[:2] + fed[len(fed) - (n - 2) :]  # the sinks, then the newest tokens
            k_raw, v_want = _layer0_kv(ours, kept)
            torch.testing.assert_close(cache.v[0, row, :, : cache.length][:, valid], v_want)
            # Positions are ranks within the cache: the kept keys were re-rotated to 0..n-1.
            cos, sin = ours.rope_cos[:n], ours.rope_sin[:n]
            k_got = cache.k[0, row, :, : cache.length][:, valid]
            torch.testing.assert_close(k_got, apply_rope(k_raw, cos, sin), atol=1e-5, rtol=1e-5)
            assert cache.pos[row, : cache.length][valid].tolist() == list(range(n))
            assert int(cache.next_pos[row]) == n


def test_slide_is_exact_before_the_cache_fills(tiny) -> None:
    _, ours = tiny
    cache = KVCache.for_model(ours, 3, 64, policy="slide", sink_tokens=2)
    assert [g.tokens for g in run(ours, PROMPTS, cache=cache)] == [g.tokens for g in run(ours, PROMPTS)]


class _Faulty:
    """Wraps the model; on forward call `at` it corrupts one row's logits or raises out-of-memory."""

    def __init__(self, model: Transformer, at: int, row: int | None = None) -> None:
        self.model, self.at, self.row, self.calls = model, at, row, 0
        self.device, self.dtype = model.device, model.dtype

    def __call__(self, *args, **kwargs) -> Tensor:
        self.calls += 1
        out = self.model(*args, **kwargs)
        if self.calls == self.at:
            if self.row is None:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            out = out.clone()
            out[self.row, -1, 7] = float("nan")
        return out


def test_nan_logits_end_only_that_row(tiny) -> None:
    _, ours = tiny
    clean = run(ours, PROMPTS, 8, eos=set())
    gens = run(_Faulty(ours, at=3, row=1), PROMPTS, 8, eos=set())  # type: ignore[arg-type]
    assert gens[1].finish_reason == "error" and "non-finite" in (gens[1].error or "")
    assert gens[1].tokens == clean[1].tokens[:2]  # prefill gave token 1, decode call 2 token 2
    for row in (0, 2):
        assert gens[row].finish_reason == "length" and gens[row].tokens == clean[row].tokens


def test_out_of_memory_ends_running_rows_not_the_run(tiny) -> None:
    _, ours = tiny
    gens = run(_Faulty(ours, at=4), PROMPTS, [2, 8, 8], eos=set())  # type: ignore[arg-type]
    assert gens[0].finish_reason == "length" and len(gens[0].tokens) == 2
    for gen in gens[1:]:
        assert gen.finish_reason == "error" and "out of memory" in (gen.error or "")
        assert len(gen.tokens) == 3
    prefill = run(_Faulty(ours, at=1), PROMPTS, 8)  # type: ignore[arg-type]
    assert all(g.finish_reason == "error" and g.tokens == [] for g in prefill)


def test_finite_rows_flags_nan_and_both_infinities() -> None:
    from llmplan.llm.generation.static_batch import finite_rows

    logits = torch.randn(5, 300)
    logits[1, 7], logits[2, 299], logits[3, 0] = float("nan"), float("inf"), float("-inf")
    assert finite_rows(logits).tolist() == [True, False, False, False, True]
    assert bool(finite_rows(logits[0])) and not bool(finite_rows(logits[1]))
