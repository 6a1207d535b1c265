"""Imports go one way: commands → stages → llm, and any of them may use engine; engine uses none of them.

Read from the source (every `import` and `from … import`, relative ones resolved), so a forbidden import
fails here even when no test happens to execute it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"engine", "stages", "llm", "commands"}
FORBIDDEN = {
    "engine": {"stages", "llm", "commands"},
    "llm": {"engine", "stages", "commands"},
    "stages": {"commands"},
    "commands": set(),
}


def imported_layers(source: str, layer: str, package: tuple[str, ...] = ()) -> set[tuple[str, int]]:
    """(layer, line) of each import of a layer, in a module of `layer` whose subpackage is `package`."""
    found: set[tuple[str, int]] = set()
    where = ["llmplan", layer, *package]  # installed, layer X is llmplan.X
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = where[: len(where) - (node.level - 1)] if node.level else []
            names = [".".join([*base, node.module or ""]).strip(".")]
        for name in names:
            parts = name.split(".")
            if parts[0] == "llmplan" and len(parts) > 1:
                parts = parts[1:]
            if parts[0] in LAYERS:
                found.add((parts[0], node.lineno))
    return found


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_no_layer_imports_against_the_direction(layer: str) -> None:
    wrong = []
    for path in sorted((REPO / layer).rglob("*.py")):
        package = path.relative_to(REPO / layer).parent.parts
        for target, line in imported_layers(path.read_text(encoding="utf-8"), layer, package):
            if target in FORBIDDEN[layer]:
                wrong.append(f"{path.relative_to(REPO)}:{line}: imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_shared_top_package_imports_no_layer() -> None:
    """llmplan/*.py (what every layer shares, e.g. the bounded reader) depends on none of the layers; its
    __main__.py (`python -m llmplan`) is the program itself, imported by no layer, so it may start the CLI."""
    wrong = [
        f"{path.relative_to(REPO)}:{line}: imports {target}"
        for path in sorted((REPO / "llmplan").glob("*.py"))
        if path.name != "__main__.py"
        for target, line in imported_layers(path.read_text(encoding="utf-8"), "llmplan")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_forbidden_import() -> None:
    source = "from llmplan.stages.slots import InferenceContext\nfrom ..llm import model\nfrom . import graph\n"
    assert {t for t, _ in imported_layers(source, "engine")} == {"stages", "llm", "engine"}
    assert {t for t, _ in imported_layers("from ...commands import serve\n", "stages", ("bench",))} == {"commands"}
