"""Verified hashes are remembered by file identity and recomputed as soon as a file changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmplan.llm.trust import HashCache, IntegrityError, build_manifest, verify
from llmplan.llm.trust.hash_cache import CACHE_NAME
from llmplan.llm.trust.manifest import write_sha256sums


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    save_file({"a": torch.arange(1000, dtype=torch.float32)}, str(tmp_path / "model.safetensors"))
    write_sha256sums(tmp_path, ["model.safetensors"])
    return tmp_path


def test_second_verify_uses_the_cache(model_dir: Path) -> None:
    first = verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))
    assert first.bytes_hashed > 0 and first.cached == []
    second = verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))
    assert second.bytes_hashed == 0 and second.cached == ["model.safetensors"]


def test_a_changed_file_is_hashed_again_and_caught(model_dir: Path) -> None:
    verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))
    shard = model_dir / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size, new mtime
    with pytest.raises(IntegrityError, match="SHA-256 mismatch"):
        verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))


def test_a_replaced_file_with_the_old_mtime_is_hashed_again(model_dir: Path) -> None:
    verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))
    shard = model_dir / "model.safetensors"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    replacement = model_dir / "new"
    replacement.write_bytes(bytes(data))
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(replacement, shard)  # a new inode: the identity differs even with size and mtime restored
    with pytest.raises(IntegrityError, match="SHA-256 mismatch"):
        verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))


def test_a_damaged_cache_file_is_ignored(model_dir: Path) -> None:
    (model_dir / CACHE_NAME).write_text("{not json", encoding="utf-8")
    report = verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))
    assert report.bytes_hashed > 0
    assert HashCache(model_dir).get(model_dir / "model.safetensors") is not None


def test_an_unwritable_cache_file_just_means_no_cache(model_dir: Path) -> None:
    (model_dir / CACHE_NAME).mkdir()  # the name is taken by something that is not ours: left alone
    cache = HashCache(model_dir)
    report = verify(build_manifest(model_dir), "required", hash_cache=cache)
    assert report.bytes_hashed > 0  # verified all the same
    assert (model_dir / CACHE_NAME).is_dir() and not list((model_dir / CACHE_NAME).iterdir())
    assert report.cache_note and CACHE_NAME in report.cache_note
    assert not list(model_dir.glob("*.tmp")) and not list(model_dir.glob(".*.tmp"))
