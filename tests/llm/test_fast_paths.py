"""The attention/norm/RoPE fast paths against the plain ones: same greedy tokens in fp32, bounded error in int8/int4.

Plain paths: attention always with an explicit mask and SDPA's GQA (`MaskedCache` forces the cache's
"padded" state), RoPE with `apply_rope`, RMSNorm written out op by op.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from tiny import load_tiny, make_tiny_llama
from torch import Tensor

from llmplan.llm.generation import generate
from llmplan.llm.kernels import native
from llmplan.llm.kv import KVCache
from llmplan.llm.model import Transformer, make_linear, quantize_weight
from llmplan.llm.model.rope import apply_rope, apply_rope_full, rope_tables
from llmplan.llm.model.transformer import RMSNorm
from llmplan.llm.model.weights import fuse_hf_state_dict
from llmplan.llm.sampling import Pick

PAD = 0
PROMPTS = [[1, 17, 99, 4, 250, 31, 8, 40, 41], [1, 5, 9], [1, 200, 13, 77, 3, 3]]


class MaskedCache(KVCache):
    """A cache that always claims padding: every forward then takes the explicit-mask attention path."""

    @property  # type: ignore[override]
    def padded(self) -> bool:
        return True

    @padded.setter
    def padded(self, value: bool) -> None:
        pass


def greedy(logits: Tensor, seen: list[int]) -> Pick:
    token = int(logits.argmax())
    return Pick(token=token, logprob=float(logits.log_softmax(-1)[token]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path, hf = make_tiny_llama(tmp_path_factory.mktemp("fast"), n_layers=3, heads=8, kv_heads=2, seed=5)
    return path, hf, load_tiny(path)


def _gen(model: Transformer, prompts: list[list[int]], cache_cls: type[KVCache] = KVCache, **kw) -> list[list[int]]:
    cache = cache_cls.for_model(model, len(prompts), 64, **kw)
    gens = generate(
        model, cache, prompts, pickers=[greedy] * len(prompts), max_new_tokens=20, eos_ids=set(), pad_id=PAD
    )
    return [g.tokens for g in gens]


@pytest.mark.parametrize("prompts", [PROMPTS[:1], [PROMPTS[0][:6]] * 3, PROMPTS], ids=["one", "equal", "padded"])
def test_fast_paths_generate_the_plain_paths_tokens(tiny, prompts: list[list[int]]) -> None:
    _, _, ours = tiny
    assert _gen(ours, prompts) == _gen(ours, prompts, MaskedCache)


def test_fast_paths_match_transformers_greedy(tiny) -> None:
    _, hf, ours = tiny
    prompt = PROMPTS[0]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert _gen(ours, [prompt])[0] == want[0, len(prompt) :].tolist()


def test_decode_logits_close_to_the_masked_path(tiny) -> None:
    _, _, ours = tiny
    tokens = torch.tensor([PROMPTS[0]])
    positions = torch.arange(tokens.shape[1])[None]
    out = []
    for cls in (KVCache, MaskedCache):
        cache = cls.for_model(ours, 1, 32)
        with torch.inference_mode():
            ours(tokens, positions, cache, last_only=True)
            step = torch.tensor([[7]])
            out.append(ours(step, cache.next_positions(), cache))
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=0)


def test_padded_flag_tracks_padding(tiny) -> None:
    _, _, ours = tiny
    cache = KVCache.for_model(ours, 2, 32)
    cache.reset(2)
    cache.append(torch.arange(3).expand(2, 3))
    assert not cache.padded
    cache.append(torch.zeros(2, 1, dtype=torch.long), torch.tensor([[True], [False]]))
    assert cache.padded
    cache.reset(1)
    assert not cache.padded


def test_slide_eviction_clears_the_padded_flag(tiny) -> None:
    _, _, ours = tiny
    cache = KVCache.for_model(ours, 2, 16, policy="slide", sink_tokens=1, evict_chunk=4)
    cache.reset(2)
    valid = torch.tensor([[False, False, True, True], [True, True, True, True]])
    cache.append((valid.cumsum(1) - 1).clamp(min=0), valid)
    assert cache.padded
    cache.evict(3)  # padding goes first: none is left
    assert not cache.padded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_full_is_bit_identical(dtype: torch.dtype) -> None:
    x = torch.randn(2, 5, 6, 16, dtype=dtype)
    angles = torch.randn(2, 5, 1, 8)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cos2, sin2 = rope_tables(cos, sin)
    assert torch.equal(apply_rope_full(x, cos2, sin2), apply_rope(x, cos, sin))


def test_rms_norm_fused_matches_the_written_out_one() -> None:
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64)
    x = torch.randn(3, 7, 64) * 5
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), norm.weight * h, atol=1e-6, rtol=1e-6)


def test_grouped_decode_attention_equals_gqa_sdpa() -> None:
    b, h, kv, s, d = 3, 6, 2, 11, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, kv, s, d), torch.randn(b, kv, s, d)
    mask = torch.rand(b, 1, 1, s) > 0.3
    mask[..., -1] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = F.scaled_dot_product_attention(q.reshape(b, kv, h // kv, d), k, v, attn_mask=mask)
    torch.testing.assert_close(got.reshape(b, h, 1, d), want, atol=1e-6, rtol=1e-5)


# The fast int8/int4 kernels against the reference kernel on the same quantized weights, so the bound is
# the kernel's own error: bf16 rounding of the activations (8 mantissa bits, ~2e-3 per element, compounding
# over 2 layers) and, for int4, the one-time re-quantization to per-channel int8 (0.75% weight error).
# Measured on this tiny model: int8 ~0.02, int4 ~0.03. The quantization itself is bounded in test_quantize.
@pytest.mark.parametrize(("precision", "bound"), [("int8", 0.04), ("int4", 0.06)])
def test_quantized_fast_paths_have_bounded_error(tiny, precision: str, bound: float) -> None:
    path, _, _ = tiny
    from safetensors.torch import load_file

    from llmplan.llm.model import ModelConfig

    cfg = ModelConfig.from_file(path / "config.json")
    weights = fuse_hf_state_dict(
        {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}, cfg, strict=True
    )
    linear = ("wqkv.weight", "wo.weight", "w13.weight", "w2.weight")
    quantized = {
        n: quantize_weight(w, precision) if n.endswith(linear) or n == "output.weight" else w
        for n, w in weights.items()
    }
    models = {
        kernel: Transformer.from_weights(cfg, quantized, linear_factory=functools.partial(make_linear, kernel=kernel))
        for kernel in ("auto", "reference")
    }
    tokens = torch.tensor([PROMPTS[0] * 3])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.inference_mode():
        exact = models["reference"](tokens, positions)
        approx = models["auto"](tokens, positions)
    rel = float((approx - exact).norm() / exact.norm())
    assert 0 < rel < bound, rel  # > 0: the fast kernel really ran


@pytest.mark.parametrize("with_native", [False, True])
def test_wide_fp32_head_matches_f_linear(with_native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if with_native and native.kernels() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    if not with_native:
        monkeypatch.setattr(native, "kernels", lambda: None)
    w = torch.randn(20000, 64)
    module = make_linear(w)
    module.prepack()
    # without the native kernel a transposed copy serves few rows; with it, no copy (113 MB for SmolLM2)
    assert (module._transposed is None) == with_native
    for rows in (1, 4, 40):  # 40 rows: back on F.linear
        x = torch.randn(rows, 64)
        torch.testing.assert_close(module(x), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 100])
def test_int8_few_and_many_rows_agree_with_the_reference(rows: int) -> None:
    q = quantize_weight(torch.randn(256, 128), "int8")
    fast, reference = make_linear(q, "auto"), make_linear(q, "reference")
    fast.prepack()
    x = torch.randn(rows, 128)
    # bf16 activations on the few-rows kernel (~2^-9 relative); the many-rows path is the exact product
    tolerance = 2e-2 if rows == 1 else 1e-5
    torch.testing.assert_close(fast(x), reference(x), rtol=tolerance, atol=tolerance * 5)
