"""`output.write`: deliver completions to the terminal and to files.

Sinks (`to:`, a list):
  * `terminal` — the text on stdout (a text the generate stage already streamed is not printed
    again), then one summary line per request on stderr (tokens, TTFT, tokens/s);
    `format: markdown | json` prints those forms instead of plain text;
  * `stdout_json` — one JSON result object per request per line on stdout;
  * `{json: PATH}`, `{text: PATH}`, `{markdown: PATH}` — files; a relative PATH is relative to the
    current directory. Every file is written atomically (a temp file in the same folder, renamed
    into place), so an interrupted write leaves the old file or none — never half a file.

Under `llmplan run --json` (ctx.json_mode) stdout carries exactly one JSON object per request per
line and nothing else: `terminal` and `stdout_json` both mean those lines (printed once), and no
summary goes to stderr. Result objects follow the "llmplan.result/v1" schema (output_format.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable
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
                atomic_write(path, chunks)
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
        for index, sink in enumerate(params.to):
            if isinstance(sink, FileSink):
                kind, path_text = next(iter(sink.root.items()))
                folder = Path(path_text).expanduser().absolute().parent
                while not folder.exists() and folder != folder.parent:
                    folder = folder.parent
                if not os.access(folder, os.W_OK):
                    deep.problem(f"{folder}: not writable", f"to.{index}.{kind}")


def atomic_write(path: Path, chunks: Iterable[str]) -> None:
    """Write `chunks` to a temp file next to `path`, fsync, rename into place; on any error remove it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise StageFailure(f"{path}: is a directory, not a file")
        handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed below, before the rename
            "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False
        )
    except OSError as bad:
        raise StageFailure(f"{path}: cannot write ({bad.strerror or bad})") from None
    temp = Path(handle.name)
    try:
        with handle:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
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
