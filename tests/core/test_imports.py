"""The core's modules import each other without a cycle (function-level imports included), and its
concepts form layers: data <- engine <- {routing, tailsieve} <- simulation, no import pointing up."""

from __future__ import annotations

import tailsieve_verl.core as core
from import_graph import assert_no_cycle, module_imports
from tailsieve_verl.core.data.trace import Group, Trace, TraceError, iter_records, read_trace, write_trace

LAYERS = {"data": 0, "engine": 1, "routing": 2, "tailsieve": 2, "simulation": 3}  # errors, kinds: below all


def _layer(module: str) -> tuple[str, int]:
    concept = module.split(".")[0]
    return concept, LAYERS.get(concept, -1)


def test_no_import_cycle_in_the_core():
    graph = module_imports(core)
    assert "engine.engine" in graph["engine.replica"]  # the scan sees the imports (a sanity check of the test)
    assert_no_cycle(graph)


def _upward(graph: dict[str, set[str]]) -> list[str]:
    upward = []
    for module, targets in graph.items():
        concept, level = _layer(module)
        if level < 0:
            continue  # core/__init__ re-exports; errors and kinds import nothing of the core
        for target in targets:
            t_concept, t_level = _layer(target)
            if t_concept != concept and t_level >= level:
                upward.append(f"{module} -> {target}")
    return sorted(upward)


def test_every_core_import_points_down_the_layers():
    graph = module_imports(core)
    assert set(LAYERS) <= {m.split(".")[0] for m in graph}, "a concept's subpackage is missing"
    assert _upward({"engine.replica": {"data.trace"}, "routing.policies": {"tailsieve.selector"}}) == [
        "routing.policies -> tailsieve.selector"]  # the check sees a sideways import
    upward = _upward(graph)
    assert not upward, "imports pointing up or sideways between concepts: " + ", ".join(upward)


def test_errors_and_kinds_import_nothing_of_the_core():
    graph = module_imports(core)
    assert not graph["errors"] and not graph["kinds"]


def test_the_trace_module_still_exports_the_types_and_readers():
    assert Group.__module__ == Trace.__module__ == TraceError.__module__ == "tailsieve_verl.core.data.groups"
    assert iter_records.__module__ == "tailsieve_verl.core.data.records"
    assert callable(read_trace) and callable(write_trace)
