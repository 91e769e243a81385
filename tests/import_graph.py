"""The import graph of one package's modules, subpackages included (function-level imports too),
for the tests that keep a layer's modules importing each other in one direction."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType


def module_imports(package: ModuleType) -> dict[str, set[str]]:
    """Each module of ``package`` by its dotted name below it (``engine.replica``) -> the modules of
    ``package`` it imports at run time, relatively or by full name (``if TYPE_CHECKING:`` blocks aside)."""
    root = Path(package.__file__).parent
    names = {".".join(p.relative_to(root).with_suffix("").parts) for p in root.rglob("*.py")}
    names = {n.removesuffix(".__init__") for n in names if n != "__init__"}

    def known(parts: list[str]) -> str | None:
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in names:
                return ".".join(parts[:end])
        return None

    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_init else parts)
        if not name:
            continue
        here = parts[:-1]  # the package the module sits in
        targets = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and getattr(block.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue  # annotations only: not imported at run time
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)] if node.level > 1 else list(here)
                    if node.level - 1 > len(here):
                        continue  # above the package
                elif (node.module or "").startswith(package.__name__ + "."):
                    base = []
                else:
                    continue
                module = (node.module or "")
                if not node.level:
                    module = module[len(package.__name__) + 1:]
                stem = base + (module.split(".") if module else [])
                for alias in node.names:
                    target = known(stem + [alias.name]) or known(stem)
                    if target:
                        targets.add(target)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(package.__name__ + "."):
                        target = known(a.name[len(package.__name__) + 1:].split("."))
                        if target:
                            targets.add(target)
        graph[name] = targets - {name}
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
