"""Corpus: damaged checkpoints, each refused with one line naming the damaged file, exit 1, no traceback.

Every case copies the tiny checkpoint (tests/trust/checkpoints.py), damages one thing, and runs the
whole plan through the command line in-process. A damage that goes unnoticed reaches generation and
exits 0, which fails the test; so does an exception class name or a traceback on stderr.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmplan.engine.cli import main
from llmplan.llm.trust.manifest import write_sha256sums

from .checkpoints import LISTED, make_checkpoint, plan_for

INDEX = "model.safetensors.index.json"
EXCEPTION_NAME = re.compile(r"\b[A-Z]\w*(Error|Exception|Interrupt)\b|Traceback")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A FIFO in a file's place used to block forever: fail the case instead of the whole suite."""

    def expire(signum: int, frame: object) -> None:
        raise AssertionError("the run hung (over 120 s)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def shard_of(model_dir: Path, tensor: str) -> str:
    return json.loads((model_dir / INDEX).read_text())["weight_map"][tensor]


def shards(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.glob("*.safetensors"))


# --- damage helpers: each returns the file name the error must mention ---------------------------------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _header(path: Path) -> tuple[int, dict]:  # type: ignore[type-arg]
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return length, json.loads(raw[8 : 8 + length])


def _rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:  # type: ignore[type-arg]
    """Edit the JSON header in place, padded to the same length so data offsets stay valid."""
    raw = path.read_bytes()
    length, header = _header(path)
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length, "edited header grew"
    path.write_bytes(raw[:8] + text.ljust(length, b" ") + raw[8 + length :])


def _resum(model_dir: Path) -> None:
    """Recompute SHA256SUMS so that the damage is consistent (hashes alone cannot catch it)."""
    names = [p.name for p in model_dir.glob("*.safetensors")] + [n for n in LISTED if (model_dir / n).is_file()]
    write_sha256sums(model_dir, names)


def _edit_json(path: Path, change: Callable[[dict], None]) -> None:  # type: ignore[type-arg]
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _replace_with_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _replace_with_loop(path: Path) -> None:
    path.unlink()
    loop = path.with_name(path.name + ".loop")
    path.symlink_to(loop.name)
    loop.symlink_to(path.name)


def _replace_with_dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@dataclass
class Case:
    id: str
    damage: Callable[[Path], str]
    hashes: str = "required"


def shard_case(id: str, pick: str, act: Callable[[Path], None], hashes: str = "required") -> Case:
    def damage(model_dir: Path) -> str:
        names = shards(model_dir)
        name = {"first": names[0], "last": names[-1], "middle": names[len(names) // 2]}[pick]
        act(model_dir / name)
        return name

    return Case(f"shard-{pick}-{id}-{hashes}", damage, hashes)


def file_case(
    id: str, name: str, act: Callable[[Path], None], hashes: str = "required", expect: str | None = None
) -> Case:
    def damage(model_dir: Path) -> str:
        act(model_dir / name)
        return expect or name

    return Case(f"{name}-{id}-{hashes}", damage, hashes)


def config_case(id: str, change: Callable[[dict], None], expect: str) -> Case:  # type: ignore[type-arg]
    """A config.json value changed (SHA256SUMS recomputed): the config or layout check must catch it."""

    def damage(model_dir: Path) -> str:
        _edit_json(model_dir / "config.json", change)
        _resum(model_dir)
        return expect

    return Case(f"config-{id}", damage, "off")


def header_case(id: str, tensor: str, edit: Callable[[dict], None], hashes: str) -> Case:  # type: ignore[type-arg]
    def damage(model_dir: Path) -> str:
        name = shard_of(model_dir, tensor)
        _rewrite_header(model_dir / name, lambda h: edit(h[tensor]))
        if hashes == "required":
            _resum(model_dir)  # consistent hashes: only the layout check can refuse it
        return f"{name}: tensor {tensor!r}"

    return Case(f"header-{id}-{hashes}", damage, hashes)


def _set(key: str, value: object) -> Callable[[dict], None]:  # type: ignore[type-arg]
    return lambda data: data.__setitem__(key, value)


def _truncate(keep: int | None = None, cut: int = 1) -> Callable[[Path], None]:
    def act(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[:keep] if keep is not None else data[:-cut])

    return act


def _append(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0" * 16)


def _huge_header_length(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))


def _garbage_header(path: Path) -> None:
    _flip(path, 9)


SHARD_ACTS: list[tuple[str, Callable[[Path], None], tuple[str, ...]]] = [
    ("truncated-1", _truncate(cut=1), ("required", "if_present", "off")),
    ("truncated-4", _truncate(keep=4), ("required", "off")),
    ("truncated-0", _truncate(keep=0), ("required", "off")),
    ("flipped-last-byte", lambda p: _flip(p, -1), ("required", "if_present")),
    ("header-not-json", _garbage_header, ("required", "off")),
    ("header-length-huge", _huge_header_length, ("required", "off")),
    ("trailing-bytes", _append, ("required", "if_present")),
    ("deleted", lambda p: p.unlink(), ("required", "off")),
    ("directory", _replace_with_dir, ("required", "off")),
    ("symlink-loop", _replace_with_loop, ("required", "off")),
    ("fifo", _replace_with_fifo, ("required", "off")),
    ("dev-zero", _replace_with_dev_zero, ("required", "off")),
]

CASES: list[Case] = []
for _id, _act, _policies in SHARD_ACTS:
    for _policy in _policies:
        CASES.append(shard_case(_id, "first", _act, _policy))
    CASES.append(shard_case(_id, "last", _act))

Q = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"
for _hashes in ("required", "off"):
    CASES += [
        header_case("dtype-I32", Q, _set("dtype", "I32"), _hashes),
        header_case("dtype-U8-norm", NORM, lambda e: e.update(dtype="U8", shape=[e["shape"][0] * 4]), _hashes),
        header_case(
            "shape-transposed",
            "model.layers.0.mlp.down_proj.weight",
            lambda e: e.update(shape=e["shape"][::-1]),
            _hashes,
        ),
        header_case("shape-reshaped", Q, lambda e: e.update(shape=[e["shape"][0] // 2, e["shape"][1] * 2]), _hashes),
    ]

CASES += [
    config_case(
        "layers-string",
        _set("num_hidden_layers", "abc"),
        "config.json: num_hidden_layers: expected an integer, got 'abc'",
    ),
    config_case("layers-float", _set("num_hidden_layers", 3.5), "num_hidden_layers: expected an integer, got 3.5"),
    config_case("layers-bool", _set("num_hidden_layers", True), "num_hidden_layers: expected an integer, got True"),
    config_case("layers-1e9", _set("num_hidden_layers", 10**9), "config.json: describes"),
    config_case("vocab-1e12", _set("vocab_size", 10**12), "config.json: describes"),
    config_case(
        "layers-one-fewer", _set("num_hidden_layers", 2), "belongs to layer 2, but config.json has num_hidden_layers 2"
    ),
    config_case("layers-one-more", _set("num_hidden_layers", 4), "model.layers.3"),
    config_case("hidden-string", _set("hidden_size", "64"), "hidden_size: expected an integer, got '64'"),
    config_case("vocab-null", _set("vocab_size", None), "vocab_size: expected an integer, got None"),
    config_case("vocab-wrong", _set("vocab_size", 500), "shape [412, 64], expected [500, 64]"),
    config_case("intermediate-wrong", _set("intermediate_size", 100), "expected [100, 64]"),
    config_case("heads-zero", _set("num_attention_heads", 0), "num_attention_heads must be > 0"),
    config_case("kv-heads-3", _set("num_key_value_heads", 3), "must be divisible by num_key_value_heads (3)"),
    config_case("head-dim-odd", _set("head_dim", 15), "head_dim must be even"),
    config_case("head-dim-string", _set("head_dim", "16"), "head_dim: expected an integer"),
    config_case("rope-theta-string", _set("rope_theta", "big"), "rope_theta: expected a number, got 'big'"),
    config_case("eps-list", _set("rms_norm_eps", [1]), "rms_norm_eps: expected a number"),
    config_case("tie-string", _set("tie_word_embeddings", "yes"), "tie_word_embeddings: expected true or false"),
    config_case("model-type", _set("model_type", "gpt2"), "model_type: unsupported 'gpt2'"),
    # A field no architecture description covers, or one whose value changes the arithmetic: refused, named.
    config_case("unknown-field", _set("num_experts", 8), "config.json: 'num_experts': not a field of a llama config"),
    config_case(
        "attention-bias", _set("attention_bias", True), "config.json: attention_bias: True is not supported for llama"
    ),
    config_case("hidden-act", _set("hidden_act", "gelu"), "config.json: hidden_act: unsupported 'gelu' for llama"),
    config_case("rope-yarn", _set("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), "unsupported 'yarn'"),
    config_case("missing-vocab", lambda d: d.pop("vocab_size"), "vocab_size: required field is missing"),
    config_case("eos-string", _set("eos_token_id", "two"), "eos_token_id: expected an integer"),
    config_case("rope-scaling-list", _set("rope_scaling", [1, 2]), "rope_scaling: expected an object"),
    config_case("max-pos-float", _set("max_position_embeddings", 1e3), "max_position_embeddings: expected an integer"),
    file_case("deleted", "config.json", lambda p: p.unlink(), "off"),
    file_case("directory", "config.json", _replace_with_dir, "off"),
    file_case("not-json", "config.json", lambda p: p.write_text("{"), "off"),
    file_case("a-list", "config.json", lambda p: p.write_text("[1]"), "off"),
    file_case("deep-json", "config.json", lambda p: p.write_text("[" * 100000 + "]" * 100000), "off"),
    file_case("symlink-loop", "config.json", _replace_with_loop, "off"),
    file_case("fifo", "config.json", _replace_with_fifo, "off"),
    file_case("edited", "config.json", lambda p: _edit_json(p, _set("rms_norm_eps", 1e-3))),
    file_case(
        "swapped-ids", "tokenizer.json", lambda p: p.write_text(p.read_text().replace('"Hello"', '"Hellp"', 1) + " ")
    ),
    file_case("deleted", "tokenizer_config.json", lambda p: p.unlink()),
    file_case("edited", "tokenizer_config.json", lambda p: _edit_json(p, _set("chat_template", "{{ messages }}"))),
    file_case("deleted", "tokenizer.json", lambda p: p.unlink()),
    file_case("bad-line", "SHA256SUMS", lambda p: p.write_text(p.read_text() + "not a line\n"), expect="SHA256SUMS:19"),
    file_case(
        "short-hash", "SHA256SUMS", lambda p: p.write_text("abc  config.json\n" + p.read_text()), expect="SHA256SUMS:1"
    ),
    file_case("directory", "SHA256SUMS", _replace_with_dir),
    file_case("fifo", "SHA256SUMS", _replace_with_fifo),
    file_case("symlink-loop", "SHA256SUMS", _replace_with_loop),
    file_case("not-utf8", "SHA256SUMS", lambda p: p.write_bytes(b"\xff\xfe" + p.read_bytes())),
    file_case(
        "outside",
        "SHA256SUMS",
        lambda p: p.write_text(p.read_text() + "0" * 64 + "  ../outside.txt\n"),
        expect="../outside.txt",
    ),
    file_case(
        "absolute",
        "SHA256SUMS",
        lambda p: p.write_text(p.read_text() + "0" * 64 + "  /etc/passwd\n"),
        expect="/etc/passwd",
    ),
    file_case(
        "listed-missing",
        "SHA256SUMS",
        lambda p: p.write_text(p.read_text() + "0" * 64 + "  extra.bin\n"),
        expect="extra.bin",
    ),
    file_case(
        "conflicting-lines",
        "SHA256SUMS",
        lambda p: p.write_text(p.read_text() + "0" * 64 + "  config.json\n"),
        expect="config.json",
    ),
    file_case("empty", "SHA256SUMS", lambda p: p.write_text(""), expect="no known SHA-256"),
    file_case("not-json", INDEX, lambda p: p.write_text("{"), "off"),
    file_case("directory", INDEX, _replace_with_dir, "off"),
    file_case("fifo", INDEX, _replace_with_fifo, "off"),
    file_case("symlink-loop", INDEX, _replace_with_loop, "off"),
    file_case("no-weight-map", INDEX, lambda p: p.write_text("{}"), "off"),
    file_case(
        "outside",
        INDEX,
        lambda p: _edit_json(p, lambda d: d["weight_map"].__setitem__(NORM, "../x.safetensors")),
        "off",
    ),
    file_case(
        "absolute",
        INDEX,
        lambda p: _edit_json(p, lambda d: d["weight_map"].__setitem__(NORM, "/tmp/x.safetensors")),
        "off",
    ),
    file_case("not-a-string", INDEX, lambda p: _edit_json(p, lambda d: d["weight_map"].__setitem__(NORM, 7)), "off"),
    file_case(
        "missing-shard",
        INDEX,
        lambda p: _edit_json(p, lambda d: d["weight_map"].__setitem__(NORM, "gone.safetensors")),
        "off",
        expect="gone.safetensors",
    ),
    file_case(
        "wrong-shard",
        INDEX,
        lambda p: _edit_json(p, lambda d: d["weight_map"].__setitem__(NORM, "model-00001-of-00014.safetensors")),
        "if_present",
        expect="model-00001-of-00014.safetensors",
    ),
    file_case("edited", INDEX, lambda p: p.write_text(p.read_text() + " ")),
]


def test_the_corpus_is_big_enough() -> None:
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_damaged_checkpoint_is_refused_naming_the_file(
    case: Case, pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = Path(shutil.copytree(pristine, tmp_path / "model", symlinks=True))
    named = case.damage(model_dir)
    plan = plan_for(tmp_path, model_dir, hashes=case.hashes)
    code = main(["run", str(plan), "--out", str(tmp_path / "run"), "--quiet"])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 1, f"accepted: {captured.err}"
    assert len(lines) == 1, lines
    assert named in lines[0], lines[0]
    assert not EXCEPTION_NAME.search(lines[0]), lines[0]
    assert captured.out == ""
    assert not (tmp_path / "run" / "generations.json").exists()
