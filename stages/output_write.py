"""`output.write`: deliver completions to the terminal and to files.

Sinks (`to:`, a list):
  * `terminal` — the text on stdout (a text the generate stage already streamed is not printed
    again), then one summary line per request on stderr (tokens, TTFT, tokens/s);
    `format: markdown | json` prints those forms instead of plain text;
  * `stdout_json` — one JSON result object per request per line on stdout;
  * `{json: PATH}`, `{text: PATH}`, `{markdown: PATH}` — files; a relative PATH is under the data home
    (llmplan/data_home.py: `$LLMPLAN_HOME`, else ~/.local/share/llmplan), wherever llmplan is started.
    Every file is written atomically (a temp file in the same folder, renamed into place), so an
    interrupted write leaves the old file or none — never half a file.

A sink never destroys data. It writes a new file, or replaces a regular file that llmplan wrote and can
prove it (llmplan/ownership.py): beside it a marker `.NAME.llmplan` records the file's identity and the
SHA-256 of what was written, sealed with this user's llmplan key. A file edited since, a JSON document
that merely looks like a result, and a marker written by hand prove nothing: the file is the user's,
and is kept. Anything else is refused with one line — a directory, a symbolic link (replacing it would
cut the link, and writing through it would write elsewhere), a FIFO, a device, a socket, an SQLite
database, any other file — by `prepare`, before the model is loaded or a token generated (and by
`validate --deep`), and checked again just before the rename.
Temp files are named `.NAME.llmplan-PID-RANDOM.tmp`; one whose process is gone (a killed run) is
removed by the next write to that folder's NAME. Files get the mode of any new file (0666 minus
the umask), not a private 0600.

Under `llmplan run --json` (ctx.json_mode) stdout carries exactly one JSON object per request per
line and nothing else: `terminal` and `stdout_json` both mean those lines (printed once), and no
summary goes to stderr. Result objects follow the "llmplan.result/v2" schema (output_format.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, RootModel, field_validator

from llmplan.data_home import in_home
from llmplan.engine.findings import StageFailure
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage
from llmplan.ownership import NotOurs, check_writable, remove_stale_temps, write_file

from . import completion_rendering as fmt
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
                path = in_home(path_text)
                if kind == "json":
                    chunks: Iterable[str] = fmt.json_document_chunks(results, plan=plan, model=model)
                elif kind == "markdown":
                    chunks = fmt.markdown_chunks(ctx.completions, plan=plan, model=model)
                else:
                    chunks = fmt.text_chunks(ctx.completions)
                replaced = path.exists()
                atomic_write(path, chunks, kind)
                deliveries.append(f"{kind}:{path}")
                # every run replaces a shared path (out/NAME.json): say where it went; not per served request
                if ctx.engine_loop is None:
                    said = "replaced the earlier run's" if replaced else "new"
                    print(f"wrote {path} ({kind}, {said})", file=sys.stderr)
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
                if len(completion.candidates) > 1 and completion.error is None:  # every beam, not only the best
                    out.write("\n".join(fmt.candidate_lines(completion)) + "\n")
                    continue
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
            sinks.append((kind, in_home(path_text)))
    return sinks


def check_target(path: Path, kind: str) -> None:
    """Raise StageFailure unless `path` is absent or a file llmplan wrote and can prove it (module doc)."""
    try:
        check_writable(path, "file")
    except NotOurs as bad:
        raise StageFailure(str(bad)) from None


def atomic_write(path: Path, chunks: Iterable[str], kind: str = "text") -> None:
    """Write `chunks` to a temp file next to `path`, fsync, rename into place, and leave the marker that lets
    the next run replace it; the target is checked first and again right before the rename."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, chunks)
    except NotOurs as bad:
        raise StageFailure(str(bad)) from None
    except OSError as bad:
        raise StageFailure(f"{path}: cannot write ({bad.strerror or bad})") from None


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
