"""A package's public names, each imported from its module on first use (PEP 562 module `__getattr__`).

Why lazily: `llmplan --help` and the light modules (the scheduler, plan validation) must not import torch or
llguidance just because a package they share names a heavy class. A package lists its names once
(`EXPORTS`: name -> the module that defines it); the first `package.Name` imports that module and keeps
the value in the package, so later look-ups are plain attribute reads.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's `__getattr__` and `__dir__` for `exports` (name -> module, relative to the package)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
