"""Import a Llama GGUF once into an HF-format directory: config, tokenizer, fp32 safetensors shards.

The GGUF is the distribution format; everything downstream (config.py, the tokenizer, the weight
loader) reads plain HF files. Importing is a one-off cost, cached under the GGUF's content hash:

    model_dir = import_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"), Path.home() / ".cache/llmplan")

Two llama.cpp conventions are undone on the way:
  * quantized blocks are dequantized with gguf-py (`gguf.quants.dequantize`), which implements
    llama.cpp's own definitions (Q4_1: d*q + m, Q8_0: d*q, ...), into float32;
  * convert_hf_to_gguf.py permutes the rows of q_proj/k_proj so that ggml's interleaved RoPE
    (rotating pairs (0,1), (2,3), ...) matches HF's rotate_half RoPE (pairs (i, i + d/2)); HF
    layout needs the inverse permutation.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmplan.bounded_read import NotRegularFileError

from .config import MAX_POSITIONS, ConfigError, ModelConfig
from .files import describe_os_error
from .gguf_file import GGUFFile, GGUFFileError, TensorInfo, open_gguf
from .hash_cache import HashCache, identity_of
from .import_dirs import TEMP_MARK, finish_import_dir, make_import_dir, remove_stale_imports
from .manifest import MANIFEST_NAME, open_regular_fd, sha256_fd, write_sha256sums

ProgressFn = Callable[[str, int, int], None]
"""Called as progress(stage, done, total); stages: "hash" (bytes), "tensors" (tensors written)."""

DEFAULT_SHARD_BYTES = 200 * 1000 * 1000
SUPPORTED_ARCHITECTURES = ("llama",)
_TEMP_MARK = TEMP_MARK  # temp dirs are ".<name>.importing-<pid>-<nonce>": hidden, never a finished import

# llama.cpp's token types (llama_token_type / gguf TokenType)
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> how text is split before byte-level BPE. These mirror llama.cpp's
# llama-vocab.cpp regexes for the same names (and each model's original tokenizer.json).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str, str] = {
    # "\p{N}" first, then the GPT-2 regex: every digit is its own pre-token
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "codeshell": "digits+gpt2",
    # the GPT-2 regex alone
    "gpt2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    # llama3's regex (digits in runs of up to three)
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
}
# llama.cpp sets ignore_merges for llama3-style vocabularies: a word found whole in the vocab
# is one token even when the merges would not build it.
_IGNORE_MERGES = {"llama3"}

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


class GGUFImportError(ValueError):
    """The GGUF cannot be imported: unreadable, corrupt or not a supported Llama. One line naming the file."""


@dataclass(frozen=True)
class _Planned:
    gguf_name: str
    hf_name: str
    hf_shape: tuple[int, ...]
    type_name: str
    unpermute_heads: int | None  # q/k: the head count whose RoPE row permutation to undo

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.hf_shape)) * 4


def import_gguf(
    gguf_path: Path,
    cache_root: Path,
    progress: ProgressFn | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    note: Callable[[str], None] | None = None,
) -> Path:
    """Import `gguf_path` into `cache_root/<sha256[:16]>-<stem>` (once) and return that directory.

    A finished import is only read, so a read-only cache works once it holds the import; recording the
    GGUF's hash for the next warm start is an optimisation, skipped (and `note` told why) where it cannot be.
    """
    gguf_path, cache_root = Path(gguf_path), Path(cache_root)
    try:
        fd = open_regular_fd(gguf_path)
    except NotRegularFileError as bad:
        raise GGUFImportError(str(bad)) from None
    except OSError as bad:
        raise GGUFImportError(describe_os_error(gguf_path, bad)) from None
    known = HashCache(cache_root)
    try:
        digest = _gguf_digest(fd, gguf_path, known, progress)
    finally:
        os.close(fd)
    target = cache_root / f"{digest[:16]}-{gguf_path.stem}"
    # The rename below is the commit point, so an existing target is a finished import.
    if (target / MANIFEST_NAME).is_file():
        remove_stale_imports(cache_root)  # what a killed import left, even when another one finished since
        _save_hashes(known, note)
        return target
    if target.exists() or target.is_symlink():  # only something outside this module can leave it half-made
        raise GGUFImportError(f"{target}: exists but has no {MANIFEST_NAME}, so it is not a finished import")
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        remove_stale_imports(cache_root)
        temp = make_import_dir(target)
    except OSError as bad:
        raise GGUFImportError(
            f"{cache_root}: cannot import {gguf_path.name} there ({bad.strerror or bad}); "
            "set LLMPLAN_CACHE or model.source's cache_dir to a writable folder"
        ) from None
    try:
        _write_import(gguf_path, temp, progress, shard_bytes)
        finish_import_dir(temp)
        for item in [*temp.iterdir(), temp]:  # durable before the rename publishes it as finished
            _fsync(item)
        try:
            os.rename(temp, target)
        except OSError:
            # Another process finished the same import first; theirs is as good as ours.
            if not (target / MANIFEST_NAME).is_file():
                raise
            shutil.rmtree(temp, ignore_errors=True)
        else:
            _fsync(cache_root)
    except OSError as bad:
        shutil.rmtree(temp, ignore_errors=True)
        raise GGUFImportError(
            f"{cache_root}: cannot write the import of {gguf_path.name} ({bad.strerror or bad}); nothing was kept"
        ) from None
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _save_hashes(known, note)  # only once the import is done: an interrupted one leaves nothing behind
    return target


def _save_hashes(known: HashCache, note: Callable[[str], None] | None) -> None:
    if not known.save() and note is not None and known.note:
        note(known.note)


def _gguf_digest(fd: int, path: Path, known: HashCache, progress: ProgressFn | None) -> str:
    """The GGUF's SHA-256: from the cache root's hash cache for this very file identity, else hashed.

    A warm start finds the import by the file's identity instead of re-hashing it: 0.15 s for SmolLM2's
    98 MB, seconds for a multi-GB GGUF. Same trust as `load.verify`'s hash cache (authenticated entries).
    """
    name = str(path.absolute())
    before = identity_of(os.fstat(fd))
    digest = known.lookup(name, before)
    if digest is not None:
        return digest
    done = 0

    def on_hashed(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress("hash", done, before[0])

    try:
        digest = sha256_fd(fd, on_hashed)
    except OSError as bad:
        raise _fail(path, f"cannot read ({bad.strerror or bad})") from None
    if identity_of(os.fstat(fd)) == before:
        known.record(name, before, digest)
    return digest


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fail(path: Path, reason: object) -> GGUFImportError:
    return GGUFImportError(f"{path}: {' '.join(str(reason).split())}")


def _write_import(gguf_path: Path, out: Path, progress: ProgressFn | None, shard_bytes: int) -> None:
    try:
        with open_gguf(gguf_path) as gguf_file:
            _write_from(gguf_file, out, progress, shard_bytes)
    except GGUFFileError as bad:
        detail = str(bad).removeprefix(f"{gguf_path}: ")
        raise GGUFImportError(f"{gguf_path}: not a readable GGUF file: {detail}") from None


def _write_from(gguf_file: GGUFFile, out: Path, progress: ProgressFn | None, shard_bytes: int) -> None:
    gguf_path = gguf_file.path
    meta = _Metadata(gguf_file)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise _fail(gguf_path, f"unsupported architecture {_shown(arch)} (supported: {supported})")

    tensors = gguf_file.tensors
    config = _hf_config(meta, tensors, gguf_path)
    plan = _plan_tensors(tensors, config, gguf_path)

    tokenizer_json, tokenizer_config = _hf_tokenizer(meta, gguf_path)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    weight_files = _write_shards(gguf_file, plan, out, progress, shard_bytes)
    # The manifest is written last: its presence marks a complete directory.
    write_sha256sums(out, ["config.json", "tokenizer.json", "tokenizer_config.json", *weight_files])


_MISSING: Any = object()


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Metadata:
    """Typed access to GGUF key/values: an absent, ill-typed or out-of-range value is a GGUFImportError
    naming the key (the values themselves were read with bounds by gguf_file.py)."""

    def __init__(self, gguf_file: GGUFFile) -> None:
        self._values = gguf_file.metadata
        self._types = gguf_file.types
        self._path = gguf_file.path

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def _wrong(self, key: str, wanted: str) -> GGUFImportError:
        value = self._values[key]
        return _fail(self._path, f"metadata {key}: expected {wanted}, got {self._types[key]} {_shown(value)}")

    def integer(self, key: str, default: Any = _MISSING, low: int = 0, high: int = 1 << 62) -> Any:
        if key not in self._values:
            if default is _MISSING:
                raise _fail(self._path, f"metadata {key} is missing")
            return default
        value = self._values[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self._wrong(key, f"an integer from {low} to {high}")
        return value

    def number(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self._values:
            if default is _MISSING:
                raise _fail(self._path, f"metadata {key} is missing")
            return default
        value = self._values[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self._wrong(key, "a finite number")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._values.get(key, default)
        if not isinstance(value, bool):
            raise self._wrong(key, "a bool")
        return value

    def text(self, key: str, default: Any = None) -> Any:
        value = self._values.get(key, default)
        if value is not default and not isinstance(value, str):
            raise self._wrong(key, "a string")
        return value

    def strings(self, key: str) -> list[str]:
        if key not in self._values:
            raise _fail(self._path, f"metadata {key} is missing")
        if self._types[key] != "array[string]":
            raise self._wrong(key, "an array of strings")
        return list(self._values[key])

    def integers(self, key: str) -> list[int] | None:
        if key not in self._values:
            return None
        value = self._values[key]
        if not self._types[key].startswith("array[") or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise self._wrong(key, "an array of integers")
        return list(value)


def _f32(value: float) -> float:
    # GGUF stores float32; its shortest round-tripping repr is the value the converter was given (1e-05, not
    # 9.999999747378752e-06).
    return float(str(np.float32(value)))


# Sane upper bounds for a Llama's hyperparameters, checked before anything is sized by them; the tensors'
# shapes (bounded by the file's size) are then checked against every one.
_MAX_LAYERS = 4096
_MAX_WIDTH = 1 << 20
_MAX_HEADS = 1 << 12
_MAX_VOCAB = 1 << 24
_TENSORS_PER_LAYER = len(_LAYER_TENSORS)
# ggml types that hold float weights gguf-py dequantizes (integer tensors are no Llama weight)
_WEIGHT_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    | {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"}
)
# config.json field -> the GGUF key it came from, so a value config.py refuses is reported by its key
_CONFIG_KEYS = {
    "num_hidden_layers": "{a}.block_count",
    "hidden_size": "{a}.embedding_length",
    "num_attention_heads": "{a}.attention.head_count",
    "num_key_value_heads": "{a}.attention.head_count_kv",
    "head_dim": "{a}.attention.key_length",
    "intermediate_size": "{a}.feed_forward_length",
    "vocab_size": "{a}.vocab_size",
    "rope_theta": "{a}.rope.freq_base",
    "rms_norm_eps": "{a}.attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "{a}.context_length",
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
}


def _hf_config(meta: _Metadata, tensors: dict[str, TensorInfo], path: Path) -> dict[str, Any]:
    a = meta.get("general.architecture")
    hidden = meta.integer(f"{a}.embedding_length", low=1, high=_MAX_WIDTH)
    n_heads = meta.integer(f"{a}.attention.head_count", low=1, high=_MAX_HEADS)
    if isinstance(meta.get(f"{a}.attention.head_count_kv"), list):  # per-layer counts (some hybrids)
        raise _fail(path, "per-layer attention.head_count_kv is not supported")
    n_kv = meta.integer(f"{a}.attention.head_count_kv", n_heads, low=1, high=n_heads)
    n_layers = meta.integer(f"{a}.block_count", low=1, high=_MAX_LAYERS)
    # Each layer is 9 tensors: a block_count the tensor table cannot hold is refused before anything is
    # sized by it (a huge one once built a set of 9 x block_count names and ran out of memory).
    if n_layers * _TENSORS_PER_LAYER > len(tensors):
        raise _fail(
            path,
            f"metadata {a}.block_count {n_layers} needs {n_layers * _TENSORS_PER_LAYER} layer tensors, "
            f"but the file holds {len(tensors)} tensors",
        )
    head_dim = meta.integer(f"{a}.attention.key_length", None, low=1, high=_MAX_WIDTH)
    if head_dim is None:
        if hidden % n_heads:
            raise _fail(path, f"embedding_length {hidden} is not divisible by head_count {n_heads}")
        head_dim = hidden // n_heads
    rope_dim = meta.integer(f"{a}.rope.dimension_count", None, low=1, high=_MAX_WIDTH) or head_dim
    if rope_dim != head_dim:
        raise _fail(path, f"partial RoPE (rope.dimension_count {rope_dim} != head_dim {head_dim}) is unsupported")
    scaling = meta.text(f"{a}.rope.scaling.type")
    if "rope_freqs.weight" in tensors or scaling not in (None, "none"):
        raise _fail(path, f"RoPE scaling ({_shown(scaling) if scaling else 'rope_freqs tensor'}) is not supported yet")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise _fail(path, "tensor token_embd.weight is missing")
    # ggml order: dims[-1] is the row count
    vocab = meta.integer(f"{a}.vocab_size", None, low=1, high=_MAX_VOCAB) or embd.dims[-1]
    # Generation stops at EOS, and at end-of-turn/-message tokens where the file names distinct ones.
    eos = [meta.integer(f"tokenizer.ggml.{key}", None) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos_ids = list(dict.fromkeys(i for i in eos if i is not None))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "intermediate_size": meta.integer(f"{a}.feed_forward_length", low=1, high=_MAX_WIDTH * 8),
        "vocab_size": vocab,
        "rope_theta": meta.number(f"{a}.rope.freq_base", 10000.0),
        "rms_norm_eps": meta.number(f"{a}.attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": meta.integer(f"{a}.context_length", 2048, low=1, high=MAX_POSITIONS),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.integer("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": meta.integer("tokenizer.ggml.padding_token_id", None),
        "torch_dtype": "float32",
    }
    # The same rules config.json is read by (ranges, finiteness, divisibility), reported by the GGUF key.
    try:
        ModelConfig.from_hf_dict(config)
    except ConfigError as bad:
        key = _CONFIG_KEYS.get(bad.field or "")
        where = f"metadata {key.format(a=a)}" if key else "metadata"
        raise _fail(path, f"{where}: {bad}") from None
    # float32 in the file: written as its shortest repr, once the value is known to be in range
    config["rope_theta"], config["rms_norm_eps"] = _f32(config["rope_theta"]), _f32(config["rms_norm_eps"])
    return config


def _plan_tensors(tensors: dict[str, TensorInfo], config: dict[str, Any], path: Path) -> list[_Planned]:
    """Map every GGUF tensor to its HF name and shape; refuse unknown or missing ones."""
    n_layers = config["num_hidden_layers"]
    planned: list[_Planned] = []
    for name, tensor in tensors.items():
        unpermute: int | None = None
        if name in _GLOBAL_TENSORS:
            hf_name = _GLOBAL_TENSORS[name]
        elif (match := _LAYER_NAME.match(name)) and match.group(2) in _LAYER_TENSORS:
            layer, kind = int(match.group(1)), match.group(2)
            if layer >= n_layers:
                raise _fail(path, f"tensor {name} is beyond block_count {n_layers}")
            hf_name = f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.weight"
            if kind == "attn_q":
                unpermute = config["num_attention_heads"]
            elif kind == "attn_k":
                unpermute = config["num_key_value_heads"]
        else:
            raise _fail(path, f"unexpected tensor {name} for a Llama model")
        planned.append(_Planned(name, hf_name, tensor.shape, tensor.type_name, unpermute))  # numpy order: slowest-first
    have = {p.hf_name for p in planned}
    wanted = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{part}.weight" for i in range(n_layers) for part in _LAYER_TENSORS.values()
    }
    if missing := sorted(wanted - have):
        raise _fail(path, f"{len(missing)} tensor(s) missing, e.g. {missing[0]}")
    _check_shapes(planned, config, path)
    return sorted(planned, key=_hf_order)


def _hf_order(p: _Planned) -> tuple[int, str]:
    if p.hf_name == "model.embed_tokens.weight":
        return (-1, p.hf_name)
    match = re.match(r"model\.layers\.(\d+)\.", p.hf_name)
    return (int(match.group(1)), p.hf_name) if match else (1 << 30, p.hf_name)


def _check_shapes(planned: list[_Planned], c: dict[str, Any], path: Path) -> None:
    d, hd, inter, vocab = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["vocab_size"]
    q_rows, kv_rows = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    expect = {  # keyed by the module name just before ".weight"
        "embed_tokens": (vocab, d),
        "lm_head": (vocab, d),
        "q_proj": (q_rows, d),
        "k_proj": (kv_rows, d),
        "v_proj": (kv_rows, d),
        "o_proj": (d, q_rows),
        "gate_proj": (inter, d),
        "up_proj": (inter, d),
        "down_proj": (d, inter),
        "norm": (d,),
        "input_layernorm": (d,),
        "post_attention_layernorm": (d,),
    }
    for p in planned:
        want = expect[p.hf_name.split(".")[-2]]
        if p.hf_shape != want:
            raise _fail(path, f"tensor {p.gguf_name} has shape {p.hf_shape}, expected {want}")
        if p.type_name not in _WEIGHT_TYPES:
            raise _fail(path, f"tensor {p.gguf_name}: type {p.type_name} is not a weight type this importer reads")


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's q/k row permutation (per head: interleaved pairs -> two halves)."""
    rows = weight.shape[0]
    head_dim = rows // n_heads
    # GGUF row order within a head is (i, pair-member) for i < head_dim/2; HF wants (pair-member, i).
    return weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantized(gguf_file: GGUFFile, planned: _Planned) -> np.ndarray:
    """The tensor as float32 in HF layout; NaN or infinity (a damaged block scale) is refused here, at import,
    not found at the first token."""
    from gguf import GGMLQuantizationType, quants

    tensor = gguf_file.tensors[planned.gguf_name]
    path = gguf_file.path
    try:
        values = quants.dequantize(gguf_file.read(tensor), GGMLQuantizationType(tensor.ggml_type))
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(planned.hf_shape)
    except NotImplementedError:
        raise _fail(path, f"tensor {tensor.name}: type {tensor.type_name} is not supported") from None
    except ValueError as bad:
        raise _fail(path, f"tensor {tensor.name} is corrupt ({bad})") from None
    # max and min propagate NaN and show an infinity: two passes, no temporary the size of the tensor
    if not (np.isfinite(values.max()) and np.isfinite(values.min())):
        raise _fail(path, f"tensor {tensor.name} holds NaN or infinite values (damaged data); refused")
    if planned.unpermute_heads is not None:
        values = np.ascontiguousarray(unpermute_rope_rows(values, planned.unpermute_heads))
    return values


