"""Bounded shard reading and the atomic checkpoint writer, on a tiny sharded transformers Llama."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from llmplan.llm.formats import checkpoint_writer, read_shards, write_checkpoint
from llmplan.llm.formats.shard_reader import MissingTensorsError
from llmplan.llm.trust import MANIFEST_NAME, IntegrityError, build_manifest, read_sha256sums, verify


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """(directory of a 14-shard random Llama saved by transformers, its state dict)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("llama") / "model"
    model.save_pretrained(out, max_shard_size="20KB")
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return out, state


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_reads_exactly_the_transformers_state_dict(llama) -> None:
    model_dir, state = llama
    manifest = build_manifest(model_dir)
    seen: list[int] = []
    result = read_shards(manifest, progress=seen.append)
    assert_same(result.tensors, state)
    assert result.skipped == []
    assert [s.name for s in result.shards] == [s.name for s in manifest.shards]
    assert sum(seen) == result.total_bytes == sum(t.nbytes for t in state.values())


@pytest.mark.parametrize("buffer_shards", [1, 2])
def test_buffer_bounds_peak_memory(llama, buffer_shards: int) -> None:
    model_dir, state = llama
    manifest = build_manifest(model_dir)
    largest = max(s.path.stat().st_size for s in manifest.shards)
    total = sum(s.path.stat().st_size for s in manifest.shards)
    converted: dict[str, torch.Tensor] = {}

    def to_half(name: str, tensor: torch.Tensor) -> None:  # the fp32 copy is dropped on return
        converted[name] = tensor.to(torch.float16)

    result = read_shards(manifest, buffer_shards=buffer_shards, on_tensor=to_half)
    assert result.tensors == {}
    assert converted.keys() == state.keys()
    assert 1 <= result.peak_buffer_shards <= buffer_shards
    assert result.peak_buffer_bytes <= buffer_shards * largest < total


def test_unwanted_tensors_are_skipped_and_listed(llama) -> None:
    model_dir, state = llama
    manifest = build_manifest(model_dir)
    wanted = {name for name in state if name.startswith("model.layers.0.")}
    result = read_shards(manifest, wanted=wanted, buffer_shards=2)
    assert_same(result.tensors, {name: state[name] for name in wanted})
    assert sorted(result.skipped) == sorted(state.keys() - wanted)
    assert len(result.shards) < len(manifest.shards)  # shards with nothing wanted are never opened


def test_missing_wanted_tensor(llama) -> None:
    model_dir, _ = llama
    with pytest.raises(MissingTensorsError) as err:
        read_shards(build_manifest(model_dir), wanted={"model.norm.weight", "nope.b", "nope.a"})
    assert str(err.value) == f"{model_dir}: 2 wanted tensor(s) not in the checkpoint: nope.a, nope.b"
    assert err.value.missing == ["nope.a", "nope.b"]


def test_on_tensor_error_stops_the_reader(llama) -> None:
    model_dir, _ = llama

    def boom(name: str, tensor: torch.Tensor) -> None:
        raise RuntimeError(f"cannot convert {name}")

    with pytest.raises(RuntimeError, match="cannot convert"):
        read_shards(build_manifest(model_dir), buffer_shards=2, on_tensor=boom)


def test_torch_bin_is_read_with_weights_only(llama, tmp_path: Path) -> None:
    _, state = llama
    torch.save(state, tmp_path / "pytorch_model.bin")
    manifest = build_manifest(tmp_path)
    assert manifest.format == "torch" and manifest.tensor_to_shard == {}
    wanted = {"model.norm.weight", "lm_head.weight"}
    result = read_shards(manifest, wanted=wanted)
    assert_same(result.tensors, {name: state[name] for name in wanted})
    assert sorted(result.skipped) == sorted(state.keys() - wanted)
    with pytest.raises(MissingTensorsError, match=r"1 wanted tensor\(s\) not in the checkpoint: nope$"):
        read_shards(manifest, wanted={"nope"})  # no index: found out after reading


class Payload:
    """Unpickling this would run code; weights_only must refuse it before it does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def test_malicious_pickle_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(3), "evil": Payload(marker)}, path)
    manifest = build_manifest(tmp_path)
    verify(manifest, "off")
    with pytest.raises(IntegrityError) as err:
        read_shards(manifest)
    assert re.fullmatch(
        rf"{re.escape(str(path))}: refused to unpickle: Unsupported global: GLOBAL .*exec.* "
        r"\(only tensors are allowed; convert it to safetensors\)",
        str(err.value),
    ), str(err.value)
    assert "\n" not in str(err.value)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- writer


def test_writer_round_trip(llama, tmp_path: Path) -> None:
    _, state = llama
    tensors = dict(state)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied: shares storage
    tensors["scales"] = torch.rand(8, dtype=torch.bfloat16)
    tensors["q"] = torch.randint(-128, 127, (4, 6), dtype=torch.int8).t()  # not contiguous
    out = write_checkpoint(
        tensors,
        tmp_path / "quantized",
        max_shard_bytes=100_000,
        metadata={"quantization": "int8"},
        extra_files={"config.json": '{"model_type": "llama"}', "tokenizer.model": b"\x00\x01"},
    )
    assert out == tmp_path / "quantized"
    manifest = build_manifest(out)
    assert len(manifest.shards) > 1
    assert {s.hash_source for s in manifest.shards} == {"SHA256SUMS"}
    verify(manifest, "required")
    assert_same(read_shards(manifest).tensors, tensors)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"quantization": "int8", "total_size": sum(t.nbytes for t in tensors.values())}
    with safe_open(str(manifest.shards[0].path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "quantization": "int8"}
    assert set(read_sha256sums(out / MANIFEST_NAME)) == {
        *(s.name for s in manifest.shards),
        "model.safetensors.index.json",
        "config.json",
        "tokenizer.model",
    }
    assert (out / "tokenizer.model").read_bytes() == b"\x00\x01"
    # no temp dir left beside it; the marker that lets a later save replace it (llmplan/ownership.py, #33)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".quantized.llmplan", "quantized"]


def test_writer_is_atomic(llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, state = llama
    real = checkpoint_writer.save_file
    calls = []

    def fail_on_second_shard(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_writer, "save_file", fail_on_second_shard)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(state, out, max_shard_bytes=50_000)
    assert os.path.exists(calls[0]) is False  # the first shard was written, then cleaned up
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_existing_dir_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_checkpoint({"a": torch.ones(3)}, out)
    with pytest.raises(FileExistsError):
        write_checkpoint({"b": torch.ones(3)}, out)
    write_checkpoint({"b": torch.zeros(2)}, out, overwrite=True)
    assert_same(read_shards(build_manifest(out)).tensors, {"b": torch.zeros(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.llmplan", "out"]  # its marker: llmplan's (#33)
    shutil.rmtree(out)


def test_sharded_torch_bins_with_index(llama, tmp_path: Path) -> None:
    _, state = llama
    names = list(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[:10], "pytorch_model-00002-of-00002.bin": names[10:]}
    weight_map = {}
    for file, group in halves.items():
        torch.save({name: state[name] for name in group}, tmp_path / file)
        weight_map.update(dict.fromkeys(group, file))
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    manifest = build_manifest(tmp_path)
    assert manifest.format == "torch" and [s.name for s in manifest.shards] == sorted(halves)
    verify(manifest, "if_present")
    result = read_shards(manifest, wanted={names[-1]})
    assert_same(result.tensors, {names[-1]: state[names[-1]]})
    assert [s.name for s in result.shards] == ["pytorch_model-00002-of-00002.bin"]
