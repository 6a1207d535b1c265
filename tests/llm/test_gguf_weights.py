"""Weights of a GGUF's own type (llm/model): GGUFLinear on the native block kernels and without them, fused
parts of different block types, the embedding that dequantizes only the rows a pass needs.

Tolerance of the native product: gguf_linear rounds x per 32 columns to int8 (scale amax / 127), so each x
moves by at most amax / 254; on standard-normal x and these weights that is ~0.3 % of the output's scale, and
the test allows 2 % relative (Frobenius) to the exact product of the dequantized weight. The reference and the
no-native path are F.linear on gguf-py's dequantized weight, compared exactly.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tiny_gguf import random_blocks

from llmplan.llm.kernels import native
from llmplan.llm.model import kernel_paths, make_linear
from llmplan.llm.model.gguf_embedding import GGUFEmbedding
from llmplan.llm.model.linear import GGUFLinear, GGUFPartsLinear
from llmplan.llm.model.weight_formats import GGUFParts, GGUFWeight, fuse_gguf, nbytes

FAST = native.kernels()
needs_native = pytest.mark.skipif(FAST is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")


def _weight(type_name: str, n: int, k: int, seed: int = 0) -> tuple[GGUFWeight, torch.Tensor]:
    """A GGUF weight of `type_name` and its fp32 values as gguf-py dequantizes them."""
    qtype = Q[type_name]
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        raw = random_blocks(type_name, n, k, seed)
    else:
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        raw = np.ascontiguousarray(quantize(w, qtype)).view(np.uint8).reshape(n, -1)
    dense = dequantize(raw, qtype).reshape(n, k).astype(np.float32)
    return GGUFWeight(torch.from_numpy(raw.copy()), int(qtype), (n, k), type_name), torch.from_numpy(dense)


TYPES = ["Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K", "F32", "F16"]


@needs_native
@pytest.mark.parametrize("type_name", TYPES)
def test_native_product_on_the_blocks(type_name: str) -> None:
    weight, dense = _weight(type_name, 40, 512)
    linear = make_linear(weight)
    assert isinstance(linear, GGUFLinear)
    linear.prepack()
    assert linear.path == f"native-{FAST.isa}-gguf-{type_name}"
    x = torch.randn(3, 5, 512)
    want = x @ dense.T
    got = linear(x)
    assert got.shape == (3, 5, 40) and got.dtype == torch.float32
    rel = float((got - want).norm() / want.norm())
    assert rel < (1e-5 if type_name in ("F32", "F16") else 2e-2), rel
    assert torch.equal(linear.reference(x), F.linear(x, dense))
    assert nbytes(weight) == weight.blocks.numel()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
def test_without_native_kernels_the_blocks_are_dequantized_once(
    type_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "kernels", lambda: None)
    weight, dense = _weight(type_name, 16, 256, seed=4)
    linear = make_linear(weight)
    linear.prepack()
    assert linear.path == "torch-gguf-dequantized"
    x = torch.randn(2, 256)
    assert torch.equal(linear(x), F.linear(x, dense))
    reference = make_linear(weight, kernel="reference")
    assert torch.equal(reference(x), F.linear(x, dense))
    assert kernel_paths(reference) == {"reference": 1}


def test_fused_parts_compute_their_own_rows() -> None:
    q, q_dense = _weight("Q4_K", 8, 256, seed=1)
    k, k_dense = _weight("Q4_K", 4, 256, seed=2)
    v, v_dense = _weight("Q6_K", 4, 256, seed=3)
    same = fuse_gguf([q, k])
    assert isinstance(same, GGUFWeight) and same.shape == (12, 256)
    assert torch.equal(same.blocks, torch.cat([q.blocks, k.blocks]))
    mixed = fuse_gguf([q, k, v])
    assert (
        isinstance(mixed, GGUFParts) and mixed.shape == (16, 256) and mixed.nbytes == sum(p.nbytes for p in (q, k, v))
    )
    assert mixed.parts[0].blocks is q.blocks  # no copy of parts that stay apart
    linear = make_linear(mixed)
    assert isinstance(linear, GGUFPartsLinear)
    x = torch.randn(3, 256)
    want = x @ torch.cat([q_dense, k_dense, v_dense]).T
    got = linear(x)
    assert got.shape == (3, 16)
    assert float((got - want).norm() / want.norm()) < 2e-2
    paths = kernel_paths(linear)
    assert sum(paths.values()) == 3


@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K", "F16"])
def test_embedding_gathers_the_rows_it_needs(type_name: str) -> None:
    weight, dense = _weight(type_name, 50, 256, seed=5)
    embedding = GGUFEmbedding(weight)
    tokens = torch.tensor([[3, 1, 3], [49, 0, 1]])
    assert torch.equal(embedding(tokens), dense[tokens])
    scaled = GGUFEmbedding(weight, scale=256**0.5)
    assert torch.equal(scaled(tokens), dense[tokens] * torch.tensor(16.0))
    with pytest.raises(IndexError):
        embedding(torch.tensor([50]))


def test_rows_reorder_whole_blocks() -> None:
    weight, dense = _weight("Q4_0", 6, 64, seed=6)
    order = torch.tensor([5, 0, 3, 1, 2, 4])
    moved = weight.rows(order)
    assert moved.shape == (6, 64)
    got = dequantize(moved.blocks.numpy(), gguf.GGMLQuantizationType.Q4_0).reshape(6, 64)
    assert np.array_equal(got, dense[order].numpy())
