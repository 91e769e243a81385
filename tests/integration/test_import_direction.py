"""The integration modules import each other in one direction only (function-level imports included):
a cycle such as checkpoint <-> trainer makes each half of it unreadable without the other."""

from __future__ import annotations

import tailsieve_verl.integration as integration
from import_graph import assert_no_cycle, module_imports


def test_no_import_cycle_among_the_integration_modules():
    graph = module_imports(integration)
    assert "trainer" in graph["rollout_only"]  # the scan sees the imports (a sanity check of the test)
    assert_no_cycle(graph)


def test_a_cycle_is_found():
    try:
        assert_no_cycle({"checkpoint": {"trainer"}, "trainer": {"checkpoint"}})
    except AssertionError as exc:
        assert "checkpoint -> trainer -> checkpoint" in str(exc)
    else:
        raise AssertionError("the cycle went unseen")
