"""Typed, bounded access to a GGUF's key/values for the importer, and the importer's one error type.

The values themselves were read with bounds by gguf_file.py; here an absent, ill-typed or out-of-range
value becomes a `GGUFImportError` naming the file and the key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from .file import GGUFFile


class GGUFImportError(ValueError):
    """The GGUF cannot be imported: unreadable, corrupt or unsupported. One line naming the file."""


MISSING: Any = object()


def fail(path: Path, reason: object) -> GGUFImportError:
    return GGUFImportError(f"{path}: {' '.join(str(reason).split())}")


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def f32(value: float) -> float:
    """GGUF stores float32; its shortest round-tripping repr is the value the converter was given (1e-05, not
    9.999999747378752e-06)."""
    return float(str(np.float32(value)))


class GGUFMetadata:
    """Typed access to GGUF key/values: an absent, ill-typed or out-of-range value is a GGUFImportError
    naming the key."""

    def __init__(self, gguf_file: GGUFFile) -> None:
        self._values = gguf_file.metadata
        self._types = gguf_file.types
        self.path = gguf_file.path

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def _wrong(self, key: str, wanted: str) -> GGUFImportError:
        value = self._values[key]
        return fail(self.path, f"metadata {key}: expected {wanted}, got {self._types[key]} {shown(value)}")

    def integer(self, key: str, default: Any = MISSING, low: int = 0, high: int = 1 << 62) -> Any:
        if key not in self._values:
            if default is MISSING:
                raise fail(self.path, f"metadata {key} is missing")
            return default
        value = self._values[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self._wrong(key, f"an integer from {low} to {high}")
        return value

    def number(self, key: str, default: Any = MISSING) -> Any:
        if key not in self._values:
            if default is MISSING:
                raise fail(self.path, f"metadata {key} is missing")
            return default
        value = self._values[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self._wrong(key, "a finite number")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._values.get(key, default)
        if not isinstance(value, bool):
            raise self._wrong(key, "a bool")
        return value

    def text(self, key: str, default: Any = None) -> Any:
        value = self._values.get(key, default)
        if value is not default and not isinstance(value, str):
            raise self._wrong(key, "a string")
        return value

    def strings(self, key: str) -> list[str]:
        if key not in self._values:
            raise fail(self.path, f"metadata {key} is missing")
        if self._types[key] != "array[string]":
            raise self._wrong(key, "an array of strings")
        return list(self._values[key])

    def integers(self, key: str) -> list[int] | None:
        if key not in self._values:
            return None
        value = self._values[key]
        if not self._types[key].startswith("array[") or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise self._wrong(key, "an array of integers")
        return list(value)

    def numbers(self, key: str) -> list[float] | None:
        if key not in self._values:
            return None
        value = self._values[key]
        if self._types[key] not in ("array[f32]", "array[f64]") or not all(math.isfinite(v) for v in value):
            raise self._wrong(key, "an array of finite floats")
        return [float(v) for v in value]
