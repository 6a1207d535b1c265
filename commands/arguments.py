"""Argument types the commands share (argparse `type=` callables that refuse with a one-line message)."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """An integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value
