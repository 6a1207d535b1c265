"""Functions stay short enough to read at once: over 60 lines only with a `# long: why` line above the `def`
(or its decorators), and no more than 10 such outside tests (issue 53)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("llm", "engine", "stages", "commands", "llmplan", "benchmarks")
MAX_LINES, MAX_LONG = 60, 10


def long_functions(source: str) -> list[tuple[str, int, int, bool]]:
    """(name, line, length, has a reason) of each function over MAX_LINES lines."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_LINES:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                reason = first >= 2 and lines[first - 2].strip().startswith("# long:")
                found.append((node.name, node.lineno, length, reason))
    return found


def test_long_functions_are_few_and_say_why() -> None:
    found = [
        (f"{path.relative_to(REPO)}:{line} {name} ({length} lines)", reason)
        for root in ROOTS
        for path in sorted((REPO / root).rglob("*.py"))
        for name, line, length, reason in long_functions(path.read_text(encoding="utf-8"))
    ]
    unexplained = [where for where, reason in found if not reason]
    assert not unexplained, "over 60 lines without a '# long: why' line above:\n" + "\n".join(unexplained)
    assert len(found) <= MAX_LONG, "\n".join(where for where, _ in found)


def test_the_check_sees_a_long_function_and_its_reason() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    assert long_functions(f"def f():\n{body}\n") == [("f", 1, 62, False)]
    assert long_functions(f"# long: a table\n@cache\ndef f():\n{body}\n") == [("f", 3, 62, True)]
