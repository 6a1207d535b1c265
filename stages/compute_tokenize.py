"""`compute.tokenize`: prompts (plan messages, raw text, or a JSONL file) into token ids.

Chat prompts go through the model's chat template with the generation prompt added; raw prompts
get BOS when the model wants it. What a user wrote (message contents, raw prompts) is encoded as
text: a "<|im_end|>" in it is those characters, not the control token (`Tokenizer.encode_chat`).
Prompts longer than the context are truncated by a stated policy (keep the end by default) with a
warning event. A bad JSONL line is reported with its line number
and skipped (or fatal, by `on_bad_line`); it never takes the good lines down with it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmplan.engine.findings import InputRefused, StageFailure
from llmplan.engine.messages import describe
from llmplan.engine.stage import DeepCheck, Params, Phase, Stage
from llmplan.llm.text import TokenizerError

from .request_settings import Overrides
from .slots import InferenceContext
from .types import Request, Result

Truncation = Literal["keep_end", "keep_start", "error"]
MAX_PROMPT_FILE_BYTES = 64 << 20
_BOM = b"\xef\xbb\xbf"


class Message(BaseModel):
    """A chat turn. A tool-calling turn (assistant `tool_calls`, a `tool` answer with its `tool_call_id`)
    goes to the chat template as given, in HF's message shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class RequestLine(Overrides):
    id: str | None = Field(None, max_length=200)
    messages: list[Message] | None = Field(None, min_length=1)
    text: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> RequestLine:
        if (self.messages is None) == (self.text is None):
            raise ValueError("give exactly one of `messages` or `text`")
        return self


class TokenizeParams(Params):
    messages: list[Message] | None = Field(None, min_length=1, description="a chat: [{role, content}, ...]")
    system: str | None = Field(None, description="a system prompt put before `messages`")
    tools: list[dict[str, Any]] | None = Field(
        None, description="function definitions (OpenAI's `tools`) for a chat template that renders them"
    )
    text: str | None = Field(None, description="a raw prompt (no chat template)")
    prompts_file: str | None = Field(None, description="JSONL (one request per line) or Parquet (same columns)")
    id: str = Field("prompt", description="request id for a single prompt")
    chat_template: Literal["auto", "never"] = Field("auto", description="auto: chat prompts use the template")
    add_bos: Literal["auto", "always", "never"] = Field("auto", description="auto: as the tokenizer says")
    truncation: Truncation = Field("keep_end", description="when a prompt is longer than the context")
    max_prompt_tokens: int | None = Field(None, ge=1, description="default: the model's context")
    on_bad_line: Literal["skip", "fail"] = Field("skip", description="a malformed JSONL line")

    @model_validator(mode="after")
    def _one_source(self) -> TokenizeParams:
        given = [n for n in ("messages", "text", "prompts_file") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of messages, text or prompts_file (got {', '.join(given) or 'none'})")
        return self


def truncate(ids: list[int], limit: int, policy: Truncation, keep_first: int = 0) -> tuple[list[int], int]:
    """Cut `ids` to `limit` tokens; keep_end keeps the first `keep_first` (BOS) and the most recent rest."""
    if len(ids) <= limit:
        return ids, 0
    dropped = len(ids) - limit
    if policy == "error":
        raise InputRefused(f"prompt has {len(ids)} tokens; the limit is {limit} (truncation: error)")
    if policy == "keep_start":
        return ids[:limit], dropped
    head = ids[: min(keep_first, limit)]
    return head + ids[len(ids) - (limit - len(head)) :], dropped


def read_prompt_file(
    path: Path, on_bad_line: str, log: Any, notice: Callable[[str, str], None] | None = None
) -> list[tuple[int, RequestLine]]:
    """(line number, request) for every good line. Nothing is dropped or changed unseen: a skipped
    line and bytes that are not UTF-8 (replaced by U+FFFD) each get a notice naming `file:line`; a
    UTF-8 BOM at the start is an encoding mark, not part of the first request."""
    notice = notice or (lambda kind, message: None)
    if not path.is_file():
        raise StageFailure(f"{path}: prompts file not found")
    good: list[tuple[int, RequestLine]] = []
    bad = 0
    read = 0
    try:
        handle = path.open("rb")
    except OSError as error:
        raise StageFailure(f"{path}: cannot read the prompts file ({error.strerror or error})") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            read += len(raw)
            if read > MAX_PROMPT_FILE_BYTES:  # counted as read: st_size says nothing for a pipe
                raise StageFailure(f"{path}: larger than {MAX_PROMPT_FILE_BYTES >> 20} MiB")
            if number == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                line = raw.decode("utf-8", errors="replace")
                notice(
                    "replaced_bytes",
                    f"{path}:{number}: bytes that are not UTF-8 (at byte {error.start}) were replaced by U+FFFD",
                )
            if not line.strip():
                continue
            problem = None
            try:
                good.append((number, RequestLine.model_validate(json.loads(line))))
            except json.JSONDecodeError as error:
                problem = f"{path}:{number}:{error.colno}: not valid JSON ({error.msg})"
            except RecursionError:
                problem = f"{path}:{number}: JSON nested too deeply"
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(p) for p in first["loc"]) or "line"
                problem = f"{path}:{number}: {where}: {describe(first)}"
            except ValueError:  # json.loads past Python's integer digit limit ("Exceeds the limit")
                problem = f"{path}:{number}: a number too long to read (over {sys.get_int_max_str_digits()} digits)"
            if problem:
                bad += 1
                if on_bad_line == "fail":
                    raise StageFailure(problem)
                log.warning("bad_prompt_line", problem=problem)
                notice("skipped_line", f"{problem}; line skipped (on_bad_line: skip)")
    if not good:
        raise StageFailure(f"{path}: no valid request ({bad} bad line(s))")
    return good


