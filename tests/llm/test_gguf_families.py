"""GGUF import of every family, against transformers' own GGUF loader and against the model it came from.

Each test model is made by transformers (its config, its model class), then written as llama.cpp's
convert_hf_to_gguf.py would: tensor names from gguf-py's own name map, Llama's q/k rows permuted, Gemma's
norms stored as 1 + w, metadata under llama.cpp's keys. Three views must then agree:

* stored as F32, llmplan's import computes the very logits of the model it came from (the convert undone
  exactly, including what transformers' GGUF loader does not read, such as Gemma 2's soft-caps);
* stored quantized (several block types per file), llmplan's import and transformers loading the same GGUF
  (`from_pretrained(dir, gguf_file=...)`) compute the same logits: both dequantize with gguf-py.

Tolerance: 1e-4 on fp32 logits of order 1-10 (the two sides sum in different orders; a mis-mapped tensor
or a wrong norm offset moves them by far more than 0.1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny import load_tiny

from llmplan.llm.formats.gguf import import_gguf
from llmplan.llm.formats.gguf.importer import GGUFImportError
from llmplan.llm.text import Tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

TOLERANCE = 1e-4
PROMPT = [5, 17, 200, 3, 99, 42, 7, 130, 11, 250, 64, 1, 33, 180, 90, 21, 8, 77, 140, 2, 56, 201, 13, 44]
WINDOW = 8  # shorter than the prompt, so a sliding window that is lost or invented shows

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 256,  # a K-quant block (256) per row of down_proj
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.25,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# family -> (transformers prefix, gguf arch, config fields). Only what a GGUF can state: transformers'
# GGUF loader reads no Gemma 2 soft-cap and no Phi-3 window, so those tests compare with the original model.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("Llama", "llama", {"num_hidden_layers": 2, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2", "qwen2", {"num_hidden_layers": 2, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3", "qwen3", {"num_hidden_layers": 2, "head_dim": 32, "tie_word_embeddings": True}),
    "gemma2": (
        "Gemma2",
        "gemma2",
        {
            "num_hidden_layers": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 8.0,
        },
    ),
    "gemma3": (
        "Gemma3Text",
        "gemma3",
        {"num_hidden_layers": 6, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW},
    ),
    "phi3": ("Phi3", "phi3", {"num_hidden_layers": 2, "sliding_window": WINDOW, "tie_word_embeddings": False}),
}
ROPE_THETA = {"llama": 10000.0, "qwen2": 1e6, "qwen3": 1e6, "gemma2": 10000.0, "gemma3": 1e6, "phi3": 10000.0}
# Where transformers' GGUF loader cannot rebuild the model: qwen3 (it reads no attention.key_length, so
# head_dim 32 becomes its default) and gemma2/phi3 (their soft-caps / window are not read).
TRANSFORMERS_READS_ALL = {"llama", "qwen2", "gemma3"}

# Offsets of each K/IQ block's fp16 scales: random bytes there would be NaN or 1e4; elsewhere any byte is a
# valid code. (gguf-py quantizes only the legacy types, so the others are written as raw blocks.)
_SCALE_OFFSETS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.IQ2_XXS: (0,),
    Q.IQ3_S: (0,),
    Q.TQ2_0: (64,),
}


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    scores: list[float]


def sentencepiece_vocab(seed: int = 0) -> Vocab:
    """A SentencePiece-style vocabulary as llama.cpp writes one: <unk>, two control tokens, the 256 byte
    tokens, pieces of a few words (every piece's halves are pieces too, so merges can be recovered), runs of
    spaces spelled with spaces (as Gemma files have them) and user-defined tokens."""
    rng = np.random.default_rng(seed)
    words = ["the", "hello", "world", "token", "print", "def", "return", "über", "日本"]
    pieces = sorted(
        {w[i:j] for w in (f"\u2581{w}" for w in words) for i in range(len(w)) for j in range(i + 1, len(w) + 1)}
    )
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, "  ", "   ", "<think>", "\n\n"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 1, 1, 4, 4]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *(-len(p) - rng.random() for p in pieces), -2.0, -3.0, 0.0, 0.0]
    return Vocab(tokens, types, [float(x) for x in scores])


TOKENIZER_STRINGS = [
    "the world",
    "hello world, hello token",
    " leading space and  two   three",
    "print(the)\n\nreturn def",
    "über 日本 日本語 emoji 😀",
    "<think>the</think> <s> literal",
    "\ttab\r\nnewline  ",
    "",
    "   ",
    "xyz unknown q",
]


def _byte_alphabet() -> list[str]:
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, restated: per head, the two halves become interleaved pairs
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def raw_blocks(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    """Random blocks of `qtype` for a float tensor of `shape`, with sane fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (int(np.prod(shape)) // block, size), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        scale = rng.uniform(2e-3, 8e-3, len(blocks)).astype("<f2")
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def make_model(family: str, seed: int = 0, vocab_size: int = 256) -> Any:
    prefix, _, fields = FAMILIES[family]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": ROPE_THETA[family]}
    if family == "gemma3":  # sliding layers at llama.cpp's fixed local base
        rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    config = config_cls(**{**COMMON, **fields, "rope_parameters": rope, "vocab_size": vocab_size})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms start at 1 (Gemma's at 0) and biases at 0: a mis-mapped one would not show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.3)
    return model


def write_gguf(
    path: Path, family: str, model: Any, types: dict[str, Q], seed: int = 0, vocab: Vocab | None = None
) -> None:
    """`model` as llama.cpp's converter writes it; `types` picks a block type per GGUF tensor kind (the part
    of the name after the layer number), F32 for the rest. Quantized tensors are gguf-py's blocks of the
    model's values (legacy types) or random blocks (K/IQ types: the test then compares with transformers)."""
    _, arch, fields = FAMILIES[family]
    cfg = {**COMMON, **fields}
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(ROPE_THETA[family])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    if family in ("llama", "qwen2", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if "head_dim" in fields:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if "sliding_window" in fields:
        writer.add_sliding_window(fields["sliding_window"])
    if family == "gemma2":
        writer.add_attn_logit_softcapping(fields["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(fields["final_logit_softcapping"])
    if vocab is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt2")
        writer.add_token_list([*_byte_alphabet()[:255], "he"])  # one merge's result in place of byte 0xFF
        writer.add_token_types([1] * 256)
        writer.add_token_merges(["h e"])
    else:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(vocab.tokens)
        writer.add_token_types(vocab.types)
        writer.add_token_scores(vocab.scores)
        writer.add_unk_token_id(0)
        if family == "gemma3":
            writer.add_add_space_prefix(False)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg["num_hidden_layers"])
    tied = model.config.tie_word_embeddings
    for hf_name, value in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        module, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(module)}.{suffix}"
        data = value.detach().numpy().astype(np.float32)
        kind = name.split(".")[-2]
        if family == "llama" and kind in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"]
            data = _permute(data, heads)
        if family.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1.0
        qtype = types.get(kind, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(name, data)
        elif qtype in _SCALE_OFFSETS:
            writer.add_tensor(name, raw_blocks(rng, data.shape, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def ours(gguf_path: Path, cache: Path) -> torch.Tensor:
    model = load_tiny(import_gguf(gguf_path, cache))
    with torch.no_grad():
        return model(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])[0]


def theirs(gguf_path: Path) -> torch.Tensor:
    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if config.model_type == "gemma3_text":
        # The one field transformers' GGUF loader leaves at its class default (256, Gemma 3 270M-12B's head_dim)
        # where llama.cpp, which keeps no such key, scales by head_dim ** -0.5 (llm/formats/gguf/hf_config.py).
        config.query_pre_attn_scalar = config.head_dim
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        config=config,
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    ).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_gguf_imports_as_the_model_it_came_from(family: str, tmp_path: Path) -> None:
    model = make_model(family)
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, family, model, {})
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0]
    got = ours(path, tmp_path / "cache")
    assert (got - want).abs().max().item() <= TOLERANCE
    assert want.abs().max().item() > 1.0  # logits that mean something, not a model of zeros


# Block types per GGUF tensor kind: every dequantizable family of types appears in at least one file.
QUANT_MIXES: dict[str, dict[str, Q]] = {
    "legacy": {
        "attn_q": Q.Q4_0,
        "attn_k": Q.Q5_1,
        "attn_v": Q.Q8_0,
        "attn_qkv": Q.Q8_0,
        "attn_output": Q.Q5_0,
        "ffn_gate": Q.Q4_1,
        "ffn_up": Q.F16,
        "ffn_down": Q.BF16,
        "token_embd": Q.Q8_0,
    },
    "k-quants": {"ffn_down": Q.Q4_K, "attn_v": Q.Q8_0, "ffn_up": Q.Q5_0, "token_embd": Q.Q5_0},
}


@pytest.mark.parametrize(
    ("family", "mix"),
    [("llama", "legacy"), ("qwen2", "legacy"), ("gemma3", "legacy"), ("llama", "k-quants"), ("gemma3", "k-quants")],
)
def test_quantized_gguf_logits_equal_transformers_gguf_loader(family: str, mix: str, tmp_path: Path) -> None:
    assert family in TRANSFORMERS_READS_ALL
    path = tmp_path / f"{family}-{mix}.gguf"
    write_gguf(path, family, make_model(family), QUANT_MIXES[mix])
    got, want = ours(path, tmp_path / "cache"), theirs(path)
    assert (got - want).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.TQ2_0])
def test_every_block_type_dequantizes_as_gguf_py(qtype: Q, tmp_path: Path) -> None:
    """One tensor (down_proj, whose rows hold a 256-value block) in each K/IQ type: the import holds exactly
    gguf-py's dequantization of the file's blocks."""
    from safetensors.numpy import load_file

    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", make_model("qwen2"), {"ffn_down": qtype})
    out = import_gguf(path, tmp_path / "cache")
    with gguf_file_of(path) as g:
        tensor = g.tensors["blk.1.ffn_down.weight"]
        want = gguf.quants.dequantize(g.read(tensor), qtype)
    stored: dict[str, np.ndarray] = {}
    for shard in out.glob("model-*.safetensors"):
        stored |= load_file(shard)
    assert np.array_equal(stored["model.layers.1.mlp.down_proj.weight"], want)
    assert np.isfinite(want).all() and want.std() > 0


def gguf_file_of(path: Path) -> Any:
    from llmplan.llm.formats.gguf import open_gguf

    return open_gguf(path)


def test_family_config_fields(tmp_path: Path) -> None:
    """What each family's config.json takes from llama.cpp's keys (or llama.cpp's fixed values)."""
    found: dict[str, dict[str, Any]] = {}
    for family in ("gemma2", "gemma3", "phi3", "qwen3"):
        path = tmp_path / f"{family}.gguf"
        write_gguf(path, family, make_model(family), {})
        found[family] = json.loads((import_gguf(path, tmp_path / "cache") / "config.json").read_text())
    g2, g3 = found["gemma2"], found["gemma3"]
    assert (g2["attn_logit_softcapping"], g2["final_logit_softcapping"], g2["sliding_window"]) == (5.0, 8.0, WINDOW)
    assert g2["model_type"] == "gemma2" and g2["hidden_activation"] == "gelu_pytorch_tanh"
    assert g3["model_type"] == "gemma3_text" and "final_logit_softcapping" not in g3
    assert (g3["sliding_window_pattern"], g3["rope_local_base_freq"], g3["query_pre_attn_scalar"]) == (6, 10000.0, 16)
    assert found["phi3"]["sliding_window"] == WINDOW and found["qwen3"]["head_dim"] == 32


def test_unknown_architecture_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", make_model("llama"), {})
    data = path.read_bytes()
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4 + 8  # the value: type (u32), length (u64), then "llama"
    bad = tmp_path / "falcon.gguf"
    bad.write_bytes(data[:at] + b"mamba" + data[at + 5 :])
    cache = tmp_path / "cache"
    with pytest.raises(GGUFImportError) as info:
        import_gguf(bad, cache)
    message = str(info.value)
    assert message.startswith(f"{bad}: unsupported architecture 'mamba'") and "\n" not in message
    assert not cache.exists() or list(cache.iterdir()) == []


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3"])
def test_sentencepiece_vocabulary_equals_transformers(family: str, tmp_path: Path) -> None:
    """tokenizer.ggml.model 'llama': the import's tokenizer encodes (BOS included) and decodes as transformers'
    tokenizer from the same GGUF, for the three space conventions (Llama, Gemma, Phi-3)."""
    vocab = sentencepiece_vocab()
    path = tmp_path / f"{family}-spm.gguf"
    write_gguf(path, family, make_model(family, vocab_size=len(vocab.tokens)), {}, vocab=vocab)
    ours = Tokenizer.from_dir(import_gguf(path, tmp_path / "cache"))
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.add_bos_token and ours.bos_id == 1
    for text in TOKENIZER_STRINGS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids[1:]) == theirs.decode(ids[1:], skip_special_tokens=False), text
    prefix = [] if family == "gemma3" else [vocab.tokens.index("\u2581")]  # Gemma adds no space in front
    assert ours.encode("q", add_bos=False) == [*prefix, vocab.tokens.index("<0x71>")]  # no piece: byte fallback
    assert ours.encode("<think>", add_bos=False) == [vocab.tokens.index("<think>")]
