"""Hostile corpus, checkpoint reads: every file a load reads is bounded and typed.

Four families, each run through the command line (`llmplan run`) the way a user would meet them:

* GGUF files forged byte by byte (counts, lengths, dimensions, types, offsets, hyperparameters): refused
  before anything is sized by them, naming the file and the key or tensor;
* safetensors shards with hostile headers (lengths, nesting, dtypes, shapes, offsets that overlap or leave
  gaps), with and without a SHA256SUMS the attacker regenerated: refused naming the file and the tensor;
* config.json values out of type, range or finiteness: refused naming the field;
* weights that would give NaN (or overflow the chosen precision), on every precision path: refused at
  load naming the tensor, not found at the first token.

Every case also proves no hang (a time bound), no memory blow-up (a memory bound; a separate process with
an RSS watcher where the blow-up was real) and, by a byte-for-byte snapshot, that the user's files are
exactly as they were. Benign twins (the same file made right) must still load and generate.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from llmplan.engine.cli import main
from llmplan.llm.trust import MANIFEST_NAME
from llmplan.llm.trust.hash_cache import CACHE_NAME
from llmplan.llm.trust.manifest import write_sha256sums

from .checkpoints import make_checkpoint, plan_for
from .hostile import assert_clean_message, memory_bound, refused, run_child, snapshot, time_bound

# ============================================================================ a GGUF written by hand

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B"}
_PACK |= {U64: "<Q", I64: "<q", F64: "<d"}
GGML_F32, GGML_F16, GGML_Q8_0, GGML_I32 = 0, 1, 8, 26


@dataclass(frozen=True)
class Raw:
    """Bytes written as they are, in place of an encoded value (a lying length, a truncated array...)."""

    data: bytes


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def gvalue(kind: int, value: Any) -> bytes:
    if isinstance(value, Raw):
        return value.data
    if kind == STR:
        return gstr(value)
    if kind == ARR:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(gvalue(item, v) for v in items)
    return struct.pack(_PACK[kind], value)


@dataclass
class Tensor:
    name: str | bytes
    dims: list[int]  # ggml order: fastest first
    ggml_type: int
    data: bytes
    offset: int | None = None  # None: laid out after the previous tensor, aligned


@dataclass
class Forge:
    """A GGUF file as a list of key/values and tensors, every byte of which a case may falsify."""

    kvs: list[tuple[str | bytes, int, Any]]
    tensors: list[Tensor]
    magic: bytes = b"GGUF"
    version: int = 3
    alignment: int = 32
    tensor_count: int | None = None
    kv_count: int | None = None
    cut: int | None = None  # keep only this many bytes

    def set(self, key: str, kind: int, value: Any) -> Forge:
        self.kvs = [kv for kv in self.kvs if kv[0] != key] + [(key, kind, value)]
        return self

    def drop(self, key: str) -> Forge:
        self.kvs = [kv for kv in self.kvs if kv[0] != key]
        return self

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def encode(self) -> bytes:
        head = self.magic + struct.pack("<I", self.version)
        head += struct.pack(
            "<QQ",
            len(self.tensors) if self.tensor_count is None else self.tensor_count,
            len(self.kvs) if self.kv_count is None else self.kv_count,
        )
        for key, kind, value in self.kvs:
            head += gstr(key) + struct.pack("<I", kind) + gvalue(kind, value)
        offsets, at = [], 0
        for t in self.tensors:
            offsets.append(at if t.offset is None else t.offset)
            at = -(-(offsets[-1] + len(t.data)) // self.alignment) * self.alignment
        for t, offset in zip(self.tensors, offsets, strict=True):
            head += gstr(t.name) + struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims)
            head += struct.pack("<IQ", t.ggml_type, offset)
        head += b"\0" * (-len(head) % self.alignment)
        data = bytearray()
        for t, offset in zip(self.tensors, offsets, strict=True):
            end = offset + len(t.data)
            if end > 1 << 26:  # a lying offset far past the end: only the header says so
                continue
            if len(data) < end:
                data.extend(b"\0" * (end - len(data)))
            data[offset:end] = t.data
        data.extend(b"\0" * (-len(data) % self.alignment))
        blob = head + bytes(data)
        return blob if self.cut is None else blob[: self.cut]


DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 2, 1, 16, 64, 1
BYTES = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(0xA1, 0xAD)]
BYTES += [chr(c) for c in range(0xAE, 0x100)]
BYTES += [chr(256 + i) for i in range(256 - len(BYTES))]  # GPT-2's byte alphabet, in no particular order
TOKENS = ["<s>", "</s>", *BYTES, "he"]


def f32(rng: np.random.Generator, *shape: int) -> bytes:
    return (rng.standard_normal(shape) * 0.3).astype("<f4").tobytes()


def q8_0(values: np.ndarray) -> bytes:
    """llama.cpp's Q8_0 by hand: per 32 values an fp16 scale d = absmax / 127 and 32 int8 codes."""
    out = bytearray()
    for block in values.reshape(-1, 32).astype(np.float32):
        d = float(np.abs(block).max()) / 127 or 1.0
        out += np.float16(d).tobytes() + np.round(block / d).astype(np.int8).tobytes()
    return bytes(out)


