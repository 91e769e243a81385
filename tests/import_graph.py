"""The import graph of one package's modules (function-level imports included), for the tests that
keep a layer's modules importing each other in one direction."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType


def module_imports(package: ModuleType) -> dict[str, set[str]]:
    """Each module of ``package`` -> the sibling modules it imports (relatively or by full name)."""
    prefix = package.__name__ + "."
    graph: dict[str, set[str]] = {}
    for path in Path(package.__file__).parent.glob("*.py"):
        if path.stem == "__init__":
            continue
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                targets.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefix):
                targets.add(node.module[len(prefix):].split(".")[0])
            elif isinstance(node, ast.Import):
                targets |= {a.name[len(prefix):].split(".")[0] for a in node.names if a.name.startswith(prefix)}
        graph[path.stem] = targets - {path.stem}
    return graph


def assert_no_cycle(graph: dict[str, set[str]]) -> None:
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
