"""vLLM's priority scheduling in the engine model: each replica's queue longest-predicted-first (issue 48)."""

from __future__ import annotations

import numpy as np
import pytest

from tailsieve_verl.core.data.trace import Group
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.engine.replica import evaluate_samples, makespan_below, priority_admission_order
from tailsieve_verl.core.routing.policies import least_inflight_assignment


def test_groups_sorted_by_decreasing_priority_ties_in_submission_order_routing_kept():
    groups = [Group("a", (1, 2)), Group("b", (3,)), Group("c", (4, 5, 6)), Group("d", (7,))]
    routed = np.array([0, 1, 0, 1, 0, 1, 0])
    out = priority_admission_order(groups, routed, [1.0, 5.0, 1.0, 3.0])
    assert [g.prompt_id for g in out.groups] == ["b", "d", "a", "c"]
    assert out.group_order.tolist() == [1, 3, 0, 2]
    # every sample keeps its replica (a: 0, 1; b: 0; c: 1, 0, 1; d: 0), listed in the new group order
    assert out.sample_replica.tolist() == [0, 0, 0, 1, 1, 0, 1]
    with pytest.raises(ValueError, match="one value per group"):
        priority_admission_order(groups, routed, [1.0, 2.0])
    with pytest.raises(ValueError, match="7 entries for 6 samples"):
        priority_admission_order(groups[:3], routed, [1.0, 2.0, 3.0])


def _step(n_short: int, short: int, long: int, n: int = 4) -> list[Group]:
    """Short groups submitted first, one long group last (its samples spread over the replicas)."""
    return [Group(f"s{i}", (short,) * n, 200) for i in range(n_short)] + [Group("long", (long,) * n, 200)]


def test_longest_first_shortens_a_step_that_queues():
    perf = parse_perf_model("table:h200-dense:qwen3-8b")
    engine = EngineConfig.verl_defaults("qwen3-8b", perf, max_num_seqs=4)  # the real scheduler, a small cap
    groups = _step(n_short=8, short=600, long=3000)  # 36 samples on 2 replicas: 18 each, 4 at a time
    routed = least_inflight_assignment(sum(g.n for g in groups), 2)
    fcfs = evaluate_samples(groups, routed, 2, perf, engine)
    prio = priority_admission_order(groups, routed, [g.max_len for g in groups])
    first = evaluate_samples(prio.groups, prio.sample_replica, 2, perf, engine)
    assert first.makespan_s < 0.8 * fcfs.makespan_s  # the long samples no longer wait behind 4 rounds of short ones
    assert makespan_below(prio.groups, prio.sample_replica, 2, perf, engine) == first.makespan_s
    assert np.all(first.admit_s[:4] == 0.0) and np.all(fcfs.admit_s[-4:] > 0.0)  # the long group's samples
    assert sum(e.queue_wait_s for e in first.replica_events) > 0  # the short ones wait now


def test_no_queueing_below_the_cap_leaves_the_step_unchanged():
    perf = parse_perf_model("table:h200-dense:qwen3-8b")
    engine = EngineConfig.verl_defaults("qwen3-8b", perf)  # max_num_seqs 256, KV for far more than this step
    groups = _step(n_short=30, short=600, long=3000, n=8)  # 248 samples on 2 replicas: 124 each, all admitted at once
    routed = least_inflight_assignment(sum(g.n for g in groups), 2)
    fcfs = evaluate_samples(groups, routed, 2, perf, engine)
    prio = priority_admission_order(groups, routed, [g.max_len for g in groups])
    first = evaluate_samples(prio.groups, prio.sample_replica, 2, perf, engine)
    assert all(e.preemptions == 0 for e in fcfs.replica_events + first.replica_events)
    assert first.makespan_s == pytest.approx(fcfs.makespan_s, rel=1e-9)
    back = np.empty(len(groups))
    back[prio.group_order] = first.group_finish_s
    np.testing.assert_allclose(back, fcfs.group_finish_s, rtol=1e-9)
