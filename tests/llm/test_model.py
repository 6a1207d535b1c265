"""Our Transformer against transformers' LlamaForCausalLM on tiny random checkpoints, plus the KV cache.

Tolerances (fp32 throughout, logits of magnitude up to ~10):
- vs transformers, ATOL = 1e-5: the same math from the same weights; in practice the difference is exactly
  0 on CPU today, the margin allows for other op orders (fused matmuls, another SDPA kernel, a GPU).
- cached vs full recompute, CACHE_ATOL = 1e-4: a 1-query attention over the cache takes another SDPA path
  (and summation order) than a T-query causal one; observed ~2e-5 (~16 ulps at 10), 5x margin.
Real mistakes (a swapped head, a wrong RoPE band, a mis-mapped norm, an off-by-one position) give 1e-2+.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import LLAMA3_SCALING, load_tiny, make_tiny_llama
from torch import nn

from llmplan.llm.kv import KVCache
from llmplan.llm.kv.cache import CacheFullError
from llmplan.llm.model import ModelConfig, Transformer, WeightError, expected_hf_names
from llmplan.llm.model.transformer import dense_linear
from llmplan.llm.model.weights import fuse_hf_state_dict

ATOL = 1e-5
CACHE_ATOL = 1e-4

VARIANTS = {
    "gqa": {},
    "mha": {"kv_heads": 4},
    "tied": {"tie": True},
    "llama3": {"rope_scaling": LLAMA3_SCALING},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path, hf = make_tiny_llama(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    return path, hf, load_tiny(path)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory):
    path, hf = make_tiny_llama(tmp_path_factory.mktemp("gqa"))
    return path, hf, load_tiny(path)


def _positions(batch: int, length: int) -> torch.Tensor:
    return torch.arange(length).expand(batch, length)


def test_logits_match_transformers(pair) -> None:
    _, hf, ours = pair
    # 80 positions: past llama3's original context (32), so all three frequency bands are exercised.
    tokens = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = hf(tokens).logits
        got = ours(tokens, _positions(2, 80))
    assert got.shape == want.shape == (2, 80, 256)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_last_only_is_the_last_row(gqa) -> None:
    _, _, ours = gqa
    tokens = torch.randint(0, 256, (2, 12))
    with torch.inference_mode():
        full = ours(tokens, _positions(2, 12))
        last = ours(tokens, _positions(2, 12), last_only=True)
    assert last.shape == (2, 1, 256)
    torch.testing.assert_close(last, full[:, -1:], atol=ATOL, rtol=0)


def test_left_padding_matches_unpadded(gqa) -> None:
    _, hf, ours = gqa
    row = torch.randint(3, 256, (1, 9))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), row], dim=1)
    valid = torch.tensor([[False] * 4 + [True] * 9])
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        got = ours(padded, positions, valid=valid)[:, 4:]
        want = hf(row).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_cached_decode_equals_full_recompute(gqa) -> None:
    """Prefill 10, then decode one token at a time: each step's logits equal a from-scratch forward pass."""
    _, _, ours = gqa
    seq = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    cache = KVCache.for_model(ours, 2, 32)
    with torch.inference_mode():
        full = ours(seq, _positions(2, 24))
        assert cache.make_room(10)
        pre = ours(seq[:, :10], _positions(2, 10), cache)
        torch.testing.assert_close(pre, full[:, :10], atol=CACHE_ATOL, rtol=0)
        for t in range(10, 24):
            assert cache.make_room(1)
            step = ours(seq[:, t : t + 1], cache.next_positions(), cache)
            torch.testing.assert_close(step[:, 0], full[:, t], atol=CACHE_ATOL, rtol=0)
    assert cache.length == 24


def test_chunked_prefill_equals_one_pass(gqa) -> None:
    _, _, ours = gqa
    seq = torch.randint(3, 256, (2, 21))
    valid = torch.ones(2, 21, dtype=torch.bool)
    valid[1, :6] = False  # a left-padded row, padding spanning a chunk boundary
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        one = KVCache.for_model(ours, 2, 32)
        want = ours(seq, positions, one, valid=valid)
        chunked = KVCache.for_model(ours, 2, 32)
        got = torch.cat(
            [
                ours(seq[:, lo : lo + 4], positions[:, lo : lo + 4], chunked, valid=valid[:, lo : lo + 4])
                for lo in range(0, 21, 4)
            ],
            dim=1,
        )
    torch.testing.assert_close(got[valid], want[valid], atol=CACHE_ATOL, rtol=0)
    torch.testing.assert_close(chunked.k[:, :, :, :21], one.k[:, :, :, :21], atol=CACHE_ATOL, rtol=0)
    assert torch.equal(chunked.next_pos, torch.tensor([21, 15]))


