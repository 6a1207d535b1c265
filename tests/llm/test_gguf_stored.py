"""A model built from a mapped GGUF (its linears and embeddings the file's own blocks) against the model of the
fp32 import of the same file (which dequantizes the very same blocks).

Tolerance. Both models hold the same weights: the import's fp32 values are gguf-py's dequantization of the
blocks the mapped model multiplies by. What differs is the product: gguf_linear rounds each activation row per
32 columns to int8 (llama.cpp's Q8_0 activations), moving each input by at most amax / 254 of its block, about
0.5 % rms per product, compounding over the 2 layers' 5 products in a row and the head. Measured here: max
|delta| 1.2 % of the fp32 logits' range (llama, Q4_K/Q6_K) and 2.3 % (qwen2, Q8_0 tied head), relative rms
1.7 % and 2.5 % (benchmarks/activation_quant_accuracy.md measured 5.6 % for the same rounding on SmolLM2's
30 layers). The test allows 4 % of the range and 4 % rms (printed with -s). The reference kernels
(no rounding) must agree to 1e-4 of the range: only fp32 summation order differs. Greedy tokens are compared
where the fp32 model's top-2 margin exceeds twice the measured max |delta|.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_gguf import write_tiny_model

from llmplan.llm.formats.gguf import MappedGGUF, import_gguf, map_gguf
from llmplan.llm.formats.gguf.stored import stored_types, stored_weights
from llmplan.llm.generation.fused_decode import FusedDecoder
from llmplan.llm.generation.model_runner import ModelRunner
from llmplan.llm.kernels import native
from llmplan.llm.kv import KVCache
from llmplan.llm.model import ModelConfig, Transformer, kernel_paths, make_linear
from llmplan.llm.model.gguf_embedding import GGUFEmbedding
from llmplan.llm.model.weight_formats import GGUFParts, GGUFWeight
from llmplan.llm.model.weights import fuse_hf_state_dict

FAST = native.kernels()
PROMPT = [1, 40, 72, 101, 33, 9, 200, 150, 77, 3, 250, 120]
CASES = {
    "llama-untied": {"arch": "llama", "tied": False, "embed": "Q4_K", "head": "Q6_K"},
    "qwen2-tied": {"arch": "qwen2", "tied": True, "embed": "Q8_0"},
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    path = folder / f"{request.param}.gguf"
    write_tiny_model(str(path), **CASES[request.param])
    imported = import_gguf(path, folder / "cache")
    cfg = ModelConfig.from_file(imported / "config.json")
    state = {k: v for f in imported.glob("*.safetensors") for k, v in load_file(f).items()}
    fp32 = Transformer.from_weights(cfg, fuse_hf_state_dict(state, cfg), linear_factory=make_linear)
    mapped = map_gguf(path)
    stored_cfg, weights = stored_weights(mapped)
    assert stored_cfg == cfg
    stored = Transformer.from_weights(cfg, weights, linear_factory=make_linear, device="cpu")
    reference = Transformer.from_weights(
        cfg, weights, linear_factory=lambda w: make_linear(w, kernel="reference"), device="cpu"
    )
    return request.param, fp32, stored, reference, weights


def _logits(model: Transformer) -> torch.Tensor:
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        return model(tokens, torch.arange(len(PROMPT))[None])[0]


def test_weights_stay_the_files_blocks(pair) -> None:
    name, _, stored, _, weights = pair
    assert isinstance(stored.tok_embeddings, GGUFEmbedding)
    assert stored.dtype == torch.float32 and stored.device.type == "cpu"
    wqkv = weights["layers.0.attention.wqkv.weight"]
    assert isinstance(wqkv, GGUFParts) and [p.type_name for p in wqkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    w13 = weights["layers.0.feed_forward.w13.weight"]
    assert isinstance(w13, GGUFWeight) and w13.type_name == "Q4_K"  # gate and up share a type: one block table
    if name == "qwen2-tied":
        assert weights["output.weight"] is weights["tok_embeddings.weight"]
        assert stored.output.blocks.data_ptr() == stored.tok_embeddings.blocks.data_ptr()  # one table
        assert weights["layers.0.attention.wqkv_bias.weight"].dtype == torch.float32
    else:
        # q/k of a Llama were gathered back into HF row order (a copy), v is a view on the mapping
        assert weights["layers.0.feed_forward.w2.weight"].blocks._base is not None
    assert set(stored_types(weights)) >= {"Q4_K", "Q6_K"}
    if FAST is not None:
        for module in stored.modules():
            if hasattr(module, "prepack"):
                module.prepack()  # as load.to_device does
        paths = kernel_paths(stored)
        assert all(p.startswith(f"native-{FAST.isa}-gguf-") for p in paths), paths


def test_logits_match_the_fp32_import(pair) -> None:
    name, fp32, stored, reference, _ = pair
    want = _logits(fp32)
    spread = float(want.max() - want.min())
    exact = float((_logits(reference) - want).abs().max())
    assert exact <= 1e-4 * spread, (exact, spread)
    got = _logits(stored)
    delta = float((got - want).abs().max())
    rms = float((got - want).norm() / (want - want.mean()).norm())
    print(f"{name}: max |dlogit| {delta:.4g} of a range {spread:.4g} ({delta / spread:.2%}), relative rms {rms:.2%}")
    assert delta <= 0.04 * spread, (delta, spread)
    assert rms <= 0.04, rms


def _greedy(model: Transformer, steps: int) -> tuple[list[int], list[float], ModelRunner]:
    cache = KVCache.for_model(model, 1, 64)
    runner = ModelRunner(model, cache)
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = runner.static_prefill(tokens, torch.arange(len(PROMPT))[None], cache, None, logits=True)
        out, margins = [], []
        for step in range(steps):
            top = logits[0, -1].float().topk(2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            position = torch.tensor([[len(PROMPT) + step]])
            logits = runner.static_decode(torch.tensor([[out[-1]]]), position, cache)
    return out, margins, runner


def test_greedy_tokens_on_the_native_pass(pair) -> None:
    _, fp32, stored, _, _ = pair
    want, margins, fp32_runner = _greedy(fp32, 8)
    got, _, runner = _greedy(stored, 8)
    if FAST is not None:  # the fused native pass runs the file's blocks (tests/llm/test_fused_gguf.py)
        assert runner.backend == fp32_runner.backend == "native"
        assert FusedDecoder.build(stored, KVCache.for_model(stored, 1, 64)) is not None
    delta = float((_logits(stored) - _logits(fp32)).abs().max())
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        if a != b:  # past a divergence the sequences differ anyway; it must have been a near tie
            assert margins[i] <= 2 * delta, (i, want, got, margins)
            break


def _mapping_rss(mapped: MappedGGUF) -> int:
    """Resident bytes of the file's mapping in this process (its /proc/self/smaps entry)."""
    assert mapped._map is not None
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapped._map))
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for at, line in enumerate(lines):
        if "-" in line.split(" ", 1)[0] and int(line.split("-", 1)[0], 16) == start:
            rss = next(ln for ln in lines[at + 1 :] if ln.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps (Linux)")
def test_the_pages_of_copied_tensors_leave_the_resident_set(tmp_path: Path) -> None:
    """q/k (reordered for RoPE) and gate/up (joined: one type) are copies the model reads: the file's pages
    they came from are given back, so a stored load holds the file's bytes about once, not the copies twice."""
    path = tmp_path / "llama.gguf"
    write_tiny_model(str(path), arch="llama")
    mapped = map_gguf(path)
    for tensor in mapped.tensors.values():
        int(tensor.blocks.sum())  # every page touched, as a block check or a first pass would
    before = _mapping_rss(mapped)
    _, weights = stored_weights(mapped)
    copies = [f"blk.{i}.{n}.weight" for i in range(2) for n in ("attn_q", "attn_k", "ffn_gate", "ffn_up")]
    copied = sum(mapped.file.tensors[name].nbytes for name in copies)
    assert before - _mapping_rss(mapped) >= copied - 2 * len(copies) * mmap.PAGESIZE  # whole pages inside each
    assert weights["layers.0.feed_forward.w13.weight"].blocks.data_ptr() != mapped.tensors[copies[2]].blocks.data_ptr()
