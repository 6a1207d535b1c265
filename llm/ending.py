"""When a sequence ends, stated once for every generation loop (the engine loop, static batches, beams).

Checked in this order after each picked token: non-finite logits end the row before a token is picked
("error", that row only); then EOS, then a stop condition on the generated ids ("stop_string"), then the
length limit. A row whose cache has no room for its next token ends with "cache_full"; an out-of-memory
pass ends the rows it could not run ("error"); a cancelled request ends with "cancelled".
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Literal

FinishReason = Literal["eos", "length", "stop_string", "cache_full", "error", "cancelled"]


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
