"""Test-only: make a chosen phase of a `llmplan run` subprocess slow and announce it, so a test can
send SIGINT (or SIGKILL) exactly while that phase runs. Loaded by Python at start-up because the test
puts this folder first on PYTHONPATH; does nothing unless TRUST_PHASE is set.

TRUST_PHASE: import | read | convert | place | generate | release
TRUST_MARKER: file created when the phase is reached
TRUST_SLEEP: seconds to stay in the phase (default 3)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from typing import Any

PHASE = os.environ.get("TRUST_PHASE", "")
MARKER = os.environ.get("TRUST_MARKER", "")
SLEEP = float(os.environ.get("TRUST_SLEEP", "3"))


def reached() -> None:
    if MARKER and not os.path.exists(MARKER):
        with open(MARKER, "w") as handle:
            handle.write(PHASE)


def slow(function: Any, *, every: bool = False) -> Any:
    state = {"done": False}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if every or not state["done"]:
            state["done"] = True
            reached()
            time.sleep(SLEEP if not every else SLEEP / 20)
        return function(*args, **kwargs)

    return wrapper


def _patch_shard_reader(module: Any) -> None:
    original = module._iter_shard

    def iter_shard(*args: Any, **kwargs: Any) -> Any:  # runs in the reader thread, like real reading
        for item in original(*args, **kwargs):
            reached()
            time.sleep(SLEEP / 20)
            yield item

    module._iter_shard = iter_shard


def _patch_convert(module: Any) -> None:
    module._convert_group = slow(module._convert_group, every=True)  # each fused group it converts


def _patch_place(module: Any) -> None:
    module.KVCache.for_model = staticmethod(slow(module.KVCache.for_model))


def _patch_generate(module: Any) -> None:
    module._scheduled = slow(module._scheduled)


def _patch_release(module: Any) -> None:
    module.OutputRelease.run = slow(module.OutputRelease.run)


TARGETS = {
    "read": ("llmplan.llm.formats.shard_reader", _patch_shard_reader),
    "convert": ("llmplan.stages.load_convert", _patch_convert),
    "place": ("llmplan.stages.load_to_device", _patch_place),
    "generate": ("llmplan.llm.generation.request_runner", _patch_generate),
    "release": ("llmplan.stages.output_release", _patch_release),
    "import": ("torch", lambda module: None),
}


class _Finder(importlib.abc.MetaPathFinder):
    """Patch the target module right after it is first imported (importing it here would move it)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        wanted = TARGETS.get(PHASE)
        if wanted is None or name != wanted[0]:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module: Any) -> None:
            if PHASE == "import":  # Ctrl-C while torch (the heaviest import) is being imported
                reached()
                time.sleep(SLEEP)
            exec_module(module)
            wanted[1](module)

        loader.exec_module = patched  # type: ignore[method-assign]
        return spec


if PHASE in TARGETS:
    sys.meta_path.insert(0, _Finder())
