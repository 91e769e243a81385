"""The integration modules import each other in one direction only (function-level imports included):
a cycle such as checkpoint <-> trainer makes each half of it unreadable without the other."""

from __future__ import annotations

import ast
from pathlib import Path

import tailsieve_verl.integration as integration

PACKAGE = "tailsieve_verl.integration."


def _integration_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in Path(integration.__file__).parent.glob("*.py"):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                targets.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                targets.add(node.module[len(PACKAGE):].split(".")[0])
            elif isinstance(node, ast.Import):
                targets |= {a.name[len(PACKAGE):].split(".")[0] for a in node.names if a.name.startswith(PACKAGE)}
        graph[path.stem] = targets - {path.stem}
    return graph


def test_no_import_cycle_among_the_integration_modules():
    graph = _integration_imports()
    assert "trainer" in graph["rollout_only"]  # the scan sees the imports (a sanity check of the test)
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
