"""Shard manifest and integrity checks on tiny, really sharded transformers Llama checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from llmplan.llm.trust import MANIFEST_NAME, IntegrityError, build_manifest, verify
from llmplan.llm.trust.manifest import sha256_file, write_sha256sums

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 14-shard random Llama saved by transformers, with a SHA256SUMS over its shards, index and config
    (with a SHA256SUMS, every file the load reads must be in it)."""
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
    out = tmp_path_factory.mktemp("llama") / "model"
    LlamaForCausalLM(config).save_pretrained(out, max_shard_size="20KB")
    write_sha256sums(out, [*(p.name for p in out.glob("*.safetensors")), INDEX, "config.json"])
    return out


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A private copy each test may damage."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


def shard_names(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.glob("*.safetensors"))


def edit_index(model_dir: Path, tensor: str, shard: str) -> None:
    index = json.loads((model_dir / INDEX).read_text())
    index["weight_map"][tensor] = shard
    (model_dir / INDEX).write_text(json.dumps(index))


def test_manifest_lists_shards_sizes_and_hashes(ckpt: Path) -> None:
    manifest = build_manifest(ckpt)
    names = shard_names(ckpt)
    assert len(names) > 3 and [s.name for s in manifest.shards] == names
    assert manifest.format == "safetensors" and manifest.index == ckpt / INDEX
    assert manifest.tensor_to_shard == json.loads((ckpt / INDEX).read_text())["weight_map"]
    for shard in manifest.shards:
        assert shard.size == shard.path.stat().st_size  # derived from the header alone
        assert shard.hash_source == "SHA256SUMS" and shard.sha256 == sha256_file(shard.path)


def test_verify_required_passes_and_reports(ckpt: Path) -> None:
    manifest = build_manifest(ckpt)
    seen: list[int] = []
    report = verify(manifest, "required", progress=seen.append)
    total = sum(s.path.stat().st_size for s in manifest.shards)
    listed = sum(s.path.stat().st_size for s in manifest.listed)  # the index and config, hashed too
    assert report.files_checked == len(manifest.shards) + len(manifest.listed) == len(manifest.shards) + 2
    assert report.bytes_hashed == total + listed and total == sum(seen) == manifest.total_bytes
    assert report.unhashed == [] and report.seconds >= 0


def test_missing_shard(ckpt: Path) -> None:
    manifest = build_manifest(ckpt)
    victim = manifest.shards[2].path
    victim.unlink()
    with pytest.raises(IntegrityError) as err:
        verify(manifest, "off")
    assert str(err.value) == f"{victim}: missing shard (listed in {ckpt / INDEX})"


def test_truncated_shard(ckpt: Path) -> None:
    victim = ckpt / shard_names(ckpt)[1]
    size = victim.stat().st_size
    os.truncate(victim, size - 100)
    with pytest.raises(IntegrityError) as err:
        verify(build_manifest(ckpt), "if_present")
    assert str(err.value) == f"{victim}: truncated: {size - 100} bytes, expected {size}"


def test_off_policy_checks_existence_only(ckpt: Path) -> None:
    victim = ckpt / shard_names(ckpt)[1]
    os.truncate(victim, 10)
    report = verify(build_manifest(ckpt), "off")
    assert report.bytes_hashed == 0 and len(report.unhashed) == report.files_checked


def test_corrupted_header(ckpt: Path) -> None:
    victim = ckpt / shard_names(ckpt)[0]
    with open(victim, "r+b") as handle:
        handle.seek(8)  # the header's opening '{'
        handle.write(b"X")
    with pytest.raises(IntegrityError) as err:
        verify(build_manifest(ckpt), "required")
    assert str(err.value) == f"{victim}: corrupt safetensors header: not valid JSON (Expecting value at byte 0)"


def test_hash_mismatch_same_size(ckpt: Path) -> None:
    manifest = build_manifest(ckpt)
    victim = manifest.shards[-1]
    with open(victim.path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)  # tensor data, so size and header still pass
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0xFF]))
    got = sha256_file(victim.path)
    with pytest.raises(IntegrityError) as err:
        verify(manifest, "if_present")
    assert str(err.value) == (f"{victim.path}: SHA-256 mismatch: expected {victim.sha256[:16]}…, got {got[:16]}…")


def test_index_dotdot_traversal(ckpt: Path) -> None:
    edit_index(ckpt, "model.norm.weight", "../outside.safetensors")
    with pytest.raises(IntegrityError) as err:
        build_manifest(ckpt)
    assert str(err.value) == (
        f"{ckpt / INDEX}: entry 'model.norm.weight' -> '../outside.safetensors': '..' path escapes the model directory"
    )


