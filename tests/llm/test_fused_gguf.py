"""The fused native pass on a GGUF as stored (LINEAR_GGUF, LINEAR_PARTS, a block-table embedding, a tied head
over that table) against the same model on its torch modules, on both ISA builds.

Tolerance. Both paths multiply by the same blocks in the same gguf_blocks.c code, rounding x per 32 columns to
int8; the x they round differ by fp32 summation order (norms, attention: ~1e-7 relative). That is all the
difference while no code moves, and each input's logits then agree to 1e-5 of the logits' range (measured
3.2e-7 at most here). But an x that sits on a rounding boundary (x / d = n + 0.5 to the last bit) rounds
differently on the two paths: one int8 code moves by 1, i.e. that input by d = amax / 127 of its block, which
moves a product's output by |w| * d and the logits downstream of it (a 12-token prompt of this model measured
1 % of the range on the one input that crossed, 1e-6 on the others). So: at least half the inputs must agree
to 1e-5 of the range (same arithmetic: a wrong part order, stride or table would move every input), none
more than 3 % (below the x rounding's own 4 % bound in test_gguf_stored.py, of which one code is a sliver).
Greedy tokens must be equal: these models' top-2 margins are far above one moved code's effect.
"""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch
from tiny_gguf import write_tiny_model
from torch import Tensor

from llmplan.llm.formats.gguf import map_gguf
from llmplan.llm.formats.gguf.stored import stored_weights
from llmplan.llm.generation import ModelRunner, generate
from llmplan.llm.generation import fused_decode as fd
from llmplan.llm.generation.fused_decode import FusedDecoder
from llmplan.llm.kernels import native
from llmplan.llm.kv import KVCache
from llmplan.llm.model import Transformer, make_linear
from llmplan.llm.model.weight_formats import GGUFParts, GGUFWeight
from llmplan.llm.sampling import Pick

