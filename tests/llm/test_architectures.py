"""Every supported family against transformers, on tiny random checkpoints transformers made (tests/llm/archs.py).

Tolerance: fp32 logits within 1e-4 of transformers' over a 64-token prompt (logits here are ~10). The torch
path runs the same fp32 ops in the same order as transformers (measured: bit-identical, |delta| 0); the native
pass sums in another order (blocked GEMMs, chunked softmax, its own exp): measured at most 3.4e-5 (Qwen2),
a few ulps per sum through a few layers. 1e-4 is far below any top-two gap that could flip a greedy pick on these wide-init models, and far above
rounding. Greedy: 32 tokens identical to transformers' own greedy continuation (full recompute each step),
through `generate` (KV cache, prefill then decode) and through the scheduler beside other requests.

The caches there are built with a small `chunk` (CHUNK tokens a write), so a sliding layer holds a ring of
WINDOW + CHUNK slots, far fewer than prompt + generated: the ring wraps during the prefill and keeps wrapping
while generation runs past the window (llm/kv/layers.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from archs import FAMILIES, WINDOW, make_tiny
from tiny import load_tiny
from torch import Tensor

from llmplan.llm.generation import EngineLoop, ModelRunner, generate
from llmplan.llm.generation.fused_decode import FusedDecoder
from llmplan.llm.generation.scheduler import GenerationRequest
from llmplan.llm.kernels import native
from llmplan.llm.kv import KVCache, SlotCache
from llmplan.llm.kv.cache import CacheFullError
from llmplan.llm.model import Transformer
from llmplan.llm.sampling import Pick

TOLERANCE = 1e-4
PROMPT_LEN, NEW = 64, 32
CHUNK = 8  # tokens a cache write takes at most: a sliding layer's ring holds WINDOW + CHUNK slots
NATIVE = native.kernels() is not None
# With native kernels, every test runs on the AVX2 and on the AVX-512 build (tests/llm/conftest.py).
pytestmark = [pytest.mark.usefixtures("isa_path")] if NATIVE else []
PATHS = ["torch", pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="native kernels unavailable"))]


def greedy(logits: Tensor, seen: list[int]) -> Pick:
    token = int(logits.argmax())
    return Pick(token=token, logprob=float(logits.log_softmax(-1)[token]))


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=generator).tolist()


def reference_greedy(hf: Any, ids: list[int], new: int) -> list[int]:
    """transformers' own greedy continuation, every step recomputed from scratch (no cache to trust)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


_BUILT: dict[str, dict[str, Any]] = {}  # per family, once per session (the ISA parametrization repeats modules)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    name = request.param
    if name not in _BUILT:
        path, hf = make_tiny(tmp_path_factory.mktemp("arch"), name)
        prompts = [prompt(1), prompt(2, 23), prompt(3, 40)]
        _BUILT[name] = {
            "name": name,
            "path": path,
            "hf": hf,
            "model": load_tiny(path),
            "prompts": prompts,
            "want": [reference_greedy(hf, p, NEW) for p in prompts],
        }
    return _BUILT[name]


def _runner(model: Transformer, cache: KVCache | SlotCache, path: str) -> ModelRunner:
    """The runner on the backend `path` names; the native one must really be native (or the test skips)."""
    runner = ModelRunner(model, cache, native=path == "native")
    if path == "native" and runner.backend != "native":
        pytest.skip(f"the native pass refuses {model.cfg.model_type} (it falls back to torch)")
    return runner


def test_checkpoint_is_sharded_and_has_what_the_family_tests(family: dict[str, Any]) -> None:
    cfg = family["model"].cfg
    assert len(list(Path(family["path"]).glob("*.safetensors"))) >= 3
    assert cfg.n_kv_heads < cfg.n_heads  # GQA
    if family["name"] != "qwen3":  # Qwen3 has no window in its default form
        assert WINDOW in cfg.layer_windows and WINDOW < PROMPT_LEN


def test_logits_equal_transformers(family: dict[str, Any]) -> None:
    ids = torch.tensor([family["prompts"][0]])
    with torch.no_grad():
        want = family["hf"](ids).logits
        got = family["model"](ids, torch.arange(PROMPT_LEN)[None])
    assert (got - want).abs().max().item() <= TOLERANCE


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable")
def test_native_logits_equal_transformers(family: dict[str, Any]) -> None:
    """The native pass over the whole prompt as one chunk (every input's logits), against transformers."""
    model, ids = family["model"], family["prompts"][0]
    cache = SlotCache.for_model(model, 2, 128)
    fused = FusedDecoder.build(model, cache)
    assert fused is not None, "the native pass refused a family it computes"
    cache.claim([1], [ids])  # row 1: the native pass addresses rows and slots, not only row 0
    n = torch.arange(PROMPT_LEN)
    got = fused.run(torch.tensor(ids), n, torch.ones_like(n), n, n)
    with torch.no_grad():
        want = family["hf"](torch.tensor([ids])).logits[0]
    assert (got - want).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("path", PATHS)