def test_index_absolute_path(ckpt: Path) -> None:
    edit_index(ckpt, "model.norm.weight", "/etc/passwd")
    with pytest.raises(IntegrityError) as err:
        build_manifest(ckpt)
    assert str(err.value) == (
        f"{ckpt / INDEX}: entry 'model.norm.weight' -> '/etc/passwd': absolute path outside the model directory"
    )


def test_index_escaping_symlink(ckpt: Path, tmp_path: Path) -> None:
    name = json.loads((ckpt / INDEX).read_text())["weight_map"]["model.norm.weight"]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(ckpt / name, outside)
    (ckpt / name).symlink_to(outside)
    first = next(t for t, s in json.loads((ckpt / INDEX).read_text())["weight_map"].items() if s == name)
    with pytest.raises(IntegrityError) as err:
        build_manifest(ckpt)
    assert str(err.value) == (
        f"{ckpt / INDEX}: entry {first!r} -> {name!r}: symlink escapes the model directory "
        f"(resolves to {outside.resolve()})"
    )


def test_symlink_inside_model_dir_is_fine(ckpt: Path) -> None:
    name = shard_names(ckpt)[0]
    (ckpt / "store").mkdir()
    shutil.move(ckpt / name, ckpt / "store" / name)
    (ckpt / name).symlink_to(Path("store") / name)
    verify(build_manifest(ckpt), "required")


def test_required_policy_without_hashes(ckpt: Path) -> None:
    (ckpt / MANIFEST_NAME).unlink()
    manifest = build_manifest(ckpt)
    assert all(s.sha256 is None and s.hash_source is None for s in manifest.shards)
    with pytest.raises(IntegrityError) as err:
        verify(manifest, "required")
    assert str(err.value) == (
        f"{manifest.shards[0].path}: no known SHA-256 and verify policy is 'required' "
        "(add it to SHA256SUMS or the plan, or use policy 'if_present')"
    )
    report = verify(manifest, "if_present")
    assert report.unhashed == [s.name for s in manifest.shards] and report.bytes_hashed == 0


def test_plan_hashes_and_disagreement(ckpt: Path) -> None:
    (ckpt / MANIFEST_NAME).unlink()
    names = shard_names(ckpt)
    plan = {name: "sha256:" + sha256_file(ckpt / name).upper() for name in names}
    manifest = build_manifest(ckpt, plan_hashes=plan)
    assert {s.hash_source for s in manifest.shards} == {"plan"}
    verify(manifest, "required")

    write_sha256sums(ckpt, names)
    plan[names[0]] = "0" * 64
    with pytest.raises(IntegrityError) as err:
        build_manifest(ckpt, plan_hashes=plan)
    real = sha256_file(ckpt / names[0])
    assert str(err.value) == (
        f"{ckpt / names[0]}: SHA-256 from plan ({'0' * 16}…) disagrees with SHA256SUMS ({real[:16]}…)"
    )


def test_index_lists_tensor_missing_from_shard(ckpt: Path) -> None:
    names = shard_names(ckpt)
    edit_index(ckpt, "model.norm.weight", names[0])  # the index now lies about where it lives
    with pytest.raises(IntegrityError) as err:
        verify(build_manifest(ckpt), "if_present")
    assert str(err.value) == (
        f"{ckpt / names[0]}: {INDEX} lists tensor 'model.norm.weight' but the shard does not contain it"
    )


def test_hf_cache_layout(pristine: Path, tmp_path: Path) -> None:
    """snapshots/<rev>/<file> -> ../../blobs/<sha256>: the blob name is the shard's hash."""
    repo = tmp_path / "hub" / "models--tiny--llama"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for source in pristine.iterdir():
        if source.name == MANIFEST_NAME:
            continue
        # LFS files are named by SHA-256; small git files by a 40-hex git sha1, which is not a SHA-256.
        blob = sha256_file(source) if source.suffix == ".safetensors" else source.name.encode().hex()[:40]
        shutil.copy(source, repo / "blobs" / blob)
        (snapshot / source.name).symlink_to(Path("..", "..", "blobs", blob))
    manifest = build_manifest(snapshot)
    assert {s.hash_source for s in manifest.shards} == {"hf-cache-blob"}
    report = verify(manifest, "required")
    assert report.files_checked == len(manifest.shards) and report.unhashed == []

    # A blob that no longer matches its name is caught like any other mismatch.
    victim = manifest.shards[0]
    blob = victim.path.resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"SHA-256 mismatch: expected "):
        verify(manifest, "required")


def test_no_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match=r"no checkpoint found"):
        build_manifest(tmp_path)
