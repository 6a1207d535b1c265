"""Where a decoder block's weighted modules live: the one table of their names.

Names are relative to `layers.{i}` (the checkpoint key is the name plus `.weight`); the output head is the
top-level `output`. The model builder, the converter (which tensors take the plan's precision), the
observer's model report and the benchmarks all read this table, so a renamed or added layer is one edit.
"""

from __future__ import annotations

ATTENTION_LINEARS = ("attention.wqkv", "attention.wo")
FFN_LINEARS = ("feed_forward.w13", "feed_forward.w2")
LINEAR_NAMES = (*ATTENTION_LINEARS, *FFN_LINEARS)
"""Per-layer linears, relative to `layers.{i}`; plus the top-level `HEAD_NAME` head."""

HEAD_NAME = "output"

LAYER_MODULES = ("attention_norm", *ATTENTION_LINEARS, "ffn_norm", *FFN_LINEARS)
"""Every module of one block that holds weights, in forward order."""


def is_linear_weight(name: str) -> bool:
    """Whether a checkpoint key (e.g. `layers.3.feed_forward.w2.weight`) is a linear layer's weight."""
    return name.endswith(tuple(f"{rel}.weight" for rel in LINEAR_NAMES)) or name == f"{HEAD_NAME}.weight"
