"""When no limit binds, the vLLM-v1 replica scheduler gives today's closed form bit for bit.

``EngineConfig()`` (today's callers) takes the closed form itself; a scheduler forced onto the same
cases — directly, or through limits set too high to bind — must reproduce its floats exactly, so
the two evaluators are one model."""

from __future__ import annotations

import numpy as np
import pytest

from tailsieve_verl.core.engine import EngineConfig
from tailsieve_verl.core.perf import LinearPerf, parse_perf_model
from tailsieve_verl.core.policies import least_inflight_assignment
from tailsieve_verl.core.replica import _closed_form, evaluate_samples
from tailsieve_verl.core.scheduler import ReplicaScheduler
from tailsieve_verl.core.workload import PromptPool

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
    prompts = rng.integers(0, 3000, size=n)
    cap = [None, 1, 3, 7, 40][seed % 5]
    groups = np.arange(n) // 4
    closed = _closed_form(lengths, prompts, perf, cap)
    assert_same_run(ReplicaScheduler(lengths, prompts, groups, EngineConfig(), cap).run_to_end(perf), closed)
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
