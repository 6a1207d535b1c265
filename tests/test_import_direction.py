"""Imports go one way: commands → stages → llm, and any of them may use engine; engine uses none of them.
Inside llm/ the sub-packages are layers too (`LLM_LAYERS`, lowest first), and llm/ and engine/ hold no import
cycle between modules, type-only (`if TYPE_CHECKING:`) and late (inside a function) imports counted: a cycle
kept alive by such an import is still two modules that cannot be read, tested or moved apart.

Read from the source (every `import` and `from … import`, relative ones resolved), so a forbidden import
fails here even when no test happens to execute it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
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


# llm/'s sub-packages, lowest first: each may import its own package and those before it, never one after it
LLM_LAYERS = ("kernels", "trust", "text", "model", "formats", "kv", "sampling", "generation", "evaluation")


def imported_modules(source: str, module: str, is_package: bool) -> set[tuple[str, int]]:
    """(module or package, line) of every llmplan import in `module`, relative ones resolved; for
    `from X import name` both X and X.name (which may be a module)."""
    found: set[tuple[str, int]] = set()
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            found.add((target, node.lineno))
            found.update((f"{target}.{alias.name}", node.lineno) for alias in node.names)
    return {(name, line) for name, line in found if name.startswith("llmplan.")}


def layer_modules(layer: str) -> dict[str, Path]:
    modules = {}
    for path in sorted((REPO / layer).rglob("*.py")):
        parts = ["llmplan", layer, *path.relative_to(REPO / layer).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(layer: str) -> nx.DiGraph:
    modules = layer_modules(layer)
    graph = nx.DiGraph()
    for module, path in modules.items():
        source = path.read_text(encoding="utf-8")
        for target, _ in imported_modules(source, module, path.name == "__init__.py"):
            if target in modules and target != module:
                graph.add_edge(module, target)
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


@pytest.mark.parametrize("layer", ["llm", "engine"])
def test_no_import_cycle_inside_the_layer(layer: str) -> None:
    found = cycles(import_graph(layer))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_sees_a_type_only_cycle() -> None:
    a = imported_modules("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n", "llmplan.x.a", False)
    b = imported_modules("def f():\n    from .a import A\n", "llmplan.x.b", False)
    graph = nx.DiGraph([("llmplan.x.a", t) for t, _ in a] + [("llmplan.x.b", t) for t, _ in b])
    graph.remove_nodes_from([n for n in list(graph) if n not in {"llmplan.x.a", "llmplan.x.b"}])
    assert cycles(graph) == [["llmplan.x.a", "llmplan.x.b"]]


def test_llm_sub_packages_import_only_downward() -> None:
    assert {p.name for p in (REPO / "llm").iterdir() if (p / "__init__.py").exists()} == set(LLM_LAYERS)
    wrong = []
    for module, path in layer_modules("llm").items():
        parts = module.split(".")
        if len(parts) < 3:
            continue  # llm/__init__.py
        own = LLM_LAYERS.index(parts[2])
        for target, line in imported_modules(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            tparts = target.split(".")
            if tparts[:2] == ["llmplan", "llm"] and len(tparts) > 2 and LLM_LAYERS.index(tparts[2]) > own:
                wrong.append(f"{path.relative_to(REPO)}:{line}: llm/{parts[2]} imports llm/{tparts[2]}")
    assert not wrong, "\n".join(sorted(set(wrong)))


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


def llm_packages() -> list[str]:
    return sorted(
        ".".join(("llmplan", "llm", *p.parent.relative_to(REPO / "llm").parts))
        for p in (REPO / "llm").rglob("__init__.py")
        if p.parent != REPO / "llm"
    )


@pytest.mark.parametrize("package", llm_packages())
def test_each_llm_package_names_its_surface_and_every_name_resolves(package: str) -> None:
    import importlib

    module = importlib.import_module(package)
    exports = getattr(module, "EXPORTS", {})
    names = list(getattr(module, "__all__", []))
    assert sorted(names) == sorted(exports) and len(set(names)) == len(names)
    for name, where in exports.items():
        assert getattr(module, name) is getattr(importlib.import_module(f"{package}.{where}"), name)


def test_code_outside_llm_imports_a_package_s_public_names_from_the_package() -> None:
    """`from llmplan.llm.kv.cache import KVCache` outside llm/ is refused where `llmplan.llm.kv` names it."""
    import importlib

    exports = {p: getattr(importlib.import_module(p), "EXPORTS", {}) for p in llm_packages()}
    wrong = []
    for root in ("engine", "stages", "commands", "benchmarks", "llmplan"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    package, _, leaf = node.module.rpartition(".")
                    for alias in node.names:
                        if exports.get(package, {}).get(alias.name) == leaf:
                            wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {alias.name} from {package}")
    assert not wrong, "\n".join(wrong)