def base_gguf(seed: int = 0, q8: bool = False) -> Forge:
    """A complete 1-layer Llama (byte-level BPE tokenizer, chat template) that imports and generates."""
    rng = np.random.default_rng(seed)
    vocab = len(TOKENS)
    kvs: list[tuple[str | bytes, int, Any]] = [
        ("general.architecture", STR, "llama"),
        ("general.alignment", U32, 32),
        ("llama.block_count", U32, LAYERS),
        ("llama.context_length", U32, 256),
        ("llama.embedding_length", U32, DIM),
        ("llama.feed_forward_length", U32, FFN),
        ("llama.attention.head_count", U32, HEADS),
        ("llama.attention.head_count_kv", U32, KV_HEADS),
        ("llama.rope.freq_base", F32, 10000.0),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("llama.vocab_size", U32, vocab),
        ("tokenizer.ggml.model", STR, "gpt2"),
        ("tokenizer.ggml.pre", STR, "gpt2"),
        ("tokenizer.ggml.tokens", ARR, (STR, TOKENS)),
        ("tokenizer.ggml.token_type", ARR, (I32, [3, 3] + [1] * (vocab - 2))),
        ("tokenizer.ggml.merges", ARR, (STR, ["h e"])),
        ("tokenizer.ggml.bos_token_id", U32, 0),
        ("tokenizer.ggml.eos_token_id", U32, 1),
        ("tokenizer.ggml.add_bos_token", BOOL, 1),
        ("tokenizer.chat_template", STR, "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    ]

    def weight(rows: int, cols: int) -> tuple[list[int], int, bytes]:
        if q8:
            return [cols, rows], GGML_Q8_0, q8_0(rng.standard_normal((rows, cols)) * 0.3)
        return [cols, rows], GGML_F32, f32(rng, rows, cols)

    tensors = [Tensor("token_embd.weight", *weight(vocab, DIM))]
    for i in range(LAYERS):
        tensors += [
            Tensor(f"blk.{i}.attn_norm.weight", [DIM], GGML_F32, (np.ones(DIM, "<f4")).tobytes()),
            Tensor(f"blk.{i}.attn_q.weight", *weight(HEADS * HEAD_DIM, DIM)),
            Tensor(f"blk.{i}.attn_k.weight", *weight(KV_HEADS * HEAD_DIM, DIM)),
            Tensor(f"blk.{i}.attn_v.weight", *weight(KV_HEADS * HEAD_DIM, DIM)),
            Tensor(f"blk.{i}.attn_output.weight", *weight(DIM, HEADS * HEAD_DIM)),
            Tensor(f"blk.{i}.ffn_norm.weight", [DIM], GGML_F32, (np.ones(DIM, "<f4")).tobytes()),
            Tensor(f"blk.{i}.ffn_gate.weight", *weight(FFN, DIM)),
            Tensor(f"blk.{i}.ffn_up.weight", *weight(FFN, DIM)),
            Tensor(f"blk.{i}.ffn_down.weight", *weight(DIM, FFN)),
        ]
    tensors.append(Tensor("output_norm.weight", [DIM], GGML_F32, (np.ones(DIM, "<f4")).tobytes()))
    return Forge(kvs, tensors)


def _nan_at(data: bytes, index: int = 3, value: float = float("nan")) -> bytes:
    values = np.frombuffer(data, "<f4").copy()
    values[index] = value
    return values.tobytes()


def _f16(data: bytes) -> bytes:
    return np.frombuffer(data, "<f4").astype("<f2").tobytes()


@dataclass
class GCase:
    id: str
    forge: Callable[[Forge], Any]
    names: tuple[str, ...]
    child: bool = False  # a real blow-up before the fix: run in a process watched for RSS
    base: Callable[[], Forge] = field(default=base_gguf)


def _t(which: str, **changes: Any) -> Callable[[Forge], None]:
    def edit(f: Forge) -> None:
        for key, value in changes.items():
            setattr(f.tensor(which), key, value)

    return edit


def _raw_kv(key: str, kind: int, raw: bytes) -> Callable[[Forge], None]:
    return lambda f: f.set(key, kind, Raw(raw))


def _dup_tensor(f: Forge) -> None:
    f.tensors.append(Tensor("blk.0.ffn_up.weight", [DIM, FFN], GGML_F32, f.tensor("blk.0.ffn_up.weight").data))


def _overlap(f: Forge, shift: int) -> None:
    """ffn_up placed `shift` bytes into ffn_gate (offsets computed like the writer's)."""
    at = 0
    for t in f.tensors:
        if t.name == "blk.0.ffn_up.weight":
            t.offset = at - shift
            return
        at = -(-(at + len(t.data)) // 32) * 32


Q = "blk.0.ffn_up.weight"
A = "llama.attention"
GGUF_CASES = [
    # --- counts and lengths from the header, checked against the file before anything is allocated
    GCase("block-count-2^40", lambda f: f.set("llama.block_count", U64, 1 << 40), ("llama.block_count",), child=True),
    GCase("block-count-beyond-tensors", lambda f: f.set("llama.block_count", U32, 40), ("block_count 40", "tensors")),
    GCase("block-count-zero", lambda f: f.set("llama.block_count", U32, 0), ("llama.block_count",)),
    GCase("block-count-string", lambda f: f.set("llama.block_count", STR, "1"), ("llama.block_count", "integer")),
    GCase("block-count-float", lambda f: f.set("llama.block_count", F32, 1.0), ("llama.block_count", "integer")),
    GCase("tensor-count-2^40", lambda f: setattr(f, "tensor_count", 1 << 40), ("tensor count",)),
    GCase(
        "tensor-count-one-more",
        lambda f: setattr(f, "tensor_count", len(f.tensors) + 1),
        ("tensor #11 (no name)", "0 dimensions"),
    ),
    GCase("kv-count-2^50", lambda f: setattr(f, "kv_count", 1 << 50), ("metadata key count",)),
    GCase(
        "string-length-2^62",
        _raw_kv("general.name", STR, struct.pack("<Q", 1 << 62) + b"x"),
        ("metadata general.name: length",),
    ),
    GCase(
        "array-length-2^50",
        _raw_kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 1 << 50) + gstr("a")),
        ("tokenizer.ggml.tokens: array length",),
    ),
    GCase(
        "u32-array-past-the-end",
        _raw_kv("tokenizer.ggml.token_type", ARR, struct.pack("<IQ", I32, 1 << 21)),
        ("tokenizer.ggml.token_type: array length",),
    ),
    GCase(
        "tensor-name-2000-bytes",
        lambda f: setattr(f.tensors[0], "name", "t" * 2000),
        ("tensor #0 name: length", "limit"),
    ),
    GCase("truncated-in-metadata", lambda f: setattr(f, "cut", 700), ("tokenizer.ggml.tokens", "bytes follow")),
    GCase("truncated-in-tensor-data", lambda f: setattr(f, "cut", len(f.encode()) - 4096), ("past the end",)),
    # --- dimensions and sizes
    GCase("dims-2^40-squared", _t("token_embd.weight", dims=[1 << 40, 1 << 40]), ("token_embd.weight", "past the end")),
    GCase("dims-overflow-u64", _t(Q, dims=[1 << 63, 4]), (Q, "past the end")),
    GCase("five-dims", _t(Q, dims=[DIM, FFN, 1, 1, 1]), (Q, "5 dimensions")),
    GCase("zero-dims", _t(Q, dims=[]), (Q, "0 dimensions")),
    GCase("a-zero-dim", _t(Q, dims=[DIM, 0]), (Q, "include 0")),
    GCase("q8-row-not-a-block", _t(Q, dims=[33, FFN], ggml_type=GGML_Q8_0), (Q, "not a multiple of Q8_0")),
    GCase("shape-disagrees-with-config", _t(Q, dims=[FFN, DIM]), (Q, "expected")),
    # --- types
    GCase("unknown-ggml-type", _t(Q, ggml_type=99), (Q, "unknown ggml type 99")),
    GCase("integer-tensor", _t(Q, ggml_type=GGML_I32), (Q, "type I32")),
    GCase("unknown-value-type", lambda f: f.set("general.name", 13, Raw(b"")), ("general.name", "value type 13")),
    GCase("array-of-arrays", lambda f: f.set("general.tags", ARR, (ARR, [])), ("general.tags", "arrays of arrays")),
    GCase(
        "bool-byte-2", lambda f: f.set("tokenizer.ggml.add_bos_token", BOOL, 2), ("add_bos_token", "neither 0 nor 1")
    ),
    GCase(
        "tokens-as-integers",
        lambda f: f.set("tokenizer.ggml.tokens", ARR, (U32, list(range(len(TOKENS))))),
        ("tokenizer.ggml.tokens", "array of strings"),
    ),
    GCase("key-not-utf8", lambda f: f.kvs.append((b"general.\xff", U32, 1)), ("metadata key #20", "not UTF-8")),
    GCase("tensor-name-not-utf8", lambda f: setattr(f.tensors[3], "name", b"blk.\xff"), ("tensor #3 name", "UTF-8")),
    GCase("duplicate-key", lambda f: f.kvs.append(("llama.block_count", U32, 1)), ("llama.block_count", "twice")),
    GCase("duplicate-tensor", _dup_tensor, (Q, "twice")),
    # --- offsets: alignment, bounds, overlap
    GCase("offset-misaligned", lambda f: _overlap(f, -4), (Q, "alignment")),
    GCase("offset-past-the-end", _t(Q, offset=1 << 40), (Q, "past the end")),
    GCase("overlap-same-offset", lambda f: setattr(f.tensor(Q), "offset", 0), (Q, "token_embd.weight", "overlap")),
    GCase("overlap-partial", lambda f: _overlap(f, 32), (Q, "blk.0.ffn_gate.weight", "overlap")),
    GCase("alignment-48", lambda f: f.set("general.alignment", U32, 48), ("general.alignment", "power of two")),
    GCase("alignment-zero", lambda f: f.set("general.alignment", U32, 0), ("general.alignment",)),
    GCase("alignment-u64", lambda f: f.set("general.alignment", U64, 32), ("general.alignment", "u32")),
    # --- the file itself
    GCase("no-magic", lambda f: setattr(f, "magic", b"GGUG"), ("GGUF magic",)),
    GCase("version-99", lambda f: setattr(f, "version", 99), ("version 99",)),
    GCase("big-endian", lambda f: setattr(f, "version", 3 << 24), ("big-endian",)),
    GCase("empty", lambda f: setattr(f, "cut", 0), ("GGUF magic",)),
    # --- hyperparameters: type, range, finiteness
    GCase("rope-base-inf", lambda f: f.set("llama.rope.freq_base", F32, float("inf")), ("llama.rope.freq_base",)),
    GCase("rope-base-1e300", lambda f: f.set("llama.rope.freq_base", F64, 1e300), ("llama.rope.freq_base",)),
    GCase("rope-base-zero", lambda f: f.set("llama.rope.freq_base", F32, 0.0), ("llama.rope.freq_base",)),
    GCase("rope-base-negative", lambda f: f.set("llama.rope.freq_base", F32, -1e4), ("llama.rope.freq_base",)),
    GCase("eps-inf", lambda f: f.set(f"{A}.layer_norm_rms_epsilon", F32, float("inf")), ("layer_norm_rms_epsilon",)),
    GCase("eps-nan", lambda f: f.set(f"{A}.layer_norm_rms_epsilon", F32, float("nan")), ("layer_norm_rms_epsilon",)),
    GCase("eps-1e10", lambda f: f.set(f"{A}.layer_norm_rms_epsilon", F32, 1e10), ("layer_norm_rms_epsilon",)),
    GCase("eps-zero", lambda f: f.set(f"{A}.layer_norm_rms_epsilon", F32, 0.0), ("layer_norm_rms_epsilon",)),
    GCase("eps-missing", lambda f: f.drop(f"{A}.layer_norm_rms_epsilon"), ("layer_norm_rms_epsilon", "missing")),
    GCase("context-zero", lambda f: f.set("llama.context_length", U32, 0), ("llama.context_length",)),
    GCase("heads-zero", lambda f: f.set(f"{A}.head_count", U32, 0), (f"{A}.head_count",)),
    GCase("kv-heads-above-heads", lambda f: f.set(f"{A}.head_count_kv", U32, 4), (f"{A}.head_count_kv",)),
    GCase("width-not-divisible", lambda f: f.set(f"{A}.head_count", U32, 3), ("embedding_length 32", "head_count 3")),
    GCase("vocab-2^40", lambda f: f.set("llama.vocab_size", U64, 1 << 40), ("llama.vocab_size",)),
    GCase("bos-outside-vocab", lambda f: f.set("tokenizer.ggml.bos_token_id", U32, 10**6), ("bos_token_id",)),
    GCase("eos-as-string", lambda f: f.set("tokenizer.ggml.eos_token_id", STR, "1"), ("eos_token_id", "integer")),
    GCase(
        "token-types-short",
        lambda f: f.set("tokenizer.ggml.token_type", ARR, (I32, [1, 1])),
        ("token_type has 2 entries",),
    ),
    GCase("layer-beyond-block-count", _t(Q, name="blk.7.ffn_up.weight"), ("blk.7.ffn_up.weight", "block_count")),
    # --- weights that would give NaN: refused at import, naming the tensor
    GCase("nan-in-f32-weight", lambda f: setattr(f.tensor(Q), "data", _nan_at(f.tensor(Q).data)), (Q, "NaN")),
    GCase(
        "inf-in-f16-weight",
        lambda f: _t(Q, ggml_type=GGML_F16, data=_f16(_nan_at(f.tensor(Q).data, 9, float("inf"))))(f),
        (Q, "infinite"),
    ),
    GCase(
        "nan-q8-block-scale",
        lambda f: setattr(f.tensor(Q), "data", b"\x00\x7e" + f.tensor(Q).data[2:]),
        (Q, "NaN"),
        base=lambda: base_gguf(q8=True),
    ),
]


@pytest.fixture(scope="module")
def gguf_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _gguf_plan(tmp: Path, blob: bytes) -> tuple[Path, Path, Path]:
    user = tmp / "user"
    user.mkdir()
    gguf = user / "model.gguf"
    gguf.write_bytes(blob)
    return user, gguf, plan_for(tmp, gguf, hashes="required")


def _no_import_left(cache: Path) -> None:
    models = cache / "models"
    left = [p.name for p in models.iterdir() if p.is_dir()] if models.exists() else []
    assert left == [], f"an import was left behind: {left}"


def test_the_corpus_is_big_enough() -> None:
    families = {"gguf": GGUF_CASES, "safetensors": SHARD_CASES, "config": CONFIG_CASES, "weights": WEIGHT_CASES}
    ids = [f"{family}/{case.id}" for family, cases in families.items() for case in cases]
    assert len(ids) >= 50 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GGUF_CASES])
