"""The replica evaluator against a naive step-by-step reference simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tailsieve_verl.core.engine.engine import EngineConfig, EngineConfigError
from tailsieve_verl.core.engine.perf import LinearPerf, parse_perf_model
from tailsieve_verl.core.engine.replica import (evaluate_assignment, evaluate_samples, makespan_below,
                                                 simulate_replica)
from tailsieve_verl.core.data.trace import Group


def naive_replica(lengths, perf, prompt_lens, max_num_seqs):
    """One decode step at a time: FIFO admission into free slots, every active request emits a token."""
    n = len(lengths)
    cap = n if max_num_seqs is None else max_num_seqs
    waiting = [i for i in range(n)]
    produced = [0] * n
    active: list[int] = []
    finish = [0.0] * n
    clock = 0.0
    while waiting or active:
        while waiting and len(active) < cap:
            i = waiting.pop(0)
            if lengths[i] == 0:
                finish[i] = clock
                continue
            active.append(i)
        if not active:
            break
        ctx = np.mean([prompt_lens[i] + produced[i] for i in active])
        clock += float(perf.step_time(np.array([len(active)]), np.array([ctx]))[0])
        for i in active:
            produced[i] += 1
        done = [i for i in active if produced[i] == lengths[i]]
        for i in done:
            finish[i] = clock
        active = [i for i in active if produced[i] < lengths[i]]
    return clock, np.array(finish)


@pytest.mark.parametrize("seed", range(12))
def test_matches_naive_simulation_with_and_without_cap(seed):
    rng = np.random.default_rng(seed)
    perf = [LinearPerf(0.01, 0.001), parse_perf_model("table:h200-dense"), parse_perf_model("table:h200-moe")][seed % 3]
    n = int(rng.integers(1, 25))
    lengths = [int(v) for v in rng.integers(0, 120, size=n)]
    prompts = [int(v) for v in rng.integers(0, 3000, size=n)]
    cap = [None, 1, 3, 7][seed % 4]
    run = simulate_replica(lengths, perf, prompts, EngineConfig(max_num_seqs=cap))
    clock, finish = naive_replica(lengths, perf, prompts, cap)
    assert run.completion_s == pytest.approx(clock, rel=1e-9, abs=1e-12)
    np.testing.assert_allclose(run.finish_s, finish, rtol=1e-9, atol=1e-12)


def test_cap_serialises_requests():
    perf = LinearPerf(1.0, 0.0)
    assert simulate_replica([5, 5, 5], perf, engine=EngineConfig(max_num_seqs=1)).completion_s == pytest.approx(15.0)
    assert simulate_replica([5, 5, 5], perf, engine=EngineConfig(max_num_seqs=3)).completion_s == pytest.approx(5.0)


def test_evaluate_assignment_closed_form_and_bookkeeping():
    a, c = 0.02, 0.0005
    groups = [Group("a", (100, 10)), Group("b", (50,)), Group("c", (30, 30, 30))]
    ev = evaluate_assignment(groups, [0, 1, 1], 3, LinearPerf(a, c))
    assert ev.replica_times_s[0] == pytest.approx(a * 100 + c * 110)
    assert ev.replica_times_s[1] == pytest.approx(a * 50 + c * 140)
    assert ev.replica_times_s[2] == 0.0
    assert ev.makespan_s == max(ev.replica_times_s)
    assert [len(x) for x in ev.response_finish_s] == [2, 1, 3]
    assert ev.group_finish_s[0] == pytest.approx(ev.replica_times_s[0])


@pytest.mark.parametrize("assignment, needle", [([0, 1], "2 entries for 3 groups"), ([0, 1, 5], "outside 0..2")])
def test_bad_assignment(assignment, needle):
    groups = [Group("a", (1,)), Group("b", (2,)), Group("c", (3,))]
    with pytest.raises(ValueError, match=needle):
        evaluate_assignment(groups, assignment, 3, LinearPerf(1, 0))


def test_bad_replica_inputs():
    with pytest.raises(ValueError, match=">= 0"):
        simulate_replica([3, -1], LinearPerf(1, 0))
    with pytest.raises(EngineConfigError, match="max_num_seqs"):
        simulate_replica([3], LinearPerf(1, 0), engine=EngineConfig(max_num_seqs=0))


def test_makespan_below_is_the_evaluators_makespan_or_inf_once_a_replica_passes_the_bound():
    """The candidate searches' early stop: the same makespan as evaluate_samples under a bound it
    meets, math.inf as soon as one replica passes a bound it does not."""
    perf = parse_perf_model("table:h200-dense")
    rng = np.random.default_rng(5)
    groups = [Group(f"p{i}", tuple(int(x) for x in rng.integers(50, 3000, 4)), 256) for i in range(12)]
    samples = rng.integers(0, 3, 48)
    engines = [EngineConfig(max_num_seqs=8), EngineConfig(), EngineConfig(max_num_seqs=4)]
    full = evaluate_samples(groups, samples, 3, perf, engine=engines).makespan_s
    assert makespan_below(groups, samples, 3, perf, engines) == full
    assert makespan_below(groups, samples, 3, perf, engines, stop_above=full) == full
    assert makespan_below(groups, samples, 3, perf, engines, stop_above=0.999 * full) == math.inf
