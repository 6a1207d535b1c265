"""`output.write`: deliver completions to the terminal and to files.

Sinks (`to:`, a list):
  * `terminal` — the text on stdout (a text the generate stage already streamed is not printed
    again), then one summary line per request on stderr (tokens, TTFT, tokens/s);
    `format: markdown | json` prints those forms instead of plain text;
  * `stdout_json` — one JSON result object per request per line on stdout;
  * `{json: PATH}`, `{text: PATH}`, `{markdown: PATH}` — files; a relative PATH is relative to the
    current directory. Every file is written atomically (a temp file in the same folder, renamed
    into place), so an interrupted write leaves the old file or none — never half a file.

A sink never destroys data. It writes a new file, or replaces a regular file that llmplan wrote:
  * a JSON sink replaces a file that is an llmplan result document (a JSON object whose `schema`
    is "llmplan.result/v1") — the file says who wrote it;
  * a text or Markdown sink replaces a file whose content is exactly what llmplan last wrote
    there: beside it a marker `.NAME.llmplan` holds the SHA-256 of that content. A file edited
    since is the user's now, and is kept.
Anything else is refused with one line — a directory, a symbolic link (replacing it would cut the
link, and writing through it would write elsewhere), a FIFO, a device, a socket, an SQLite
database, any other file — by `prepare`, before the model is loaded or a token generated (and by
`validate --deep`), and checked again just before the rename.
Temp files are named `.NAME.llmplan-PID-RANDOM.tmp`; one whose process is gone (a killed run) is
removed by the next write to that folder's NAME. Files get the mode of any new file (0666 minus
the umask), not a private 0600.

Under `llmplan run --json` (ctx.json_mode) stdout carries exactly one JSON object per request per
line and nothing else: `terminal` and `stdout_json` both mean those lines (printed once), and no
summary goes to stderr. Result objects follow the "llmplan.result/v1" schema (output_format.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, RootModel, field_validator

from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage

from . import output_format as fmt
from .slots import InferenceContext

FileKind = Literal["json", "text", "markdown"]


class FileSink(RootModel[dict[FileKind, str]]):
    @field_validator("root")
    @classmethod
    def _one_path(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) != 1:
            raise ValueError("a file sink is one of {json: PATH}, {text: PATH}, {markdown: PATH}")
        path = next(iter(value.values()))
        if not path.strip() or "\x00" in path:
            raise ValueError("the path must be a non-empty file name")
        return value


class WriteParams(Params):
    to: list[Literal["terminal", "stdout_json"] | FileSink] = Field(
        default_factory=lambda: ["terminal"],
        min_length=1,
        description="sinks: terminal | stdout_json | {json: PATH} | {text: PATH} | {markdown: PATH}",
    )
    format: Literal["text", "markdown", "json"] = Field("text", description="how `terminal` prints results")


class OutputWrite(Stage):
    """Print results (stdout text, stderr summary) and write JSON/text/Markdown files atomically."""

    name = "output.write"
    phase = Phase.OUTPUT
    Params = WriteParams
    reads = ("completions",)
    optional_reads = ("model_source",)
    writes = ("deliveries",)

    def prepare(self, ctx: InferenceContext, params: Any) -> None:
        """Refuse a target that is not ours before any work is done (and clear dead runs' temp files)."""
        for kind, path in file_sinks(params):
            remove_stale_temps(path)
            check_target(path, kind)

    def run(self, ctx: InferenceContext, params: Any) -> None:
        assert ctx.completions is not None
        plan = plan_name(ctx)
        model = ctx.model_source.fingerprint if ctx.model_source is not None else None
        load_s = load_seconds(ctx)
        results = [fmt.result_object(c, plan=plan, model=model, load_s=load_s) for c in ctx.completions]
        deliveries: list[str] = []
        printed_json = False
        for sink in params.to:
            if isinstance(sink, FileSink):
                kind, path_text = next(iter(sink.root.items()))
                path = Path(path_text).expanduser()
                if kind == "json":
                    chunks: Iterable[str] = fmt.json_document_chunks(results, plan=plan, model=model)
                elif kind == "markdown":
                    chunks = fmt.markdown_chunks(ctx.completions, plan=plan, model=model)
                else:
                    chunks = fmt.text_chunks(ctx.completions)
                atomic_write(path, chunks, kind)
                deliveries.append(f"{kind}:{path}")
            elif sink == "stdout_json" or ctx.json_mode or params.format == "json":
                if not printed_json:
                    for result in results:
                        sys.stdout.write(fmt.json_line(result) + "\n")
                    sys.stdout.flush()
                    printed_json = True
                deliveries.append(sink)
            else:
                self._terminal(ctx, params.format, plan, model)
                deliveries.append("terminal")
            if sink == "terminal" and not ctx.json_mode:
                for completion in ctx.completions:
                    prefix = f"[{completion.request_id}] " if len(ctx.completions) > 1 else ""
                    print(prefix + fmt.stats_text(completion, load_s), file=sys.stderr)
        if ctx.json_mode and not printed_json:  # --json always means the JSON lines on stdout
            for result in results:
                sys.stdout.write(fmt.json_line(result) + "\n")
            sys.stdout.flush()
            deliveries.append("stdout_json")
        ctx.deliveries = deliveries
        ctx.metrics.set("deliveries", deliveries)

    def _terminal(self, ctx: InferenceContext, format: str, plan: str | None, model: str | None) -> None:
        assert ctx.completions is not None
        out = sys.stdout
        if format == "markdown":
            out.write("".join(fmt.markdown_chunks(ctx.completions, plan=plan, model=model)))
        else:
            many = len(ctx.completions) > 1
            for completion in ctx.completions:
                if completion.streamed:
                    # Already on screen, streamed token by token (through the filter's guard when
                    # there is one); finish its line, and say why a rejected stream stopped.
                    out.write("\n" if completion.error is None else f"\n(error: {completion.error})\n")
                    continue
                if many:
                    out.write(f"[{completion.request_id}]\n")
                text = completion.text if completion.text or not completion.error else f"(error: {completion.error})"
                out.write(text + ("" if text.endswith("\n") else "\n"))
        out.flush()

    def check(self, params: Any, deep: DeepCheck) -> None:
        for index, (kind, path) in enumerate(file_sinks(params)):
            folder = path.absolute().parent
            while not folder.exists() and folder != folder.parent:
                folder = folder.parent
            if not os.access(folder, os.W_OK):
                deep.problem(f"{folder}: not writable", f"to.{index}.{kind}")
            try:
                check_target(path, kind)
            except StageFailure as bad:
                deep.problem(str(bad), f"to.{index}.{kind}")


def file_sinks(params: Any) -> list[tuple[str, Path]]:
    sinks = []
    for sink in params.to:
        if isinstance(sink, FileSink):
            kind, path_text = next(iter(sink.root.items()))
            sinks.append((kind, Path(path_text).expanduser()))
    return sinks


SIDECAR_SUFFIX = ".llmplan"
TEMP_TAG = ".llmplan-"
_MAX_OWNED_BYTES = 256 << 20  # an output bigger than this is not read back to prove it is ours
_SQLITE_MAGIC = b"SQLite format 3\x00"
_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def sidecar(path: Path) -> Path:
    return path.with_name(f".{path.name}{SIDECAR_SUFFIX}")


def check_target(path: Path, kind: str) -> None:
    """Raise StageFailure unless `path` is absent or a regular file llmplan wrote (module doc)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as bad:
        raise StageFailure(f"{path}: cannot check the target ({bad.strerror or bad})") from None
    mode = info.st_mode
    if stat.S_ISLNK(mode):
        raise StageFailure(f"{path}: is a symbolic link; llmplan writes only regular files it owns")
    if stat.S_ISDIR(mode):
        raise StageFailure(f"{path}: is a directory, not a file")
    if not stat.S_ISREG(mode):
        what = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise StageFailure(f"{path}: is {what}; llmplan writes only regular files it owns")
    if info.st_size > _MAX_OWNED_BYTES:
        raise StageFailure(f"{path}: exists and is too large to be an output llmplan wrote; choose another path")
    try:
        with path.open("rb") as handle:
            content = handle.read(_MAX_OWNED_BYTES + 1)
    except OSError as bad:
        raise StageFailure(f"{path}: cannot check the target ({bad.strerror or bad})") from None
    if content.startswith(_SQLITE_MAGIC):
        raise StageFailure(f"{path}: is an SQLite database; llmplan does not overwrite it with {kind}")
    if not _owned(path, kind, content):
        raise StageFailure(
            f"{path}: exists and is not a {kind} output llmplan wrote (or was changed since); "
            "move it away or choose another path"
        )


def _owned(path: Path, kind: str, content: bytes) -> bool:
    if kind == "json":
        try:
            document = json.loads(content.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return False
        return isinstance(document, dict) and document.get("schema") == fmt.SCHEMA
    return _marker_hash(path) == hashlib.sha256(content).hexdigest()


def _marker_hash(path: Path) -> str | None:
    marker = sidecar(path)
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return None
        value = json.loads(marker.read_text(encoding="utf-8")).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


_TEMP_PID = re.compile(r"\.llmplan-(\d+)-[0-9a-f]+\.tmp$")


def remove_stale_temps(path: Path) -> None:
    """Remove `.NAME.llmplan-PID-*.tmp` files (and the marker's) left by a run whose process is gone."""
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return  # no folder yet: nothing left over
    prefixes = tuple(f".{name}{TEMP_TAG}" for name in (path.name, sidecar(path).name))
    for entry in entries:
        if not entry.name.startswith(prefixes):
            continue
        match = _TEMP_PID.search(entry.name)
        if match and entry.is_file(follow_symlinks=False) and not _alive(int(match.group(1))):
            with contextlib.suppress(OSError):  # not ours to remove after all: leave it
                os.unlink(entry.path)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def atomic_write(path: Path, chunks: Iterable[str], kind: str = "text") -> None:
    """Write `chunks` to a temp file next to `path`, fsync, rename into place; on any error remove it.

    The target is checked (check_target) first and again right before the rename. A text or
    Markdown file gets its marker (the SHA-256 of what was written), so the next run may replace it.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as bad:
        raise StageFailure(f"{path}: cannot write ({bad.strerror or bad})") from None
    remove_stale_temps(path)
    check_target(path, kind)
    digest = hashlib.sha256()

    def hashed() -> Iterator[str]:
        for chunk in chunks:
            digest.update(chunk.encode("utf-8"))
            yield chunk

    _replace_with(path, hashed(), lambda: check_target(path, kind))
    if kind != "json":
        marker = json.dumps({"sha256": digest.hexdigest(), "written_by": "llmplan"}) + "\n"
        _replace_with(sidecar(path), iter([marker]), lambda: _check_marker(sidecar(path)))


def _check_marker(marker: Path) -> None:
    try:
        mode = os.lstat(marker).st_mode
    except FileNotFoundError:
        return
    except OSError as bad:
        raise StageFailure(f"{marker}: cannot check ({bad.strerror or bad})") from None
    if not stat.S_ISREG(mode):
        raise StageFailure(f"{marker}: llmplan's marker path is not a regular file")


def _replace_with(path: Path, chunks: Iterable[str], recheck: Callable[[], None]) -> None:
    temp = path.with_name(f".{path.name}{TEMP_TAG}{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        # 0o666 through the umask, like any new file; O_EXCL: never follow or reuse a planted name.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as bad:
        raise StageFailure(f"{path}: cannot write ({bad.strerror or bad})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        recheck()  # the target may have changed while we wrote
        os.replace(temp, path)
    except BaseException as bad:
        temp.unlink(missing_ok=True)
        if isinstance(bad, OSError):
            raise StageFailure(f"{path}: cannot write ({bad.strerror or bad})") from None
        raise


def plan_name(ctx: InferenceContext) -> str | None:
    plan = getattr(ctx.plan, "plan", None)
    return getattr(plan, "name", None)


def load_seconds(ctx: InferenceContext) -> float | None:
    """Wall time of the plan's load-phase stages that ran (None without a plan)."""
    stages = getattr(ctx.plan, "stages", None)
    if stages is None:
        return None
    total = 0.0
    for bound in stages:
        if bound.cls.phase == Phase.LOAD:
            total += float(ctx.metrics.by_stage.get(bound.id, {}).get("wall_s", 0.0))
    return total