def _write_shards(
    gguf_file: GGUFFile,
    plan: list[_Planned],
    out: Path,
    progress: ProgressFn | None,
    shard_bytes: int,
) -> list[str]:
    from safetensors.numpy import save_file

    # Assign shards up front (sizes are known from shapes), so file names can carry the shard count.
    shards: list[list[_Planned]] = [[]]
    size = 0
    for p in plan:
        if shards[-1] and size + p.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    written = 0
    weight_map: dict[str, str] = {}
    for shard, name in zip(shards, names, strict=True):
        arrays = {}
        for p in shard:  # one shard in memory at a time
            arrays[p.hf_name] = _dequantized(gguf_file, p)
            weight_map[p.hf_name] = name
            written += 1
            if progress is not None:
                progress("tensors", written, len(plan))
        save_file(arrays, str(out / name), metadata={"format": "pt"})
        os.chmod(out / name, 0o644)  # safetensors creates 0600; the rest of the dir is world-readable
        del arrays
    index = {"metadata": {"total_size": sum(p.nbytes for p in plan)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [*names, "model.safetensors.index.json"]


def _hf_tokenizer(meta: _Metadata, path: Path) -> tuple[str, dict[str, Any]]:
    """Rebuild a `tokenizers` byte-level BPE from tokenizer.ggml.* metadata; also tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.text("tokenizer.ggml.model")
    if kind != "gpt2":
        raise _fail(path, f"tokenizer.ggml.model {_shown(kind)} is not supported (only byte-level BPE 'gpt2')")
    pre = meta.text("tokenizer.ggml.pre", "gpt2")  # files older than the key were GPT-2 style
    style = _PRE_TOKENIZERS.get(pre)
    if style is None:
        supported = ", ".join(_PRE_TOKENIZERS)
        raise _fail(path, f"tokenizer.ggml.pre {_shown(pre)} is unsupported (supported: {supported})")
    tokens = meta.strings("tokenizer.ggml.tokens")
    types = meta.integers("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges_raw = meta.strings("tokenizer.ggml.merges")
    if len(types) != len(tokens):
        raise _fail(path, f"token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise _fail(path, "tokenizer.ggml.tokens has duplicate entries")
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise _fail(path, f"tokenizer.ggml.merges: malformed merge {_shown(merge)}")
        merges.append((left, right))

    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=style in _IGNORE_MERGES)
    tok = Tokenizer(bpe)
    if style == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    # Control tokens are matched whole and are special (skippable on decode); user-defined ones are
    # matched whole but are ordinary text.
    typed = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED])

    def token(key: str) -> str | None:
        index = meta.integer(f"tokenizer.ggml.{key}", None)
        if index is None:
            return None
        if not 0 <= index < len(tokens):
            raise _fail(path, f"tokenizer.ggml.{key} {index} is outside the vocabulary")
        return tokens[index]

    bos = token("bos_token_id")
    add_bos = meta.boolean("tokenizer.ggml.add_bos_token", False)
    if add_bos and bos is not None:
        bos_id = vocab[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": meta.boolean("tokenizer.ggml.add_eos_token", False),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.integer(
            f"{meta.get('general.architecture')}.context_length", 2048, low=1, high=MAX_POSITIONS
        ),
    }
    template = meta.text("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tok.to_str(pretty=False), config
