"""The core's modules import each other without a cycle (function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import tailsieve_verl.core as core
from tailsieve_verl.core.trace import Group, Trace, TraceError, iter_records, read_trace, write_trace


def _core_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in Path(core.__file__).parent.glob("*.py"):
        if path.stem == "__init__":
            continue
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                targets.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tailsieve_verl.core."):
                targets.add(node.module.split(".")[2])
        graph[path.stem] = targets
    return graph


def test_no_import_cycle_in_the_core():
    graph = _core_imports()
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


def test_the_trace_module_still_exports_the_types_and_readers():
    assert Group.__module__ == Trace.__module__ == TraceError.__module__ == "tailsieve_verl.core.groups"
    assert iter_records.__module__ == "tailsieve_verl.core.records"
    assert callable(read_trace) and callable(write_trace)