pytestmark = pytest.mark.skipif(
    native.kernels() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
PAD = 0
PROMPTS = [[1, 17, 99, 4, 250, 31, 8, 40, 41], [1, 5, 9], [1, 200, 13, 77, 3, 3]]
CASES = {
    "llama-untied": {"arch": "llama", "tied": False, "embed": "Q4_K", "head": "Q6_K"},
    "qwen2-tied": {"arch": "qwen2", "tied": True, "embed": "Q8_0"},
    "llama-f16-table": {"arch": "llama", "tied": False, "embed": "F16", "head": "Q8_0"},
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("fused-gguf")
    paths = {}
    for name, kw in CASES.items():
        paths[name] = str(folder / f"{name}.gguf")
        write_tiny_model(paths[name], **kw)
    return paths


@pytest.fixture(params=list(CASES))
def stored(request: pytest.FixtureRequest, files: dict[str, str], isa_path: native.NativeKernels):
    """(case, model) built under the ISA being tested, so its torch modules run that build's products too."""
    cfg, weights = stored_weights(map_gguf(files[request.param]))
    return request.param, Transformer.from_weights(cfg, weights, linear_factory=make_linear, device="cpu")


def _passes(model: Transformer, native_pass: bool, chunk: int | None) -> Tensor:
    """Logits [3, 6, V]: a left-padded 3-row prefill (whole, or in chunks of `chunk` columns) and 5 decode
    rows fed the same tokens on both backends."""
    cache = KVCache.for_model(model, 3, 40)
    runner = ModelRunner(model, cache, native=native_pass)
    assert runner.backend == ("native" if native_pass else "torch")
    width = max(map(len, PROMPTS))
    tokens = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    valid = tokens != PAD
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    step = chunk or width
    with torch.inference_mode():
        for lo in range(0, width, step):
            part = (tokens[:, lo : lo + step], positions[:, lo : lo + step], cache, valid[:, lo : lo + step])
            last = runner.static_prefill(*part, logits=lo + step >= width)
        after = [runner.static_decode(torch.full((3, 1), t), cache.next_positions(), cache) for t in (7, 99, 3, 250)]
    assert last is not None
    return torch.cat([last, *after], 1)


@pytest.mark.parametrize("chunk", [None, 4])
def test_the_fused_pass_computes_what_the_torch_modules_do(stored, chunk: int | None) -> None:
    name, model = stored
    want, got = _passes(model, False, chunk), _passes(model, True, chunk)
    spread = float(want.max() - want.min())
    per_input = ((got - want).abs().amax(-1) / spread).flatten()
    print(f"{name} chunk {chunk}: max {float(per_input.max()):.2e}, median {float(per_input.median()):.2e} of range")
    assert float(per_input.median()) <= 1e-5, per_input
    assert float(per_input.max()) <= 0.03, per_input


def _greedy(logits: Tensor, seen: list[int]) -> Pick:
    token = int(logits.argmax())
    return Pick(token=token, logprob=float(logits.log_softmax(-1)[token]))


def test_greedy_tokens_are_the_torch_modules(stored) -> None:
    _, model = stored
    found = []
    for native_pass in (False, True):
        cache = KVCache.for_model(model, len(PROMPTS), 64)
        runner = ModelRunner(model, cache, native=native_pass)
        gens = generate(
            model, cache, PROMPTS, pickers=[_greedy] * 3, max_new_tokens=16, eos_ids=set(), pad_id=PAD, runner=runner
        )
        found.append([g.tokens for g in gens])
    assert found[0] == found[1]


def test_the_structs_hold_the_files_blocks(stored) -> None:
    name, model = stored
    fused = FusedDecoder.build(model, KVCache.for_model(model, 1, 16))
    assert fused is not None
    m = fused.model_struct
    table = model.tok_embeddings
    assert m.embed == table.blocks.data_ptr() and m.embed_type == table.qtype  # the block table itself, no copy
    wqkv = fused._layers[0].wqkv
    # q/k Q4_K and v Q6_K: a mixed-type fused group, each part writing its columns of the [M, n] output
    assert wqkv.kind == fd._PARTS and wqkv.group == 3 and wqkv.n == model.layers[0].attention.wqkv.out_features
    parts = (fd._Linear * 3).from_address(wqkv.w)
    assert [p.kind for p in parts] == [fd._GGUF] * 3 and [p.group for p in parts] == [12, 12, 14]
    assert fused._layers[0].w13.kind == fd._GGUF and fused._layers[0].w13.group == 12
    if name == "qwen2-tied":  # the head multiplies by the embedding's own table
        assert m.head.kind == fd._GGUF and m.head.w == m.embed and m.head.group == table.qtype
    else:
        assert m.head.w == model.output.blocks.data_ptr() and m.head.w != m.embed


def test_blocks_that_do_not_make_the_shape_are_refused(stored) -> None:
    _, model = stored
    cache = KVCache.for_model(model, 1, 16)
    good = model.layers[1].feed_forward.w2.blocks
    model.layers[1].feed_forward.w2.blocks = good[:, :-1].contiguous()  # a row's last block missing
    with pytest.raises(fd.NotFused, match="bytes"):
        FusedDecoder(model, cache, native.kernels().lib)  # type: ignore[union-attr]
    model.layers[1].feed_forward.w2.blocks = good
    table = model.tok_embeddings.blocks
    model.tok_embeddings.blocks = table[:-1]  # a vocabulary row short: the pass would read past the table
    with pytest.raises(fd.NotFused):
        FusedDecoder(model, cache, native.kernels().lib)  # type: ignore[union-attr]
    model.tok_embeddings.blocks = table
    assert FusedDecoder.build(model, cache) is not None


def test_float_gguf_types_take_the_kernels_their_modules_run() -> None:
    """ggml F16/BF16/F32 linears: the half or fp32 kind over the file's bytes (GGUFLinear runs those kernels);
    a fused group with such a part is refused (LINEAR_PARTS writes through gguf_linear's output stride)."""
    values = torch.randn(64, 64)
    keep: list = []
    for qtype, dtype, kind in (
        (1, torch.float16, fd._F16),
        (30, torch.bfloat16, fd._BF16),
        (0, torch.float32, fd._F32),
    ):
        blocks = values.to(dtype).view(torch.uint8).reshape(64, -1).contiguous()
        module = make_linear(GGUFWeight(blocks, qtype, (64, 64)))
        c = fd._native_linear(module, keep)
        assert (c.kind, c.w, c.n, c.k) == (kind, blocks.data_ptr(), 64, 64)
    q8 = quantize_gguf_q8(values)
    parts = make_linear(GGUFParts((q8, GGUFWeight(blocks, 0, (64, 64)))))
    with pytest.raises(fd.NotFused, match="float part"):
        fd._native_linear(parts, keep)


def quantize_gguf_q8(values: Tensor) -> GGUFWeight:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    raw = quantize(values.numpy(), Q.Q8_0).view("uint8").reshape(values.shape[0], -1)
    return GGUFWeight(torch.from_numpy(raw.copy()), int(Q.Q8_0), tuple(values.shape), "Q8_0")


def test_sixteen_bit_activations_reach_the_fused_pass(files: dict[str, str]) -> None:
    """activation_bits 16 (load.convert) is carried by each GGUF module into its LINEAR_GGUF struct: the fused
    pass computes what the torch modules do with it, and both come closer to the exact fp32 product of the
    file's values (the reference modules) than the 8-bit pass does."""
    cfg, weights = stored_weights(map_gguf(files["llama-untied"]))
    models = {
        bits: Transformer.from_weights(
            cfg, weights, linear_factory=functools.partial(make_linear, activation_bits=bits), device="cpu"
        )
        for bits in (8, 16)
    }
    fused = FusedDecoder.build(models[16], KVCache.for_model(models[16], 1, 16))
    assert fused is not None
    parts = ctypes.cast(fused._layers[0].wqkv.w, ctypes.POINTER(fd._Linear))
    assert {parts[i].xbits for i in range(fused._layers[0].wqkv.group)} == {16}
    assert fused._layers[0].w2.xbits == 16 and fused.model_struct.head.xbits == 16
    exact = Transformer.from_weights(
        cfg, weights, linear_factory=functools.partial(make_linear, kernel="reference"), device="cpu"
    )
    want = _passes(exact, False, None)
    sixteen = _passes(models[16], True, None)
    # x rounding on a boundary moves one code of the second pass: amax / 254^2, not the 8-bit pass's amax / 127
    assert (sixteen - _passes(models[16], False, None)).abs().max() <= 1e-4 * float(want.max() - want.min())
    assert (sixteen - want).abs().max() * 20 < (_passes(models[8], True, None) - want).abs().max()