PARQUET_SUFFIXES = (".parquet", ".pq")


def read_prompts(
    path: Path, on_bad_line: str, log: Any, notice: Callable[[str, str], None] | None = None
) -> list[tuple[int, RequestLine]]:
    """A prompts file by its suffix: Parquet (the JSONL fields as columns) or JSONL."""
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return read_prompt_parquet(path, on_bad_line, log, notice)
    return read_prompt_file(path, on_bad_line, log, notice)


def read_prompt_parquet(
    path: Path, on_bad_line: str, log: Any, notice: Callable[[str, str], None] | None = None
) -> list[tuple[int, RequestLine]]:
    """(row number, request) for every good row of a Parquet file whose columns are the JSONL fields
    (id, messages or text, per-request settings); a null cell is an absent field. A bad row is handled
    as a bad JSONL line: a notice naming `file:row`, or fatal with on_bad_line: fail."""
    notice = notice or (lambda kind, message: None)
    if not path.is_file():
        raise StageFailure(f"{path}: prompts file not found")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise StageFailure(f"{path}: reading Parquet needs pyarrow (pip install 'llmplan[ray]')") from None
    try:
        table = pq.read_table(path)
    except Exception as bad:  # pyarrow's errors (ArrowInvalid, OSError) all mean the same here
        raise StageFailure(f"{path}: not a readable Parquet file ({bad})") from None
    good: list[tuple[int, RequestLine]] = []
    bad_rows = 0
    for number, record in enumerate(table.to_pylist(), start=1):
        try:
            good.append((number, RequestLine.model_validate({k: v for k, v in record.items() if v is not None})))
        except ValidationError as error:
            first = error.errors()[0]
            problem = f"{path}:{number}: {'.'.join(str(p) for p in first['loc']) or 'row'}: {describe(first)}"
            bad_rows += 1
            if on_bad_line == "fail":
                raise StageFailure(problem) from None
            log.warning("bad_prompt_line", problem=problem)
            notice("skipped_line", f"{problem}; row skipped (on_bad_line: skip)")
    if not good:
        raise StageFailure(f"{path}: no valid request ({bad_rows} bad row(s))")
    return good


def report_requests(ctx: InferenceContext, generations: list[Result]) -> None:
    """After generation: a prompt cut to fit the KV cache, and a request that ended in error, are
    reported (once each) — never only an event in events.jsonl."""
    requests = {r.id: r for r in ctx.requests or []}
    for gen in generations:
        request = requests.get(gen.request_id)
        if request is not None and request.truncated > request.noticed_truncation:
            where = request.source or f"request {request.id!r}"
            ctx.notice(
                "truncated_prompt",
                f"{where}: prompt cut to {gen.prompt_tokens} tokens to fit the KV cache "
                f"({request.truncated - request.noticed_truncation} dropped)",
            )
            request.noticed_truncation = request.truncated
        if gen.finish_reason == "error":
            ctx.request_error(gen.request_id, gen.error)


