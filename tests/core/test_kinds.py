"""Pools and decision kinds are enums whose values are the strings outputs and checkpoints hold."""

from __future__ import annotations

import json

from tailsieve_verl.core.tailsieve.controller import ControllerConfig, Decision, HierarchicalController
from tailsieve_verl.core.kinds import DecisionKind, Pool
from tailsieve_verl.core.engine.perf import LinearPerf
from tailsieve_verl.core.tailsieve.selector import TailSelector


def test_a_member_is_its_string_in_comparisons_formatting_and_json():
    assert [p.value for p in Pool] == ["tail", "bulk", "any"]
    assert Pool.TAIL == "tail" and Pool("bulk") is Pool.BULK and {"tail": 1}[Pool.TAIL] == 1
    assert f"{Pool.TAIL}/{Pool.BULK}" == "tail/bulk" and str(DecisionKind.OUTER) == "outer"
    assert json.loads(json.dumps({Pool.TAIL: [Pool.BULK, DecisionKind.HOLD]})) == {"tail": ["bulk", "hold"]}


def test_a_decision_names_its_kind():
    assert Decision(0, 0, "uniform").kind is DecisionKind.FIXED  # set by the caller
    controller = HierarchicalController(ControllerConfig(m_init=2), 8, 64, LinearPerf(0.01, 0.0001))
    assert controller.decision.kind is DecisionKind.CURRENT


def test_consumed_groups_carry_their_pool():
    selector = TailSelector(4)
    plan = selector.plan_step(0)
    out = selector.finish_step(plan, ["a", "b", "c", "d"], ["a", "b", "c", "d"], policy_version=0)
    assert {c.route for c in out.consumed} == {Pool.BULK}
    assert json.dumps([c.route for c in out.consumed]) == '["bulk", "bulk", "bulk", "bulk"]'
