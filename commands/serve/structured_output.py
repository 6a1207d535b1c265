"""The answer's shape a request asks for: OpenAI's `response_format`, llama.cpp's `json_schema` and `grammar`,
vLLM's `guided_*` extras and llmplan's own `format`, each turned into one `OutputFormat`, failing closed.

    response_format: {"type": "text"}                          free text (as if absent)
                     {"type": "json_object"}                   any JSON object (llama.cpp: with "schema", that schema)
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    json_schema: {..}            (llama.cpp) the schema itself          grammar: "..."   (llama.cpp) GBNF or Lark
    guided_json / guided_regex / guided_choice / guided_grammar          (vLLM)
    format: {json: true} | {json_schema: {..}} | {regex} | {grammar} | {choice: [..]}   (llmplan's setting)

At most one of them. A keyword, format or grammar construct llguidance cannot enforce is a 400 that names the
field and the keyword's place in the request (`response_format.json_schema.schema.properties.tags.uniqueItems`)
before any token is generated: never a 200 with text the schema does not hold. `strict: false` is enforced
all the same (a schema that is asked for is the answer's shape). A schema is never read from a file here:
a request's `format.json_schema` must be the schema itself, not a path on the server.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmplan.llm.sampling import OutputFormat, UnsupportedFormat, compile_format

STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)
NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a schema's (and a function's) name


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_object"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama.cpp's: a schema beside json_object


class JsonSchemaSpec(BaseModel):
    model_config = STRICT
    name: str = Field(pattern=NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # OpenAI's: optional (then any JSON object)
    strict: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]

# The request fields that ask for a shape, in the order they are looked at.
FIELDS = ("response_format", "json_schema", "grammar", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


class Shaped(BaseModel):
    """The request fields of a shape (mixed into the request models)."""

    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None  # llama.cpp's
    grammar: str | None = Field(None, min_length=1)  # llama.cpp's
    guided_json: dict[str, Any] | None = None  # vLLM's
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)


class ShapeError(ValueError):
    """A shape that is malformed or cannot be enforced: the request field to name (`param`) and why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def requested_format(body: Any) -> tuple[OutputFormat | None, str | None]:
    """The one shape the request asks for and the field that asked (None, None: free text). Checked: a shape
    llguidance cannot enforce raises ShapeError naming the field and the keyword's place."""
    given = [(name, fmt, prefix) for name, fmt, prefix in _each(body) if fmt is not None]
    if len(given) > 1:
        names = ", ".join(name for name, _, _ in given)
        raise ShapeError(given[1][0], f"give one shape for the answer, not several ({names})")
    if not given:
        return None, None
    name, fmt, prefix = given[0]
    try:
        fmt.check()
    except UnsupportedFormat as bad:
        raise ShapeError(name, refusal(bad, prefix)) from None
    return fmt, name


def refusal(bad: UnsupportedFormat, prefix: str) -> str:
    """UnsupportedFormat's keyword at its place in the request (`prefix`: where the schema sits)."""
    construct = bad.keyword in ("look-around", "backreferences") or "not supported" in bad.keyword
    if bad.kind in ("grammar", "regex") and not construct:  # not a feature left out: the text does not compile
        return f"the {bad.kind} does not compile, so it is refused: {bad.detail or bad.keyword}"
    where = ".".join([prefix, *(str(p) for p in bad.path)]) if bad.path else prefix
    detail = f" ({bad.detail})" if bad.detail and bad.detail != bad.keyword else ""
    return f"{bad.keyword!r} at {where} cannot be enforced, so it is refused rather than ignored{detail}"


def _each(body: Any) -> list[tuple[str, OutputFormat | None, str]]:
    """(field, its format or None, where a schema's paths start) for every shape field of the request."""
    out: list[tuple[str, OutputFormat | None, str]] = []
    rf = body.response_format
    if isinstance(rf, JsonSchemaFormat):
        schema = rf.json_schema.schema_
        made = OutputFormat("json", "") if schema is None else OutputFormat.from_json_schema(schema)
        out.append(("response_format", made, "response_format.json_schema.schema"))
    elif isinstance(rf, JsonObjectFormat):
        made = OutputFormat("json", "") if rf.schema_ is None else OutputFormat.from_json_schema(rf.schema_)
        out.append(("response_format", made, "response_format.schema"))
    for name in ("json_schema", "guided_json"):
        schema = getattr(body, name)
        out.append((name, None if schema is None else OutputFormat.from_json_schema(schema), name))
    for name, kind in (("grammar", "grammar"), ("guided_grammar", "grammar"), ("guided_regex", "regex")):
        text = getattr(body, name)
        out.append((name, None if text is None else OutputFormat(kind, text), name))
    if body.guided_choice is not None:
        out.append(("guided_choice", _of("guided_choice", {"choice": body.guided_choice}), "guided_choice"))
    own = getattr(body, "format", None)
    if own is not None:
        if isinstance(own.get("json_schema") if isinstance(own, dict) else None, str):
            raise ShapeError("format", "json_schema must be the schema itself (a server reads no schema files)")
        made = _of("format", own)
        out.append(("format", made, f"format.{made.kind}" if made is not None else "format"))
    return out


def _of(field: str, value: Any) -> OutputFormat | None:
    try:
        return OutputFormat.of(value)
    except ValueError as bad:
        raise ShapeError(field, str(bad)) from None


def compile_shape(body: Any, context: Any, ignore_eos: bool) -> None:
    """The request's shape compiled against the served tokenizer before it is queued (cached: the run then
    finds it compiled), so what only a tokenizer shows (a literal that spells the end token or a control token,
    a matcher limit met in its first steps) is a ShapeError naming the field, streamed or not, before any token.
    Nothing when no shape, no model loaded yet (the run refuses it then), or no end token (`ignore_eos`)."""
    shape = getattr(body, "shape", None)
    tok = getattr(context, "tokenizer", None)
    cfg = getattr(context, "model_config", None)
    if shape is None or tok is None or cfg is None or ignore_eos:
        return
    eos = set(cfg.eos_token_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
    if not eos:
        return
    field = getattr(body, "_shape_field", None) or "tools"
    try:
        compile_format(shape, tok, frozenset(eos), cfg.vocab_size)
    except UnsupportedFormat as bad:
        raise ShapeError(field, refusal(bad, field)) from None
