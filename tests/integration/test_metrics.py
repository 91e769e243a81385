"""The trainer's step metrics predict with the pools' engine models (one model of a replica)."""

from __future__ import annotations

from tailsieve_verl.core.tailsieve.controller import GroupRecord
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import LinearPerf
from tailsieve_verl.integration.config import parse_tailsieve_section
from tailsieve_verl.integration.engine_config import pool_engine_models
from tailsieve_verl.integration.metrics import predicted_makespans

PERF = LinearPerf(0.01, 0.0001)


def _records(lengths_per_group):
    return [GroupRecord(lengths=tuple(lengths), finish_s=0.0) for lengths in lengths_per_group]


def test_predictions_are_unchanged_when_no_limit_binds_and_follow_each_pools_cap():
    tail = _records([(300, 280, 250, 10)])
    bulk = _records([(120, 100, 90, 80)] * 7)
    today = predicted_makespans(tail, bulk, 1, 4, PERF, 16.0)
    roomy = EngineConfig(max_num_seqs=10 ** 6, num_gpu_blocks=10 ** 9)
    assert predicted_makespans(tail, bulk, 1, 4, PERF, 16.0, False, roomy, roomy) == today
    # a tail pool serving one request at a time slows the split only; a bulk cap of one slows stock verl and
    # uniform routing (every replica is bulk there) and the split's bulk replicas
    verl, uniform, split = predicted_makespans(tail, bulk, 1, 4, PERF, 16.0, False, EngineConfig(max_num_seqs=1))
    assert (verl, uniform) == today[:2] and split > 2 * today[2]
    capped = predicted_makespans(tail, bulk, 1, 4, PERF, 16.0, False, EngineConfig(), EngineConfig(max_num_seqs=1))
    assert capped[0] > 1.5 * today[0] and capped[1] > 1.5 * today[1] and capped[2] > 1.5 * today[2]


def test_pool_engine_models_take_each_pools_cap_else_verls():
    settings = parse_tailsieve_section({"tail": {"max_num_seqs": 8}})
    assert pool_engine_models(settings, 256) == (EngineConfig(max_num_seqs=8), EngineConfig(max_num_seqs=256))


def test_at_m_0_a_launched_tail_engine_is_predicted_idle_not_lent_to_the_bulk():
    """A step with nothing carried on per-pool engines: the replica launched with the tail engine serves
    nothing (the trainer keeps it from the bulk route), so the split's prediction is the bulk engine on
    the other replicas, not the tail engine's share of one shared pool."""
    from tailsieve_verl.core.routing.policies import evaluate_samples, pool_assignment
    from tailsieve_verl.integration.metrics import _groups

    bulk = _records([(120, 100, 90, 80)] * 8)
    slow_tail = EngineConfig(max_num_seqs=1)
    _, _, held = predicted_makespans([], bulk, 0, 4, PERF, 16.0, False, slow_tail, EngineConfig(), launched_tail=1)
    groups = _groups(bulk, "b", 16.0)
    three = evaluate_samples(groups, pool_assignment(groups, 3), 3, PERF, EngineConfig()).makespan_s
    assert held == three
    _, _, shared = predicted_makespans([], bulk, 0, 4, PERF, 16.0, False, slow_tail, EngineConfig())
    assert shared < held  # without per-pool engines every replica is one shared pool