def test_greedy_alone_and_batched_equals_transformers(family: dict[str, Any], path: str) -> None:
    model, prompts = family["model"], family["prompts"]
    cache = KVCache.for_model(model, 1, PROMPT_LEN + NEW, chunk=CHUNK)
    runner = _runner(model, cache, path)
    alone = generate(
        model, cache, prompts[:1], pickers=[greedy], max_new_tokens=NEW, eos_ids=set(), pad_id=0, runner=runner
    )
    assert alone[0].tokens == family["want"][0]
    # A static batch: the shorter prompts are left-padded, so slots and positions differ.
    cache = KVCache.for_model(model, 3, PROMPT_LEN + NEW, chunk=CHUNK)
    runner = _runner(model, cache, path)
    gens = generate(
        model, cache, prompts, pickers=[greedy] * 3, max_new_tokens=NEW, eos_ids=set(), pad_id=0, runner=runner
    )
    assert [g.tokens for g in gens] == family["want"]


@pytest.mark.parametrize("path", PATHS)
def test_scheduler_with_other_requests_equals_transformers(family: dict[str, Any], path: str) -> None:
    model = family["model"]
    cache = SlotCache.for_model(model, 2, 128, chunk=10)
    sched = EngineLoop(_runner(model, cache, path), cache, max_step_tokens=12)  # prompts in chunks of 10
    seqs, pending, step = [], list(family["prompts"]), 0
    while pending or sched.pending:
        if pending and step % 3 == 0:
            seqs.append(sched.submit(GenerationRequest(prompt=pending.pop(0), picker=greedy, max_new_tokens=NEW)))
        sched.step()
        step += 1
    assert [s.generation.tokens for s in seqs] == family["want"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunk", [CHUNK, 24])
def test_logits_through_a_wrapping_ring_equal_transformers(family: dict[str, Any], path: str, chunk: int) -> None:
    """Every position's logits of the prompt fed `chunk` tokens a pass into a cache whose sliding layers keep
    WINDOW + chunk slots (the ring wraps from the second pass on), against transformers over the whole prompt.
    Passes of 24 inputs attend in blocks (cpu_kernels.c's attend_block), whose steps split where the ring wraps."""
    model, ids = family["model"], family["prompts"][0]
    cache = SlotCache.for_model(model, 2, PROMPT_LEN, chunk=chunk)
    for layer, window in enumerate(model.cfg.layer_windows):
        assert cache.store.rows[layer] == (WINDOW + chunk if window else PROMPT_LEN)
    runner = _runner(model, cache, path)
    got = []
    with torch.no_grad():
        for lo in range(0, PROMPT_LEN, chunk):
            piece = ids[lo : lo + chunk]
            n = torch.arange(lo, lo + len(piece))
            cache.claim([1], [piece])
            if runner.backend == "native":
                assert runner.native is not None
                got.append(runner.native.run(torch.tensor(piece), n, torch.ones_like(n), n, n - lo))
            else:
                got.append(model(torch.tensor([piece]), n[None], cache.rows([1], [lo]))[0])
        want = family["hf"](torch.tensor([ids])).logits[0]
    assert (torch.cat(got) - want).abs().max().item() <= TOLERANCE


def test_a_sliding_layer_holds_window_plus_chunk_rows(family: dict[str, Any]) -> None:
    """The cache's bytes, measured from its tensors: a sliding layer holds WINDOW + CHUNK slots per row, a
    full layer every slot; the slot cache over it shares that memory."""
    model = family["model"]
    cfg = model.cfg
    max_tokens, rows = 128, 3
    cache = KVCache.for_model(model, rows, max_tokens, chunk=CHUNK)
    per_slot = 2 * rows * cfg.n_kv_heads * cfg.head_dim * 4  # K and V, fp32
    windows = cfg.layer_windows or (0,) * cfg.n_layers
    for layer, window in enumerate(windows):
        k, v = cache.store.k[layer], cache.store.v[layer]
        assert k.nbytes + v.nbytes == per_slot * (WINDOW + CHUNK if window else max_tokens)
    held = sum(k.nbytes + v.nbytes for k, v in cache.store.groups)
    assert held == per_slot * sum(WINDOW + CHUNK if w else max_tokens for w in windows)
    assert cache.nbytes == held + sum(t.nbytes for t in (cache.valid, cache.pos, cache.next_pos))
    assert SlotCache.over(cache).store is cache.store
    if any(windows):
        assert held < per_slot * cfg.n_layers * max_tokens and cache.max_write == CHUNK
        with pytest.raises(CacheFullError, match="one write"):
            cache.append(torch.zeros(rows, CHUNK + 1, dtype=torch.long))
    else:
        assert cache.max_write == max_tokens  # no ring: any write that fits


@pytest.mark.parametrize("path", PATHS)
def test_a_prefix_is_reused_only_while_the_ring_holds_its_window(family: dict[str, Any], path: str) -> None:
    """Prefix reuse with rings: a prompt that extends what a slot just computed goes on from it; the same
    prompt after a long generation (the ring has moved past its window) is recomputed. Both equal transformers."""
    model, ids, want = family["model"], family["prompts"][0], family["want"][0]
    cache = SlotCache.for_model(model, 1, 128, chunk=10)
    loop = EngineLoop(_runner(model, cache, path), cache, max_step_tokens=12)
    loop.submit(GenerationRequest(prompt=ids[:40], picker=greedy, max_new_tokens=1))
    loop.run()
    full = loop.submit(GenerationRequest(prompt=ids, picker=greedy, max_new_tokens=NEW))
    loop.run()
    again = loop.submit(GenerationRequest(prompt=ids, picker=greedy, max_new_tokens=NEW))
    loop.run()
    assert full.reused == 40 and full.generation.tokens == want
    ring = any(cache.store.rings)
    assert again.reused == (0 if ring else PROMPT_LEN - 1) and again.generation.tokens == want


@pytest.mark.parametrize("path", PATHS)
def test_beams_reorder_rings_as_whole_rows(family: dict[str, Any], path: str) -> None:
    """Beam search through ring caches (the beams' rows reordered each step) picks what it picks with every
    layer full."""
    from llmplan.llm.generation.beam_search import beam_search

    model, ids = family["model"], family["prompts"][1]
    found = []
    for chunk in (CHUNK, None):
        cache = KVCache.for_model(model, 3, 64, chunk=chunk)
        runner = _runner(model, cache, path)
        found.append(
            [(c.tokens, round(c.score, 4)) for c in beam_search(
                model, cache, ids, num_beams=3, max_new_tokens=24, eos_ids=set(), num_return_sequences=3, runner=runner
            )]
        )  # fmt: skip
    assert found[0] == found[1]


def test_native_pass_refuses_what_it_does_not_compute(family: dict[str, Any]) -> None:
    """The native pass either computes the family (the tests above prove it) or declines: never computes it
    wrongly. Declining leaves the torch path, which is what generation then runs."""
    from llmplan.llm.generation.fused_decode import architecture_problem

    model = family["model"]
    problem = architecture_problem(model.cfg)
    if problem is not None and NATIVE:
        assert FusedDecoder.build(model, KVCache.for_model(model, 1, 8)) is None


# --- config.json: each family's fields read, anything else refused -------------------------------------


def _config(tmp_path: Path, raw: dict[str, Any]) -> Path:
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    return path


def test_each_familys_config_reads_its_departures(family: dict[str, Any]) -> None:
    cfg, name = family["model"].cfg, family["name"]
    arch = cfg.arch
    assert arch.model_type == name
    if name == "qwen2":
        assert arch.qkv_bias and cfg.layer_windows == (0, WINDOW, WINDOW)  # from max_window_layers 1
    if name in ("qwen3", "gemma3_text"):
        assert arch.qk_norm
    if name == "gemma2":
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.attn_scale) == (5.0, 8.0, 24**-0.5)
        assert cfg.layer_windows == (WINDOW, 0, WINDOW) and arch.norm_offset == 1.0 and arch.embed_scale
    if name == "gemma3_text":
        assert cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1e6 and cfg.attn_softcap is None
        assert cfg.rope_scaling is not None and (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 4.0)
        assert cfg.layer_windows == (WINDOW, WINDOW, 0, WINDOW)
    if name == "phi3":
        assert arch.fused_qkv and arch.fused_gate_up


