"""Issue 11, verification: the hash cache cannot be fooled by a restored mtime; every listed file is checked."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llmplan.llm.trust import HashCache, IntegrityError, build_manifest, verify
from llmplan.llm.trust.manifest import write_sha256sums


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    save_file({"a": torch.arange(1000, dtype=torch.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    (tmp_path / "tokenizer.json").write_text("{}", encoding="utf-8")
    write_sha256sums(tmp_path, ["model.safetensors", "config.json", "tokenizer.json"])
    return tmp_path


def test_in_place_change_with_mtime_restored_is_caught(model_dir: Path) -> None:
    first = verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))
    assert first.bytes_hashed > 0
    shard = model_dir / "model.safetensors"
    before = shard.stat()
    with open(shard, "r+b") as handle:  # same inode, same size: bit rot or a careful edit
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0xFF]))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    with pytest.raises(IntegrityError, match=r"model\.safetensors: SHA-256 mismatch"):
        verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))


def test_unchanged_files_are_served_from_the_cache(model_dir: Path) -> None:
    verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))
    second = verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))
    assert second.bytes_hashed == 0
    assert sorted(second.cached) == ["config.json", "model.safetensors", "tokenizer.json"]


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_every_file_listed_in_sha256sums_is_verified(model_dir: Path, name: str) -> None:
    (model_dir / name).write_text('{"changed": 1}', encoding="utf-8")
    with pytest.raises(IntegrityError, match=re.escape(f"{name}: SHA-256 mismatch")):
        verify(build_manifest(model_dir), "required")


def test_a_listed_file_that_is_missing_is_refused(model_dir: Path) -> None:
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(IntegrityError, match=r"tokenizer\.json: listed in SHA256SUMS but missing"):
        verify(build_manifest(model_dir), "if_present")


def test_rehash_ignores_the_cache(model_dir: Path) -> None:
    from llmplan.stages.load_verify import VerifyParams

    assert VerifyParams(rehash=True).rehash  # the stage passes no cache then (load_verify.py)
    verify(build_manifest(model_dir), "required", hash_cache=HashCache(model_dir))
    full = verify(build_manifest(model_dir), "required", hash_cache=None)
    assert full.cached == [] and full.bytes_hashed == sum(
        (model_dir / n).stat().st_size for n in ("model.safetensors", "config.json", "tokenizer.json")
    )
