"""`load.verify`: the shard list, and each shard's existence, size and SHA-256 — before any tensor is read.

A GGUF import for a plan that keeps the file's blocks has no shards: then the GGUF itself is checked against the
SHA-256 its import pins (by file identity through the hash cache: a changed file is hashed again and refused),
with the import's config and tokenizer files against its SHA256SUMS as always.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Literal

from pydantic import Field, field_validator

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage
from llmplan.llm.trust import HashCache, IntegrityError, build_manifest, verify

from .model_source import READ_BY_LOAD, note_cache_skipped
from .slots import InferenceContext

__all__ = ["READ_BY_LOAD", "LoadVerify", "VerifyParams"]


class VerifyParams(Params):
    hashes: Literal["required", "if_present", "off"] = Field(
        "if_present", description="required: every shard needs a known SHA-256; off: existence only"
    )
    sha256: dict[str, str] = Field(default_factory=dict, description="shard file name -> expected SHA-256")
    rehash: bool = Field(False, description="hash every shard even when its hash is cached for that file identity")

    @field_validator("hashes", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted `off` as false, as cache.lookup's `mode` does: the same meaning here.
        return "off" if value is False else value

    @field_validator("sha256")
    @classmethod
    def _hex(cls, value: dict[str, str]) -> dict[str, str]:
        for name, digest in value.items():
            if not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
                raise ValueError(f"{name}: not a 64-digit hex SHA-256")
        return value


class LoadVerify(Stage):
    """Build the shard manifest and check every shard (exists, size, header, SHA-256)."""

    name = "load.verify"
    phase = Phase.LOAD
    Params = VerifyParams
    reads = ("model_source",)
    writes = ("shard_manifest",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.model_source is not None
        record = ctx.model_source.first_use
        blocks = ctx.model_source.weights_from_gguf
        try:
            manifest = build_manifest(
                ctx.model_source.model_dir, params.sha256 or None, READ_BY_LOAD, record, weights=not blocks
            )
            with ctx.progress.task("verify shards", manifest.total_bytes) as advance:
                # A first-use folder is the user's: its hash cache lives with the record, in the cache.
                where = record.parent if record is not None and manifest.first_use else manifest.model_dir
                cache = None if params.rehash or params.hashes == "off" else HashCache(where)
                report = verify(manifest, params.hashes, advance, cache)
        except IntegrityError as bad:
            raise StageFailure(str(bad)) from None
        if report.cache_note:
            note_cache_skipped(ctx, report.cache_note)
        ctx.shard_manifest = manifest
        ctx.metrics.set("shards", len(manifest.shards))
        ctx.metrics.set("bytes", manifest.total_bytes)
        ctx.metrics.set("bytes_hashed", report.bytes_hashed)
        ctx.metrics.set("hash_cached", report.cached)
        ctx.metrics.set("seconds", report.seconds)
        ctx.metrics.set("unhashed", report.unhashed)
        if blocks:
            check_gguf_pin(ctx, params)

    def check(self, params: Any, deep: DeepCheck) -> None:
        model_dir = deep.facts.get("model_dir")
        if model_dir is None:
            return
        blocks = bool(deep.facts.get("weights_from_gguf"))
        try:
            first_use = deep.facts.get("first_use")
            manifest = build_manifest(model_dir, params.sha256 or None, READ_BY_LOAD, first_use, weights=not blocks)
            verify(manifest, params.hashes)
        except IntegrityError as bad:
            deep.problem(str(bad))
            return
        gguf = deep.facts.get("gguf_file")
        if blocks and gguf is not None:
            from llmplan.llm.formats.gguf import PinError, check_pinned

            try:
                check_pinned(model_dir, gguf, rehash=True)  # --deep hashes every byte, as for shards
            except PinError as bad:
                deep.problem(str(bad))
                return
        deep.facts["manifest"] = manifest


def check_gguf_pin(ctx: InferenceContext, params: Any) -> None:
    """The GGUF the weights will be mapped from is the file the import pinned; said on the stage's line."""
    from llmplan.llm.formats.gguf import PinError, check_pinned

    source = ctx.model_source
    assert source is not None
    if source.gguf_file is None:
        raise StageFailure(f"{source.model_dir}: the plan reads a GGUF's blocks, but the model is no .gguf file")
    try:
        done = check_pinned(source.model_dir, source.gguf_file, rehash=params.rehash)
    except PinError as bad:
        raise StageFailure(str(bad)) from None
    ctx.metrics.set("gguf_sha256", done.pin.sha256)
    ctx.metrics.set("gguf_bytes_hashed", done.bytes_hashed)
    ctx.metrics.set("gguf_blocks_checked", done.pin.blocks_checked)
    if not ctx.json_mode:
        how = "hash cache" if done.bytes_hashed == 0 else f"hashed {done.bytes_hashed / 1e6:.1f} MB"
        print(
            f"{source.gguf_file.name}: SHA-256 {done.pin.sha256[:16]}… as pinned ({how}); no shards: "
            "the weights come from its blocks",
            file=sys.stderr,
            flush=True,
        )