@pytest.mark.parametrize(
    ("model_type", "changes", "message"),
    [
        ("llama", {"query_pre_attn_scalar": 64}, "'query_pre_attn_scalar': not a field of a llama config"),
        ("llama", {"sliding_window": 64}, "'sliding_window': not a field of a llama config"),
        ("mistral", {"num_experts_per_tok": 2}, "'num_experts_per_tok': not a field of a mistral config"),
        ("qwen2", {"use_mrope": True}, "use_mrope: True is not supported for qwen2"),
        ("qwen3", {"attention_bias": True}, "attention_bias: True is not supported for qwen3"),
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation: unsupported 'gelu' for gemma2"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention: True is not supported"),
        ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor: 0.5 is not supported for phi3"),
        ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "unsupported 'longrope'"),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}}, "rope_scaling.beta: not"),
        ("gemma2", {"layer_types": ["full_attention"]}, "layer_types: 1 entries for 2 layers"),
        ("gemma3", {}, "model_type: unsupported 'gemma3' (supported: llama, mistral, qwen2, qwen3, gemma2"),
    ],
)
def test_fields_no_description_covers_are_refused_naming_config_json(
    tmp_path: Path, model_type: str, changes: dict[str, Any], message: str
) -> None:
    from llmplan.llm.model import ConfigError, ModelConfig

    raw = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    raw |= {"intermediate_size": 128, "vocab_size": 256, **changes}
    path = _config(tmp_path, raw)
    with pytest.raises(ConfigError) as caught:
        ModelConfig.from_file(path)
    text = str(caught.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text


def test_qwen_window_applies_only_with_use_sliding_window(tmp_path: Path) -> None:
    from llmplan.llm.model import ModelConfig

    raw = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    raw |= {"intermediate_size": 128, "vocab_size": 256, "sliding_window": 32, "max_window_layers": 0}
    assert ModelConfig.from_file(_config(tmp_path, {**raw, "use_sliding_window": False})).layer_windows == ()
    assert ModelConfig.from_file(_config(tmp_path, {**raw, "use_sliding_window": True})).layer_windows == (32, 32)


def test_older_gemma3_fields_read_like_rope_parameters(tmp_path: Path) -> None:
    """transformers 4 wrote rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern."""
    from llmplan.llm.model import ModelConfig

    raw = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4}
    raw |= {"intermediate_size": 128, "vocab_size": 256, "sliding_window": 512, "sliding_window_pattern": 3}
    raw |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    raw |= {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "cache_implementation": "hybrid"}
    cfg = ModelConfig.from_file(_config(tmp_path, raw))
    assert cfg.layer_windows == (512, 512, 0, 512, 512, 0)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.tie_word_embeddings) == (1e6, 1e4, True)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0


