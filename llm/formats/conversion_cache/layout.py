"""Converted weights (tensors, int8 and int4 weights by their internal names) as the flat name -> tensor dict an
entry stores, and back.

A tied head that is the embedding table itself (the same storage) is stored once and named as an alias: stored
twice, it would be mapped twice and take its bytes twice in memory.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ...model.weight_formats import from_tensors, to_tensors


def flatten(weights: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(flat tensors, aliases): each weight under its internal name's prefix; a tensor sharing another's
    storage becomes an alias of the first name that holds it."""
    flat: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    holder: dict[tuple[int, tuple[int, ...], str], str] = {}
    for name, weight in weights.items():
        if isinstance(weight, Tensor):
            identity = (weight.data_ptr(), tuple(weight.shape), str(weight.dtype))
            if identity in holder and weight.numel():
                aliases[name] = holder[identity]
                continue
            holder[identity] = name
        flat.update(to_tensors(weight, name.removesuffix("weight")))
    return flat, aliases


def unflatten(flat: dict[str, Tensor], aliases: dict[str, str], names: list[str]) -> dict[str, Any]:
    """The weights of `names` rebuilt from the flat tensors (KeyError/ValueError when one is missing or
    inconsistent); an alias is the very object of the name it points to."""
    out: dict[str, Any] = {}
    for name in names:
        if name not in aliases:
            out[name] = from_tensors(flat, name.removesuffix("weight"))
    for name in names:
        if name in aliases:
            target = aliases[name]
            if target not in out:
                raise KeyError(f"{name}: an alias of {target}, which the entry does not hold")
            out[name] = out[target]
    return out
