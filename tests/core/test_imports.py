"""The core's modules import each other without a cycle (function-level imports included)."""

from __future__ import annotations

import tailsieve_verl.core as core
from import_graph import assert_no_cycle, module_imports
from tailsieve_verl.core.trace import Group, Trace, TraceError, iter_records, read_trace, write_trace


def test_no_import_cycle_in_the_core():
    graph = module_imports(core)
    assert "engine" in graph["replica"]  # the scan sees the imports (a sanity check of the test)
    assert_no_cycle(graph)


def test_the_trace_module_still_exports_the_types_and_readers():
    assert Group.__module__ == Trace.__module__ == TraceError.__module__ == "tailsieve_verl.core.groups"
    assert iter_records.__module__ == "tailsieve_verl.core.records"
    assert callable(read_trace) and callable(write_trace)
