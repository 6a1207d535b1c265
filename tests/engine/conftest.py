from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmplan.engine.registry import Registry, discover

TOY = Path(__file__).parent / "toy_plugin"


@pytest.fixture
def toy_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Install the toy plugin the way any package is installed: a dist-info on sys.path."""
    monkeypatch.syspath_prepend(str(TOY))
    import toy_stages

    toy_stages.CALLS.clear()
    yield toy_stages
    sys.modules.pop("toy_stages", None)


@pytest.fixture
def registry(toy_plugin: object) -> Registry:
    return discover()


@pytest.fixture
def write_plan(tmp_path: Path) -> Callable[[str, str], Path]:
    def write(text: str, name: str = "plan.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write