def test_parameter_count_is_what_transformers_holds(family: dict[str, Any]) -> None:
    """`load.config` and `validate --deep` size memory by it."""
    hf = family["hf"]
    assert family["model"].cfg.parameter_count() == sum(p.numel() for p in hf.parameters())


@pytest.mark.skipif(not NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("precision", ["int8", "int4", "bf16", "fp16"])
def test_converted_weights_run_the_same_on_both_backends(family: dict[str, Any], precision: str) -> None:
    """Linears converted as load.convert converts them (biases and norms stay fp32): the native pass and the
    torch modules greedy-decode the same tokens from the same converted weights."""
    import functools

    from safetensors.torch import load_file

    from llmplan.llm.model import is_linear_weight, make_linear, quantize_weight
    from llmplan.llm.model.weights import fuse_hf_state_dict

    cfg = family["model"].cfg
    sd = {k: v for f in Path(family["path"]).glob("*.safetensors") for k, v in load_file(f).items()}
    weights = fuse_hf_state_dict(sd, cfg, strict=True)
    converted = {n: quantize_weight(w, precision, 32) if is_linear_weight(n) else w for n, w in weights.items()}
    assert all(not is_linear_weight(n) for n in weights if "bias" in n or n.endswith("norm.weight"))
    factory = functools.partial(make_linear, kernel="auto")
    model = Transformer.from_weights(cfg, converted, linear_factory=factory, keep_linear_dtype=True)
    ids = family["prompts"][0][:40]
    tokens = []
    for path in ("torch", "native"):
        cache = KVCache.for_model(model, 1, 64)
        runner = _runner(model, cache, path)
        gen = generate(model, cache, [ids], pickers=[greedy], max_new_tokens=16, eos_ids=set(), pad_id=0, runner=runner)
        tokens.append(gen[0].tokens)
    assert tokens[0] == tokens[1]


def test_attention_pictures_are_the_layers_own_weights(family: dict[str, Any]) -> None:
    """The report's attention maps (`Attention.probabilities`, recomputed beside the pass) equal transformers'
    eager attention weights, layer by layer: biases, q/k norms, local RoPE, windows and soft-caps included."""
    model, hf, ids = family["model"], family["hf"], torch.tensor([family["prompts"][0][:40]])
    inputs: dict[int, Tensor] = {}
    hooks = [
        block.attention.register_forward_hook(lambda m, a, o, i=i: inputs.__setitem__(i, a[0]))
        for i, block in enumerate(model.layers)
    ]
    try:
        with torch.no_grad():
            model(ids, torch.arange(ids.shape[1])[None])
    finally:
        for hook in hooks:
            hook.remove()
    before = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            want = hf(ids, output_attentions=True).attentions
    finally:
        hf.set_attn_implementation(before)
    for i, block in enumerate(model.layers):
        got = block.attention.probabilities(inputs[i], *model.rope_for(block.attention))
        assert (got - want[i][0]).abs().max().item() <= 1e-5, f"layer {i}"
