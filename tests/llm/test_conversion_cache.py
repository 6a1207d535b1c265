"""The conversion cache's entries (llm/formats/conversion_cache): written once, mapped whole, refused when damaged,
foreign or another version's, with one line naming the entry."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from llmplan.llm.formats.conversion_cache import (
    ConversionKey,
    EntryProblem,
    find_entry,
    flatten,
    list_entries,
    open_entry,
    unflatten,
    write_entry,
)
from llmplan.llm.formats.conversion_cache.listing import MARKER
from llmplan.llm.model.weight_formats import Int4Weight, Int8Weight, quantize_weight


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMPLAN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _key(dtype: str = "int8") -> ConversionKey:
    return ConversionKey((("model.safetensors", "ab" * 32),), "cd" * 32, {"dtype": dtype, "group_size": 32})


def _weights() -> dict[str, object]:
    torch.manual_seed(0)
    embed = torch.randn(96, 64)
    return {
        "tok_embeddings.weight": embed,
        "layers.0.attention.wqkv.weight": quantize_weight(torch.randn(48, 64), "int8"),
        "layers.0.feed_forward.w2.weight": quantize_weight(torch.randn(64, 32), "int4", 32),
        "norm.weight": torch.ones(64),
        "output.weight": embed,  # tied: the embedding table itself
    }


def _written(root: Path, key: ConversionKey | None = None) -> tuple[Path, dict[str, object]]:
    weights = _weights()
    flat, aliases = flatten(weights)
    path = write_entry(root, key or _key(), "tiny-int8", flat, {"aliases": aliases, "dtype": "int8", "model": "tiny"})
    return path, weights


def test_an_entry_maps_back_the_very_weights_it_was_written_from(tmp_path: Path, cache_home: Path) -> None:
    root = tmp_path / "conversions"
    path, weights = _written(root)
    assert find_entry(root, _key()) == path
    assert find_entry(root, _key("int4")) is None  # another setting: another key, no entry
    entry = open_entry(path, _key())
    back = unflatten(entry.tensors, entry.marker["aliases"], list(weights))
    for name, weight in weights.items():
        if isinstance(weight, Int8Weight):
            assert torch.equal(back[name].qweight, weight.qweight) and torch.equal(back[name].scale, weight.scale)
        elif isinstance(weight, Int4Weight):
            assert torch.equal(back[name].packed, weight.packed) and torch.equal(back[name].zero, weight.zero)
        else:
            assert torch.equal(back[name], weight)
    assert back["output.weight"] is back["tok_embeddings.weight"]  # the tie kept: stored and mapped once
    assert entry.nbytes == sum(t.nbytes for t in flatten(weights)[0].values())
    assert [e.name for e in list_entries(root)] == [path.name]


def test_the_mapped_tensors_are_the_entry_files_pages_not_copies(tmp_path: Path, cache_home: Path) -> None:
    path, _ = _written(tmp_path / "conversions")
    entry = open_entry(path, _key())
    ranges = _file_mappings(sorted(path.glob("model-*.safetensors")))
    assert ranges, "no mapping of the entry's shard in /proc/self/smaps"
    for name, tensor in entry.tensors.items():
        start = tensor.data_ptr()
        assert any(lo <= start and start + tensor.nbytes <= hi for lo, hi in ranges), name


def _file_mappings(files: list[Path]) -> list[tuple[int, int]]:
    wanted = {str(f.resolve()) for f in files}
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] in wanted:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            found.append((lo, hi))
    return found


def test_a_flipped_byte_is_refused_naming_the_shard(tmp_path: Path, cache_home: Path) -> None:
    path, _ = _written(tmp_path / "conversions")
    open_entry(path, _key())  # once, so its hashes are cached by file identity
    shard = next(path.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    stat = shard.stat()
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the date set back: the ctime still moves
    with pytest.raises(EntryProblem, match=shard.name):
        open_entry(path, _key())


def test_a_truncated_shard_is_refused(tmp_path: Path, cache_home: Path) -> None:
    path, _ = _written(tmp_path / "conversions")
    shard = next(path.glob("model-*.safetensors"))
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size - 64)
    with pytest.raises(EntryProblem, match=shard.name):
        open_entry(path, _key())


def test_another_versions_entry_is_refused(tmp_path: Path, cache_home: Path) -> None:
    path, _ = _written(tmp_path / "conversions")
    marker = json.loads((path / MARKER).read_text())
    marker["format"] = "llmplan.conversion/v0"
    (path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(EntryProblem, match="another version"):
        open_entry(path, _key())


def test_an_entry_for_another_key_is_refused(tmp_path: Path, cache_home: Path) -> None:
    path, _ = _written(tmp_path / "conversions")
    with pytest.raises(EntryProblem, match="another conversion"):
        open_entry(path, _key("int4"))


def test_another_users_entry_is_refused(tmp_path: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = _written(tmp_path / "conversions")
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)
    with pytest.raises(EntryProblem, match="another user"):
        open_entry(path, _key())


def test_an_entry_others_may_write_is_refused(tmp_path: Path, cache_home: Path) -> None:
    path, _ = _written(tmp_path / "conversions")
    path.chmod(0o777)
    with pytest.raises(EntryProblem, match="others may write"):
        open_entry(path, _key())


def test_a_link_in_an_entrys_place_is_refused(tmp_path: Path, cache_home: Path) -> None:
    path, _ = _written(tmp_path / "elsewhere")
    root = tmp_path / "conversions"
    root.mkdir()
    (root / path.name).symlink_to(path)
    with pytest.raises(EntryProblem, match="not a folder"):
        open_entry(root / path.name, _key())


def test_a_cache_that_cannot_be_written_raises_oserror_and_leaves_nothing(tmp_path: Path, cache_home: Path) -> None:
    root = tmp_path / "conversions"
    root.write_text("a file where the cache's folder should be")
    with pytest.raises(OSError):
        _written(root)
    assert root.read_text().startswith("a file")


def _with_in_place(tmp_path: Path, ref: dict[str, object]) -> tuple[Path, ConversionKey, Path]:
    """An entry that maps `output.weight` from a source shard of its key, as `ref` records it."""
    from safetensors.torch import save_file

    source = tmp_path / "source"
    source.mkdir()
    head = torch.randn(8, 4).to(torch.bfloat16)
    save_file({"lm_head.weight": head}, source / "model.safetensors")
    key = ConversionKey((("model.safetensors", "ef" * 32),), "cd" * 32, {"dtype": "bf16"})
    flat = {"norm.weight": torch.ones(4)}
    path = write_entry(tmp_path / "conversions", key, "tiny-bf16", flat, {"in_place": {"output.weight": ref}})
    return path, key, source


def test_an_in_place_tensor_is_the_source_shards_own_view(tmp_path: Path, cache_home: Path) -> None:
    ref = {"shard": "model.safetensors", "tensor": "lm_head.weight", "dtype": "torch.bfloat16", "shape": [8, 4]}
    path, key, source = _with_in_place(tmp_path, ref)
    entry = open_entry(path, key, source)
    assert entry.in_place_bytes == 64 and entry.nbytes == 16
    assert [f.path for f in entry.sources] == [source / "model.safetensors"]
    assert entry.tensors["output.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"shard": "../elsewhere.safetensors"}, "not one of its sources"),
        ({"tensor": "model.embed_tokens.weight"}, "not in model.safetensors as recorded"),
        ({"shape": [4, 8]}, "not in model.safetensors as recorded"),
        ({"dtype": "torch.float32"}, "not in model.safetensors as recorded"),
    ],
)
def test_an_in_place_reference_that_does_not_hold_is_refused(
    tmp_path: Path, cache_home: Path, change: dict[str, object], said: str
) -> None:
    ref = {"shard": "model.safetensors", "tensor": "lm_head.weight", "dtype": "torch.bfloat16", "shape": [8, 4]}
    path, key, source = _with_in_place(tmp_path, ref | change)
    with pytest.raises(EntryProblem, match=said):
        open_entry(path, key, source)


def test_a_file_in_an_entrys_place_is_never_discarded(tmp_path: Path, cache_home: Path) -> None:
    from llmplan.llm.formats.conversion_cache import discard_entry

    root = tmp_path / "conversions"
    root.mkdir()
    theirs = root / "0123456789abcdef-not-an-entry"
    theirs.write_text("a file of someone's")
    assert discard_entry(theirs) is False and theirs.read_text() == "a file of someone's"
    path, _ = _written(root)
    assert discard_entry(path) is True and not path.exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".discarded-")]  # moved aside, then deleted
