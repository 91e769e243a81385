"""When no limit binds, the vLLM-v1 replica scheduler gives today's closed form bit for bit.

``EngineConfig()`` (today's callers) takes the closed form itself; a scheduler forced onto the same
cases — directly, or through limits set too high to bind — must reproduce its floats exactly, so
the two evaluators are one model."""

from __future__ import annotations

import numpy as np
import pytest

from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import LinearPerf, parse_perf_model
from tailsieve_verl.core.routing.policies import least_inflight_assignment
from tailsieve_verl.core.engine.replica import _closed_form, evaluate_samples, simulate_replica
from tailsieve_verl.core.engine.scheduler import ReplicaScheduler
from tailsieve_verl.core.data.workload import PromptPool

PERFS = [LinearPerf(0.01, 0.001), parse_perf_model("table:h200-dense"), parse_perf_model("table:h200-moe")]


def assert_same_run(a, b):
    assert a.completion_s == b.completion_s and a.steps == b.steps
    np.testing.assert_array_equal(a.finish_s, b.finish_s)
    np.testing.assert_array_equal(a.admit_s, b.admit_s)


@pytest.mark.parametrize("seed", range(40))
def test_scheduler_equals_the_closed_form_on_random_replicas(seed):
    # the configurations of test_replica.py's naive comparison, wider: caps binding or not, zero lengths
    rng = np.random.default_rng(seed)
    perf = PERFS[seed % 3]
    n = int(rng.integers(1, 80))
    lengths = rng.integers(0, 400, size=n)
    groups = np.arange(n) // 4
    prompts = rng.integers(0, 3000, size=groups[-1] + 1)[groups]  # a group's requests share its prompt
    cap = [None, 1, 3, 7, 40][seed % 5]
    closed = _closed_form(lengths, prompts, perf, cap)
    assert_same_run(ReplicaScheduler(lengths, prompts, groups, EngineConfig(max_num_seqs=cap)).run_to_end(perf), closed)
    roomy = EngineConfig(max_num_seqs=cap, num_gpu_blocks=10 ** 9, max_num_batched_tokens=10 ** 9)
    assert_same_run(ReplicaScheduler(lengths, prompts, groups, roomy).run_to_end(perf), closed)


@pytest.mark.parametrize("perf", PERFS[1:], ids=["dense", "moe"])
def test_a_full_step_is_unchanged_when_no_limit_binds(perf):
    # 64 groups x 8 on 8 replicas, stock verl's routing: today's evaluation, the default engine and
    # limits too roomy to bind (which walk the scheduler) agree to the last bit
    rng = np.random.default_rng(3)
    groups = PromptPool("real", 256, seed=1).sample_batch(64, 8, 0, rng)
    samples = least_inflight_assignment(64 * 8, 8, rng=rng)
    today = evaluate_samples(groups, samples, 8, perf)
    for engine in (EngineConfig(), EngineConfig(num_gpu_blocks=10 ** 9), EngineConfig(max_num_batched_tokens=10 ** 9),
                   EngineConfig(max_num_seqs=10 ** 6, num_gpu_blocks=10 ** 9, max_num_batched_tokens=10 ** 9)):
        ev = evaluate_samples(groups, samples, 8, perf, engine=engine)
        assert ev.makespan_s == today.makespan_s and ev.replica_times_s == today.replica_times_s
        np.testing.assert_array_equal(np.concatenate(ev.response_finish_s), np.concatenate(today.response_finish_s))
        np.testing.assert_array_equal(ev.group_finish_s, today.group_finish_s)


# ---- every consumer takes the engine: the same bits where no limit binds

ROOMY = (EngineConfig(max_num_seqs=10 ** 6), EngineConfig(num_gpu_blocks=10 ** 9),
         EngineConfig(max_num_seqs=10 ** 6, num_gpu_blocks=10 ** 9, max_num_batched_tokens=10 ** 9))


@pytest.mark.parametrize("policy, kwargs", [("verl", {}), ("uniform", {}), ("uniform-oracle", {}),
                                            ("topk-balanced", {"k": 3, "tail_replicas": 1})])
def test_routing_policies_are_unchanged_when_no_limit_binds(policy, kwargs):
    from tailsieve_verl.core.routing.policies import route

    perf = PERFS[1]
    groups = PromptPool("real", 64, seed=2).sample_batch(16, 4, 0, np.random.default_rng(5))
    today = route(policy, groups, 4, perf, **kwargs)
    for engine in ROOMY:
        again = route(policy, groups, 4, perf, engine=engine, **kwargs)
        assert again.makespan_s == today.makespan_s and again.evaluation.replica_times_s == today.evaluation.replica_times_s
        np.testing.assert_array_equal(again.sample_assignment, today.sample_assignment)


def test_searches_and_set_costs_agree_when_no_limit_binds():
    # best-k and the exact search score sets with the cost table, or under an engine that binds beyond the cap
    # with the scheduler itself: the same assignment and makespan either way
    from tailsieve_verl.core.routing.oracle import SetCost
    from tailsieve_verl.core.routing.policies import route

    perf = PERFS[1]
    groups = PromptPool("real", 64, seed=4).sample_batch(10, 2, 0, np.random.default_rng(6))
    table, walked = SetCost(groups, perf), SetCost(groups, perf, ROOMY[1])
    assert table.table is not None and walked.table is None
    for members in ([0], [1, 2, 3], list(range(10))):
        assert walked.cost(members) == pytest.approx(table.cost(members), rel=1e-12)
    for policy in ("best-k", "exact"):
        today = route(policy, groups, 3, perf, time_limit_s=2.0)
        again = route(policy, groups, 3, perf, engine=ROOMY[1], time_limit_s=2.0)
        assert again.makespan_s == pytest.approx(today.makespan_s, rel=1e-12)


def test_a_binding_engine_reaches_routing_set_costs_and_the_study():
    # the engine is not dropped on the way: a cap of one running request serialises each replica
    from tailsieve_verl.core.routing.oracle import SetCost
    from tailsieve_verl.core.routing.policies import route
    from tailsieve_verl.core.routing.study import StudyConfig, run_study

    perf, serial = PERFS[0], EngineConfig(max_num_seqs=1)
    groups = PromptPool("real", 64, seed=2).sample_batch(8, 4, 0, np.random.default_rng(1))
    for policy, kwargs in (("verl", {}), ("uniform", {}), ("best-k", {}), ("exact", {"time_limit_s": 1.0})):
        free, capped = route(policy, groups, 2, perf, **kwargs), route(policy, groups, 2, perf, engine=serial, **kwargs)
        assert capped.makespan_s > 1.5 * free.makespan_s, policy
        assert capped.makespan_s == evaluate_samples(groups, capped.sample_assignment, 2, perf, serial).makespan_s
    lengths = [v for g in groups[:2] for v in g.lengths]
    prompts = [g.prompt_len for g in groups[:2] for _ in g.lengths]
    serial_cost = SetCost(groups, perf, serial).cost([0, 1])
    assert serial_cost == simulate_replica(lengths, perf, prompts, serial, [0] * 4 + [1] * 4).completion_s
    assert serial_cost > 1.5 * SetCost(groups, perf).cost([0, 1])
    study = dict(instances=2, trajectories=8, group_size=2, replicas=2, perf_model="linear:a=0.01,c=0.001",
                 time_limit_s=0.3)
    free = run_study(StudyConfig(**study)).instances[0].makespan_s
    capped = run_study(StudyConfig(**study, engine=serial)).instances[0].makespan_s
    assert all(capped[p] > 1.5 * free[p] for p in free)
