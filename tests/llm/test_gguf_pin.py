"""The import of a GGUF for a plan that keeps its blocks (#54), and the shards a converting plan adds to it later.

An import without shards holds config, tokenizer and the pin (llm/formats/gguf/pin.py); adding the shards must
never leave the folder half-written: a failure midway keeps the import exactly as a stored plan reads it, and the
next converting start adds them whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import llmplan.llm.formats.gguf.importer as importer
from llmplan.llm.formats.gguf import PIN_NAME, has_shards, import_gguf_as, read_pin
from llmplan.llm.formats.gguf.importer import GGUFImportError
from llmplan.llm.trust import build_manifest, verify
from llmplan.stages.model_source import READ_BY_LOAD
from tests.llm.tiny_gguf import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_model(str(path), arch="llama")
    return path


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_an_import_that_keeps_blocks_has_no_shards_and_pins_the_file(tiny: Path, tmp_path: Path) -> None:
    done = import_gguf_as(tiny, tmp_path, weights=False)
    assert done.created and not done.shards_added and done.written_bytes < 100_000
    assert _names(done.model_dir) == ["SHA256SUMS", "config.json", PIN_NAME, "tokenizer.json", "tokenizer_config.json"]
    assert not has_shards(done.model_dir)
    pin = read_pin(done.model_dir)
    assert pin is not None and pin.sha256 == done.digest and pin.size == tiny.stat().st_size and pin.blocks_checked
    manifest = build_manifest(done.model_dir, None, READ_BY_LOAD, weights=False)
    assert manifest.shards == [] and {i.name for i in manifest.listed} >= {"config.json", PIN_NAME}
    verify(manifest, "required")
    again = import_gguf_as(tiny, tmp_path, weights=False)
    assert (again.model_dir, again.created, again.written_bytes) == (done.model_dir, False, 0)


def test_a_converting_import_adds_its_shards_to_the_same_folder(tiny: Path, tmp_path: Path) -> None:
    first = import_gguf_as(tiny, tmp_path, weights=False)
    later = import_gguf_as(tiny, tmp_path, shard_bytes=200_000)
    assert later.model_dir == first.model_dir and not later.created and later.shards_added
    assert has_shards(later.model_dir) and len(list(later.model_dir.glob("*.safetensors"))) > 1
    verify(build_manifest(later.model_dir, None, READ_BY_LOAD), "required")  # every shard listed and hashed
    verify(build_manifest(later.model_dir, None, READ_BY_LOAD, weights=False), "required")
    assert [p.name for p in tmp_path.iterdir() if ".importing-" in p.name] == []
    assert import_gguf_as(tiny, tmp_path).written_bytes == 0  # a third start writes nothing


def test_adding_shards_that_fails_midway_leaves_the_import_as_it_was(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = import_gguf_as(tiny, tmp_path, weights=False)
    sums = (first.model_dir / "SHA256SUMS").read_bytes()
    real, calls = importer.os.replace, []

    def fails_on_the_second_move(src: object, dst: object) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(importer.os, "replace", fails_on_the_second_move)
    with pytest.raises(GGUFImportError, match=r"No space left on device.*nothing was kept"):
        import_gguf_as(tiny, tmp_path, shard_bytes=200_000)
    monkeypatch.setattr(importer.os, "replace", real)
    assert (first.model_dir / "SHA256SUMS").read_bytes() == sums and not has_shards(first.model_dir)
    assert [p.name for p in tmp_path.iterdir() if ".importing-" in p.name] == []
    verify(build_manifest(first.model_dir, None, READ_BY_LOAD, weights=False), "required")  # stored still reads it
    later = import_gguf_as(tiny, tmp_path, shard_bytes=200_000)  # the next converting start completes it
    assert later.shards_added and has_shards(later.model_dir)
    verify(build_manifest(later.model_dir, None, READ_BY_LOAD), "required")


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_the_predicted_copies_are_the_rows_the_load_copies(tmp_path: Path, arch: str, tied: bool) -> None:
    """`validate --deep` counts the rows copied out of the mapping from the header; the load's own copies agree."""
    from llmplan.llm.formats.gguf import copied_bytes, map_gguf, stored_weights
    from llmplan.llm.model.weight_formats import GGUFWeight

    path = tmp_path / f"{arch}.gguf"
    write_tiny_model(str(path), arch=arch, tied=tied, embed="Q8_0")
    with map_gguf(path) as mapped:
        base = next(iter(mapped.tensors.values())).blocks.untyped_storage().data_ptr()
        _, weights = stored_weights(mapped)
        seen: dict[int, int] = {}
        for weight in weights.values():
            for part in getattr(weight, "parts", (weight,)):
                if isinstance(part, GGUFWeight) and part.blocks.untyped_storage().data_ptr() != base:
                    seen[id(part)] = part.nbytes
        assert copied_bytes(mapped.file) == sum(seen.values()) > 0