class Tokenize(Stage):
    """Render chat templates, add BOS, truncate to the context, and tokenize every request."""

    name = "compute.tokenize"
    phase = Phase.COMPUTE
    Params = TokenizeParams
    reads = ("tokenizer", "model_config")
    writes = ("requests",)
    per_request = True  # a resident plan (`llmplan serve`) runs this stage and what follows per request

    def run(self, ctx: InferenceContext, params: Any) -> None:
        tok, cfg = ctx.tokenizer, ctx.model_config
        assert tok is not None and cfg is not None
        if params.prompts_file is not None:
            path = Path(params.prompts_file)
            numbered = read_prompts(path, params.on_bad_line, ctx.log, ctx.notice)
            lines = [(f"{path}:{line_number}", line) for line_number, line in numbered]
        else:
            single = RequestLine(id=params.id, messages=params.messages, text=params.text)
            lines = [(f"request {params.id!r}", single)]
        limit = params.max_prompt_tokens or cfg.max_position_embeddings
        requests = []
        seen: set[str] = set()
        for number, (source, line) in enumerate(lines, start=1):
            request_id = line.id or f"r{number}"
            if request_id in seen:
                request_id = f"{request_id}-{number}"
            seen.add(request_id)
            request = self._request(request_id, line, params, tok, limit, ctx)
            request.source = source
            if request.truncated:
                ctx.notice(
                    "truncated_prompt",
                    f"{source}: prompt cut from {len(request.prompt_ids) + request.truncated} to "
                    f"{len(request.prompt_ids)} tokens (limit {limit}, truncation: {params.truncation})",
                )
                request.noticed_truncation = request.truncated
            requests.append(request)
        ctx.requests = requests
        ctx.metrics.set("requests", len(requests))
        ctx.metrics.set("prompt_tokens", [len(r.prompt_ids) for r in requests])

    @classmethod
    def prompt_params(cls, message: str | None, prompts_file: str | None) -> dict[str, Any] | None:
        """--prompt is one user message, --prompts a JSONL file; either replaces the plan's own prompts."""
        if message is not None:
            return {"messages": [{"role": "user", "content": message}], "text": None, "prompts_file": None}
        return {"prompts_file": prompts_file, "messages": None, "text": None}

    def check(self, params: Any, deep: DeepCheck) -> None:
        """`validate --deep`: the prompts file `run` would read must be there (the same test as run's)."""
        if params.prompts_file is not None and not Path(params.prompts_file).is_file():
            deep.problem(f"{params.prompts_file}: prompts file not found", "prompts_file")

    def _request(self, request_id: str, line: RequestLine, params: Any, tok: Any, limit: int, ctx: Any) -> Request:
        overrides = line.model_dump(exclude={"id", "messages", "text"}, exclude_none=True)
        try:
            if line.messages is not None and params.chat_template == "auto" and tok.has_chat_template:
                chat = [m.model_dump(exclude_none=True) for m in line.messages]
                if params.system and not any(m["role"] == "system" for m in chat):
                    chat.insert(0, {"role": "system", "content": params.system})
                # The template writes BOS itself when the model wants one; never add a second. Only the
                # template's own text makes control tokens: "<|im_end|>" in a message stays text.
                text, ids = tok.encode_chat(
                    chat, add_generation_prompt=True, add_bos=params.add_bos == "always", tools=params.tools
                )
                kind = "chat"
            else:
                if line.messages is not None:
                    parts = ([params.system] if params.system else []) + [m.content for m in line.messages]
                    text = "\n".join(parts)
                else:
                    text = line.text or ""
                kind = "text"
                add_bos = None if params.add_bos == "auto" else params.add_bos == "always"
                ids = tok.encode(text, add_bos=add_bos, special=False)  # a raw prompt is text, never control tokens
        except TokenizerError as bad:
            raise InputRefused(f"request {request_id!r}: {bad}") from None
        keep_first = 1 if ids and tok.bos_id is not None and ids[0] == tok.bos_id else 0
        ids, dropped = truncate(ids, limit, params.truncation, keep_first)
        if dropped:
            ctx.log.warning("prompt_truncated", request=request_id, dropped=dropped, kept=len(ids), limit=limit)
        if not ids:
            raise InputRefused(f"request {request_id!r}: the prompt is empty after tokenization")
        return Request(request_id, ids, text, kind, overrides, dropped, user_text=_user_text(line))


def _user_text(line: RequestLine) -> str:
    """What the person asked: the last user message of a chat (the template and the system text are not theirs)."""
    if line.messages is None:
        return line.text or ""
    asked = [m.content for m in line.messages if m.role == "user"]
    return asked[-1] if asked else line.messages[-1].content