def test_hostile_gguf_is_refused_naming_the_key_or_tensor(
    case: GCase, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forge = case.base()
    case.forge(forge)
    user, gguf, plan = _gguf_plan(tmp_path, forge.encode())
    cache = tmp_path / "cache"
    monkeypatch.setenv("LLMPLAN_CACHE", str(cache))
    before = snapshot(user)
    argv = ["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"]
    if case.child:  # before the fix these took the machine's memory (or looped for hours): a watched process
        child = run_child(argv, seconds=180, memory_mb=1500, env={"LLMPLAN_CACHE": str(cache)})
        assert child.code not in (0, None), child.stderr[-600:]
        assert_clean_message(child.stderr, (str(gguf), *case.names))
    else:
        refused(argv, capsys, names=(str(gguf), *case.names), seconds=120, memory_mb=300)
    assert snapshot(user) == before
    _no_import_left(cache)


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(lambda: base_gguf(), id="f32"),
        pytest.param(lambda: base_gguf(q8=True), id="q8_0"),
        pytest.param(lambda: base_gguf().set("general.alignment", U32, 64), id="alignment-64"),
    ],
)
def test_benign_gguf_twin_imports_and_generates(
    variant: Callable[[], Forge], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    forge = variant()
    forge.alignment = forge_alignment(forge)
    user, _, plan = _gguf_plan(tmp_path, forge.encode())
    monkeypatch.setenv("LLMPLAN_CACHE", str(tmp_path / "cache"))
    before = snapshot(user)
    with time_bound(120), memory_bound(400):
        code = main(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"])
    said = capsys.readouterr()
    assert code == 0, said.err[-800:]
    assert json.loads((tmp_path / "run" / "generations.json").read_text())
    assert snapshot(user) == before


def forge_alignment(forge: Forge) -> int:
    return next((v for k, _, v in forge.kvs if k == "general.alignment"), 32)


# ============================================================================ safetensors shards

TENSOR = "model.layers.1.self_attn.q_proj.weight"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def shard_of(model_dir: Path, tensor: str) -> Path:
    return model_dir / json.loads((model_dir / INDEX).read_text())["weight_map"][tensor]


def split(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join(header: dict[str, Any] | bytes, data: bytes, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


@dataclass
class SCase:
    id: str
    damage: Callable[[Path], Any]  # gets the shard holding TENSOR, rewrites it
    names: tuple[str, ...]
    resum: bool = True  # the attacker also regenerated SHA256SUMS (so hashes: required passes)


def _edit(change: Callable[[dict[str, Any], bytes], tuple[Any, bytes] | None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        header, data = split(path)
        done = change(header, data)
        header, data = done if done is not None else (header, data)
        path.write_bytes(join(header, data))

    return damage


def _entry(**changes: Any) -> Callable[[Path], None]:
    return _edit(lambda h, d: h[TENSOR].update(changes))


def _raw_header(text: bytes) -> Callable[[Path], None]:
    return lambda p: p.write_bytes(join(text, split(p)[1]))


def _overlap_shard(h: dict[str, Any], d: bytes) -> None:
    """The second tensor in file order starts 4 bytes inside the first: both read the same 4 bytes."""
    second = sorted((e["data_offsets"][0], k) for k, e in h.items() if k != "__metadata__")[1][1]
    h[second]["data_offsets"] = [o - 4 for o in h[second]["data_offsets"]]


def _shift_all(h: dict[str, Any], d: bytes) -> tuple[dict[str, Any], bytes]:
    for name, entry in h.items():
        if name != "__metadata__":
            entry["data_offsets"] = [o + 64 for o in entry["data_offsets"]]
    return h, b"\0" * 64 + d


def _grow_last(h: dict[str, Any], d: bytes) -> None:
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    h[last]["data_offsets"][1] += 4096


def _long_name(h: dict[str, Any], d: bytes) -> None:
    h["x\n" * 5000] = {**h.pop(TENSOR), "dtype": "Q9"}


def _named(name: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        path.unlink()
        path.symlink_to(name)

    return damage


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


SHARD_CASES = [
    SCase("header-length-past-the-end", lambda p: p.write_bytes(join(*split(p), length=1 << 20)), ("truncated",)),
    SCase("header-length-2^63", lambda p: p.write_bytes(join(*split(p), length=1 << 63)), ("header length",)),
    SCase("deeply-nested-header", _raw_header(b'{"a":' * 50000 + b"1" + b"}" * 50000), ("nested too deeply",)),
    SCase(
        "5000-digit-offset",
        _raw_header(b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,' + b"9" * 5000 + b"]}}"),
        ("too many digits",),
    ),
    SCase("nan-in-shape", _raw_header(b'{"t":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}'), ("'t'", "shape")),
    SCase("unknown-dtype", _entry(dtype="F128"), (TENSOR, "unknown dtype 'F128'")),
    SCase("integer-dtype", _entry(dtype="I32"), (TENSOR, "I32")),
    SCase(
        "bool-in-shape",
        _edit(lambda h, d: h[TENSOR].update(shape=[True, h[TENSOR]["shape"][1] * 64])),
        (TENSOR, "bad shape"),
    ),
    SCase("negative-dim", _edit(lambda h, d: h[TENSOR].update(shape=[-h[TENSOR]["shape"][0], 1])), (TENSOR, "shape")),
    SCase("nine-dims", _edit(lambda h, d: h[TENSOR].update(shape=h[TENSOR]["shape"] + [1] * 7)), (TENSOR, "shape")),
    SCase(
        "offsets-reversed",
        _edit(lambda h, d: h[TENSOR].update(data_offsets=h[TENSOR]["data_offsets"][::-1])),
        (TENSOR, "data_offsets"),
    ),
    SCase(
        "offsets-as-floats",
        _edit(lambda h, d: h[TENSOR].update(data_offsets=[float(o) for o in h[TENSOR]["data_offsets"]])),
        (TENSOR, "data_offsets"),
    ),
    SCase("span-wrong-for-dtype", _entry(dtype="F16"), (TENSOR, "needs")),
    SCase("overlapping-tensors", _edit(_overlap_shard), ("overlaps", "belong to both")),
    SCase("gap-before-the-data", _edit(_shift_all), ("leaving bytes 0 to 64 unused",)),
    SCase("last-tensor-past-the-end", _edit(_grow_last), ("needs",)),
    SCase("trailing-bytes", lambda p: p.write_bytes(p.read_bytes() + b"\0" * 100), ("trailing data",)),
    SCase(
        "duplicate-tensor-key",
        _raw_header(
            b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
        ),
        ("'a' appears twice",),
    ),
    SCase("metadata-a-list", _edit(lambda h, d: h.update({"__metadata__": [1, 2]})), ("__metadata__",)),
    SCase("metadata-not-strings", _edit(lambda h, d: h.update({"__metadata__": {"format": 7}})), ("__metadata__",)),
    SCase("entry-a-number", _edit(lambda h, d: h.update({TENSOR: 5})), (TENSOR, "not an object")),
    SCase("header-a-list", _raw_header(b"[1, 2, 3]"), ("not a JSON object",)),
    SCase("header-not-utf8", _raw_header(b'{"\xff\xfe": 1}'), ("not UTF-8",)),
    SCase("name-5000-lines", _edit(_long_name), ("unknown dtype 'Q9'", "...")),
    SCase("shard-is-a-fifo", _fifo, ("not a regular file",), resum=False),
    SCase("shard-is-dev-zero", _named("/dev/zero"), ("/dev/zero",), resum=False),
]


def _sums(model_dir: Path) -> None:
    names = [p.name for p in model_dir.iterdir() if p.is_file() and p.name not in (MANIFEST_NAME, CACHE_NAME)]
    write_sha256sums(model_dir, sorted(names))


def _user_files(before: dict[str, Any], root: Path) -> None:
    """Byte-for-byte the same, except llmplan's own hash cache (which a load may write)."""
    after = snapshot(root)
    own = {k for k in {*before, *after} if Path(k).name.startswith(CACHE_NAME)}
    assert {k: v for k, v in after.items() if k not in own} == {k: v for k, v in before.items() if k not in own}


@pytest.mark.parametrize("hashes", ["off", "required"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in SHARD_CASES])
def test_hostile_safetensors_header_is_refused_naming_the_tensor(
    case: SCase, hashes: str, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if hashes == "required" and not case.resum:
        pytest.skip("a FIFO or device cannot be listed in SHA256SUMS")
    model = Path(shutil.copytree(pristine, tmp_path / "model", symlinks=True))
    shard = shard_of(model, TENSOR)
    case.damage(shard)
    if hashes == "required":
        _sums(model)
    plan = plan_for(tmp_path, model, hashes=hashes)
    before = snapshot(model)
    refused(
        ["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"],
        capsys,
        names=(shard.name, *case.names),
        seconds=120,
        memory_mb=300,
    )
    _user_files(before, model)


# ============================================================================ config.json


@dataclass
class CCase:
    id: str
    edit: Callable[[str], str]  # the config's text -> the hostile text
    names: tuple[str, ...]


def _field(key: str, literal: str) -> Callable[[str], str]:
    """Set a top-level field to a JSON literal written as text (Infinity, NaN, 5000 digits...)."""

    def edit(text: str) -> str:
        data = json.loads(text)
        data[key] = "@@"
        return json.dumps(data).replace('"@@"', literal)

    return edit


def _without(key: str, then: Callable[[str], str]) -> Callable[[str], str]:
    def edit(text: str) -> str:
        data = json.loads(text)
        data.pop(key)
        return then(json.dumps(data))

    return edit


_LLAMA3 = (
    '{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0, '
    '"original_max_position_embeddings": 64}'
)
CONFIG_CASES = [
    CCase("rope-theta-inf", _field("rope_theta", "Infinity"), ("rope_theta",)),
    CCase("rope-theta-1e300", _field("rope_theta", "1e300"), ("rope_theta", "1e+300")),
    CCase("rope-theta-zero", _field("rope_theta", "0"), ("rope_theta",)),
    CCase("rope-theta-negative", _field("rope_theta", "-10000.0"), ("rope_theta",)),
    CCase("rope-theta-nan", _field("rope_theta", "NaN"), ("rope_theta",)),
    CCase("eps-inf", _field("rms_norm_eps", "Infinity"), ("rms_norm_eps",)),
    CCase("eps-1e10", _field("rms_norm_eps", "1e10"), ("rms_norm_eps",)),
    CCase("eps-zero", _field("rms_norm_eps", "0.0"), ("rms_norm_eps",)),
    CCase("eps-negative", _field("rms_norm_eps", "-1e-5"), ("rms_norm_eps",)),
    CCase("max-positions-zero", _field("max_position_embeddings", "0"), ("max_position_embeddings",)),
    CCase("max-positions-2^40", _field("max_position_embeddings", str(1 << 40)), ("max_position_embeddings",)),
    CCase("hidden-not-divisible", _without("head_dim", _field("hidden_size", "66")), ("hidden_size (66)",)),
    CCase("kv-heads-above-heads", _field("num_key_value_heads", "8"), ("num_key_value_heads (8)",)),
    CCase("vocab-zero", _field("vocab_size", "0"), ("vocab_size",)),
    CCase("vocab-absurd", _field("vocab_size", str(10**15)), ("vocab_size",)),
    CCase("layers-absurd", _field("num_hidden_layers", str(10**8)), ("num_hidden_layers",)),
    CCase("tie-as-string", _field("tie_word_embeddings", '"false"'), ("tie_word_embeddings",)),
    CCase("heads-as-float", _field("num_attention_heads", "4.0"), ("num_attention_heads", "integer")),
    CCase("5000-digit-integer", _field("num_hidden_layers", "3" * 5000), ("config.json", "too many digits")),
    CCase("bos-outside-vocab", _field("bos_token_id", "100000"), ("bos_token_id",)),
    CCase("eos-negative", _field("eos_token_id", "[2, -1]"), ("eos_token_id",)),
    CCase("llama3-scaling-equal-factors", _field("rope_scaling", _LLAMA3), ("rope_scaling.high_freq_factor",)),
    CCase(
        "llama3-scaling-factor-inf",
        _field("rope_scaling", _LLAMA3.replace('"factor": 8.0', '"factor": Infinity')),
        ("rope_scaling.factor",),
    ),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CONFIG_CASES])
def test_hostile_config_value_is_refused_naming_the_field(
    case: CCase, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Path(shutil.copytree(pristine, tmp_path / "model", symlinks=True))
    config = model / "config.json"
    config.write_text(case.edit(config.read_text()))
    _sums(model)  # the attacker regenerated SHA256SUMS: the values themselves must be refused
    plan = plan_for(tmp_path, model, hashes="required")
    before = snapshot(model)
    refused(
        ["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"],
        capsys,
        names=(str(config), *case.names),
        seconds=120,
        memory_mb=300,
    )
    _user_files(before, model)


# ============================================================================ weights that give NaN


@dataclass
class WCase:
    id: str
    tensor: str
    value: float
    dtype: str  # load.convert's precision
    names: tuple[str, ...]
    head: str = "same"


W_Q, W_NORM, W_EMBED = TENSOR, "model.layers.2.post_attention_layernorm.weight", "model.embed_tokens.weight"
NAN, INF = float("nan"), float("inf")
WEIGHT_CASES = [
    WCase("nan-fp32", W_Q, NAN, "fp32", (W_Q, "NaN")),
    WCase("nan-fp16", W_Q, NAN, "fp16", (W_Q, "NaN")),
    WCase("nan-bf16", W_Q, NAN, "bf16", (W_Q, "NaN")),
    WCase("nan-int8", W_Q, NAN, "int8", (W_Q, "NaN")),
    WCase("nan-int4", W_Q, NAN, "int4", (W_Q, "NaN")),
    WCase("inf-norm-weight", W_NORM, INF, "int8", (W_NORM, "infinite")),
    WCase("minus-inf-embedding", W_EMBED, -INF, "bf16", (W_EMBED, "infinite")),
    WCase("beyond-fp16", W_Q, 1e6, "fp16", (W_Q, "beyond what fp16 stores")),
    WCase("beyond-int4-scale", W_Q, -3e5, "int4", (W_Q, "beyond what int4 stores")),
    WCase("head-fp16-overflow", "lm_head.weight", 7e4, "fp32", ("lm_head.weight", "fp16"), head="fp16"),
]


def _poison(model: Path, tensor: str, value: float) -> Path:
    shard = shard_of(model, tensor)
    header, data = split(shard)
    begin = header[tensor]["data_offsets"][0]
    data = data[:begin] + struct.pack("<f", value) + data[begin + 4 :]
    shard.write_bytes(join(header, data))
    _sums(model)  # regenerated: the hash says nothing about whether the values are usable
    return shard


def _with_convert(plan: Path, **settings: Any) -> Path:
    data = yaml.safe_load(plan.read_text())
    next(s for s in data["stages"] if s["id"] == "convert")["with"].update(settings)
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    return plan


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in WEIGHT_CASES])
def test_weights_that_give_nan_are_refused_at_load(
    case: WCase, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Path(shutil.copytree(pristine, tmp_path / "model", symlinks=True))
    shard = _poison(model, case.tensor, case.value)
    plan = _with_convert(plan_for(tmp_path, model, hashes="required"), dtype=case.dtype, head=case.head)
    before = snapshot(model)
    said = refused(
        ["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"],
        capsys,
        names=(str(shard), *case.names),
        seconds=120,
        memory_mb=400,
    )
    assert "convert" in said  # refused while converting, never reaching generation
    assert not (tmp_path / "run" / "generations.json").exists()
    _user_files(before, model)


@pytest.mark.parametrize(
    ("tensor", "value", "dtype"),
    [
        pytest.param(W_Q, 1e6, "bf16", id="1e6-as-bf16"),
        pytest.param(W_Q, 6e4, "fp16", id="6e4-as-fp16"),
        pytest.param(W_NORM, -3e5, "int4", id="norm-3e5-int4"),  # norms stay fp32 on the CPU
    ],
)
def test_benign_large_weight_twin_still_loads(
    tensor: str, value: float, dtype: str, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Path(shutil.copytree(pristine, tmp_path / "model", symlinks=True))
    _poison(model, tensor, value)
    plan = _with_convert(plan_for(tmp_path, model, hashes="required"), dtype=dtype)
    with time_bound(120), memory_bound(400):
        code = main(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"])
    assert code == 0, capsys.readouterr().err[-800:]


@pytest.fixture(scope="module")
def converted(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint as load.convert saves it at int4: codes, fp16 scales and minimums."""
    tmp = tmp_path_factory.mktemp("converted")
    out = tmp / "int4"
    plan = _with_convert(plan_for(tmp, pristine, hashes="required"), dtype="int4", save_to=str(out))
    assert main(["run", str(plan), "--out", str(tmp / "run"), "--quiet"]) == 0
    return out


@pytest.mark.parametrize(
    ("tensor", "value"),
    [
        pytest.param("layers.0.attention.wqkv.weight_scale", NAN, id="nan-scale"),
        pytest.param("layers.2.feed_forward.w2.weight_zero", -INF, id="inf-minimum"),
        pytest.param("norm.weight", NAN, id="nan-float-weight"),
    ],
)
def test_converted_checkpoint_with_nan_is_refused_at_load(
    tensor: str, value: float, converted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Path(shutil.copytree(converted, tmp_path / "model", symlinks=True))
    shard = shard_of(model, tensor)
    header, data = split(shard)
    begin = header[tensor]["data_offsets"][0]
    packed = struct.pack("<e" if header[tensor]["dtype"] == "F16" else "<f", value)
    shard.write_bytes(join(header, data[:begin] + packed + data[begin + len(packed) :]))
    _sums(model)
    plan = _with_convert(plan_for(tmp_path, model, hashes="required"), dtype="int4")
    before = snapshot(model)
    refused(
        ["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"],
        capsys,
        names=(str(shard), tensor, "NaN or infinite"),
        seconds=120,
        memory_mb=400,
    )
    _user_files(before, model)