def test_cache_basics(gqa) -> None:
    _, _, ours = gqa
    cache = KVCache.for_model(ours, 3, 16, dtype=torch.bfloat16)
    cfg = ours.cfg
    kv_bytes = 2 * cfg.n_layers * 3 * cfg.n_kv_heads * 16 * cfg.head_dim * 2
    assert kv_bytes <= cache.nbytes < kv_bytes + 1024
    cache.reset(2)
    assert not cache.make_room(17)
    with pytest.raises(CacheFullError):
        cache.append(_positions(2, 17))
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        KVCache.for_model(ours, 1, ours.max_seq_len + 1)
    # A bf16 cache under an fp32 model still decodes (K/V cast on write and read).
    with torch.inference_mode():
        out = ours(torch.randint(0, 256, (2, 5)), _positions(2, 5), cache)
    assert out.isfinite().all() and cache.k.dtype == torch.bfloat16


def test_reorder_rows(gqa) -> None:
    _, _, ours = gqa
    cache = KVCache.for_model(ours, 3, 8)
    with torch.inference_mode():
        ours(torch.randint(0, 256, (3, 4)), _positions(3, 4), cache)
    before = cache.k[:, :3, :, :4].clone()
    cache.reorder(torch.tensor([2, 0, 0]))
    assert torch.equal(cache.k[:, :3, :, :4], before[:, [2, 0, 0]])
    cache.reorder(torch.tensor([1]))  # shrink to one row
    assert cache.batch == 1 and torch.equal(cache.k[:, 0, :, :4], before[:, 0])


# --- weights ---------------------------------------------------------------------------------------------


def test_from_weights_assigns_without_copies(gqa) -> None:
    path, _, _ = gqa
    cfg = ModelConfig.from_file(path / "config.json")
    fused = fuse_hf_state_dict(load_file(path / "model.safetensors"), cfg)
    model = Transformer.from_weights(cfg, fused)
    assert model.tok_embeddings.weight.data_ptr() == fused["tok_embeddings.weight"].data_ptr()
    assert model.layers[1].attention.wqkv.weight.data_ptr() == fused["layers.1.attention.wqkv.weight"].data_ptr()
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())


def test_tied_output_shares_the_embedding(tmp_path: Path) -> None:
    path, _ = make_tiny_llama(tmp_path, tie=True)
    model = load_tiny(path, dtype=torch.bfloat16)  # converted once, still shared
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert model.output.weight.dtype == torch.bfloat16


def test_sharded_checkpoint_loads_the_same(tmp_path: Path, gqa) -> None:
    path, hf = make_tiny_llama(tmp_path, max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    tokens = torch.randint(0, 256, (1, 7))
    with torch.inference_mode():
        torch.testing.assert_close(load_tiny(path)(tokens, _positions(1, 7)), hf(tokens).logits, atol=ATOL, rtol=0)


def test_linear_factory_builds_every_linear(gqa) -> None:
    path, _, ref = gqa
    cfg = ModelConfig.from_file(path / "config.json")
    built: list[tuple[int, ...]] = []

    class Wrapped(nn.Module):
        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__()
            built.append(tuple(weight.shape))
            self.inner = dense_linear(weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    model = Transformer.from_weights(
        cfg, fuse_hf_state_dict(load_file(path / "model.safetensors"), cfg), linear_factory=Wrapped
    )
    assert len(built) == 4 * cfg.n_layers + 1
    tokens = torch.randint(0, 256, (1, 5))
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens, _positions(1, 5)), ref(tokens, _positions(1, 5)))


def test_weight_errors_name_the_tensor(gqa) -> None:
    path, _, _ = gqa
    cfg = ModelConfig.from_file(path / "config.json")
    sd = load_file(path / "model.safetensors")
    assert expected_hf_names(cfg) == set(sd)

    bad = dict(sd, **{"model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)})
    with pytest.raises(
        WeightError, match=r"layers\.1\.self_attn\.k_proj\.weight: expected shape \(32, 64\), got \(16, 64\)"
    ):
        fuse_hf_state_dict(bad, cfg)

    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(WeightError, match=r"missing tensors: model\.norm\.weight"):
        fuse_hf_state_dict(missing, cfg)

    extra = dict(sd, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.warns(UserWarning, match=r"q_proj\.bias"):
        fuse_hf_state_dict(extra, cfg)
    with pytest.raises(WeightError, match=r"q_proj\.bias"):
        fuse_hf_state_dict(extra, cfg, strict=True)

    fused = fuse_hf_state_dict(sd, cfg)
    fused["layers.0.feed_forward.w2.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightError, match=r"layers\.0\.feed_forward\.w2\.weight: expected shape"):
        Transformer.from_weights(cfg, fused)
