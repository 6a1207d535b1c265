"""When a sequence ends, stated once for every generation loop (the engine loop, static batches, beams).

Checked in this order after each picked token: non-finite logits end the row before a token is picked
("error", that row only); then EOS, then a stop condition on the generated ids ("stop_string"), then the
length limit. A row whose cache has no room for its next token ends with "cache_full"; an out-of-memory
pass ends the rows it could not run ("error"); a cancelled request ends with "cancelled".

That is the *detail* (`finish_detail` wherever results are shown or stored). What a reader gets as
`finish_reason` is OpenAI's word for it, the same in `run` output, `--json`, the results database and the
server: "stop" (EOS, a stop string, a cancelled request), "length" (max_new_tokens, a full cache), and
"content_filter" where an output filter withheld or rejected text. A request that produced no answer says
"error" (OpenAI has no word for it: its server answers with an HTTP error instead, as ours does).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Literal

FinishReason = Literal["eos", "length", "stop_string", "cache_full", "error", "cancelled"]
OpenAIFinish = Literal["stop", "length", "content_filter", "tool_calls", "error"]
OPENAI_FINISH: dict[str, OpenAIFinish] = {
    "eos": "stop",
    "stop_string": "stop",
    "cancelled": "stop",  # the client left: what it got ended where it stopped listening
    "length": "length",
    "cache_full": "length",  # a limit cut the answer, as max_new_tokens does
    "error": "error",
}


def openai_finish(detail: str | None, *, filtered: bool = False) -> OpenAIFinish:
    """OpenAI's finish_reason for a detail; `filtered`: an output filter withheld or rejected text."""
    if filtered:
        return "content_filter"
    return OPENAI_FINISH.get(detail or "length", "stop")


def shown_finish(reason: str | None, detail: str | None) -> str:
    """`stop (eos)`: the reason, and the detail where it says more."""
    reason = reason or openai_finish(detail)
    return f"{reason} ({detail})" if detail and detail != reason else reason


def end_after_token(
    token: int,
    generated: list[int],
    eos_ids: Collection[int],
    stop: Callable[[list[int]], bool] | None,
    max_new_tokens: int,
) -> FinishReason | None:
    """The reason a row ends after picking `token` (already appended to `generated`), or None: it goes on."""
    if token in eos_ids:
        return "eos"
    if stop is not None and stop(generated):
        return "stop_string"
    if len(generated) >= max_new_tokens:
        return "length"
    return None


def non_finite(generated: int) -> str:
    """The error of a row whose logits are NaN/inf, before its generated token number `generated`."""
    return f"non-finite logits (NaN/inf) at generated token {generated}"


def out_of_memory(during: str, err: BaseException) -> str:
    return f"out of memory during {during}: {err}"
