"""Exact oracle: equals brute force on many random small instances; anytime bounds are valid."""

from __future__ import annotations

import numpy as np
import pytest

from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.routing.oracle import OracleError, SetCost, StepCostTable, brute_force, solve_exact
from tailsieve_verl.core.engine.perf import LinearPerf, parse_perf_model
from tailsieve_verl.core.engine.replica import simulate_replica
from tailsieve_verl.core.data.trace import Group

PERFS = {
    "linear": LinearPerf(0.01, 0.001),
    "dense": parse_perf_model("table:h200-dense"),
    "moe": parse_perf_model("table:h200-moe"),
    "dense-4b": parse_perf_model("table:h200-dense:qwen3-4b"),  # not monotone in batch (1 → 2)
}


def random_groups(rng, n_groups, max_n=4, max_len=400, prompt_lens=False):
    return [Group(f"p{i}", tuple(int(v) for v in rng.integers(0, max_len, size=rng.integers(1, max_n + 1))),
                  int(rng.integers(0, 2000)) if prompt_lens else 0) for i in range(n_groups)]


@pytest.mark.parametrize("seed", range(40))
def test_exact_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    perf = list(PERFS.values())[seed % len(PERFS)]
    n_replicas = int(rng.integers(1, 5))
    n_groups = int(rng.integers(1, 8 if n_replicas <= 3 else 7))
    engine = EngineConfig(max_num_seqs=2) if seed % 5 == 0 else EngineConfig()
    groups = random_groups(rng, n_groups, prompt_lens=seed % 7 == 0)
    _, expected = brute_force(groups, n_replicas, perf, engine)
    result = solve_exact(groups, n_replicas, perf, engine, time_limit_s=None)
    assert result.optimal
    assert result.makespan_s == pytest.approx(expected, rel=1e-9)
    assert result.lower_bound_s == result.makespan_s


@pytest.mark.parametrize("seed", range(6))
def test_exact_on_twelve_groups_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    groups = random_groups(rng, 12 if seed % 2 else 10, max_n=3)
    n_replicas = 2 if seed % 2 else 3
    perf = PERFS["dense"] if seed % 3 else PERFS["linear"]
    _, expected = brute_force(groups, n_replicas, perf)
    result = solve_exact(groups, n_replicas, perf, time_limit_s=None)
    assert result.optimal and result.makespan_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_step_cost_table_equals_simulated_replica(seed):
    rng = np.random.default_rng(seed)
    perf = list(PERFS.values())[seed % len(PERFS)]
    lengths = rng.integers(0, 3000, size=rng.integers(1, 60))
    prompt = int(rng.integers(0, 500))
    table = StepCostTable(perf, len(lengths), int(lengths.max()), prompt)
    expected = simulate_replica(lengths, perf, [prompt] * len(lengths)).completion_s
    assert table.cost(np.sort(lengths)[::-1]) == pytest.approx(expected, rel=1e-9)
    assert table.envelope_cost(np.sort(lengths)[::-1]) <= expected * (1 + 1e-12)


def test_envelope_never_drops_when_requests_join():
    table = StepCostTable(PERFS["dense-4b"], 40, 500)
    assert not table.monotone
    rng = np.random.default_rng(0)
    base = rng.integers(1, 500, size=10)
    more = np.concatenate([base, rng.integers(1, 500, size=5)])
    low = table.envelope_cost(np.sort(base)[::-1])
    high = table.cost(np.sort(more)[::-1])
    assert low + table.min_extra(more[10:]) <= high * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_unfinished_search_reports_a_valid_lower_bound(seed):
    rng = np.random.default_rng(seed)
    groups = random_groups(rng, 9, max_n=3, max_len=2000)
    perf = PERFS["dense"]
    _, optimum = brute_force(groups, 3, perf)
    result = solve_exact(groups, 3, perf, node_limit=3, time_limit_s=None)
    assert result.lower_bound_s <= optimum * (1 + 1e-9)
    assert optimum <= result.makespan_s * (1 + 1e-9)
    assert result.optimal == (result.lower_bound_s == result.makespan_s)
    assert 0 <= result.gap < 1


def test_incumbent_is_never_worse_than_given_seeds():
    rng = np.random.default_rng(3)
    groups = random_groups(rng, 30, max_n=2, max_len=3000)
    perf = PERFS["dense"]
    cost = SetCost(groups, perf)
    seed_assignment = list(np.arange(30) % 4)
    result = solve_exact(groups, 4, perf, incumbents=[seed_assignment], node_limit=50, time_limit_s=None)
    assert result.makespan_s <= cost.makespan(seed_assignment, 4)
    assert sorted(set(result.assignment.tolist())) <= [0, 1, 2, 3] and len(result.assignment) == 30


@pytest.mark.parametrize("kwargs, needle", [
    ({"n_replicas": 0}, "at least one replica"),
    ({"time_limit_s": 0}, "time limit must be > 0"),
    ({"node_limit": 0}, "node limit must be >= 1"),
])
def test_bad_limits(kwargs, needle):
    args = {"n_replicas": 2, "time_limit_s": 1.0, "node_limit": None} | kwargs
    with pytest.raises(OracleError, match=needle):
        solve_exact([Group("a", (1,))], args.pop("n_replicas"), PERFS["linear"], **args)


def test_brute_force_assignment_achieves_its_value():
    from tailsieve_verl.core.engine.replica import evaluate_assignment

    rng = np.random.default_rng(11)
    groups = random_groups(rng, 6)
    assignment, value = brute_force(groups, 3, PERFS["dense"])
    assert evaluate_assignment(groups, assignment, 3, PERFS["dense"]).makespan_s == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_exact_without_a_cost_table_equals_brute_force(seed, monkeypatch):
    """Large instances run on simulate_replica: bounded by true set costs when the model is
    monotone (dense), exhaustive when it is not (qwen3-4b is faster at batch 2 than at batch 1)."""
    import tailsieve_verl.core.routing.oracle as oracle

    monkeypatch.setattr(oracle, "MAX_TABLE_CELLS", 0)
    rng = np.random.default_rng(200 + seed)
    perf = PERFS["dense"] if seed % 2 else PERFS["dense-4b"]
    groups = random_groups(rng, 7, max_n=3, prompt_lens=seed % 4 == 1)
    cost = SetCost(groups, perf)
    assert cost.table is None and cost.monotone == (seed % 2 == 1 and seed % 4 != 1)
    _, expected = brute_force(groups, 3, perf)
    result = solve_exact(groups, 3, perf, time_limit_s=None, set_cost=cost)
    assert result.optimal and result.makespan_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("seed", range(24))
def test_root_bounds_never_exceed_the_optimum(seed):
    """Pigeonhole, staircase and capacity bounds on skewed instances (a few long responses)."""
    rng = np.random.default_rng(300 + seed)
    perf = list(PERFS.values())[seed % len(PERFS)]
    n_replicas = 2 + seed % 3
    groups = [Group(f"p{i}", tuple(int(v) for v in np.minimum(rng.lognormal(6, 1.2, size=rng.integers(1, 3)), 4000)
                                   .astype(int) + 1)) for i in range(7)]
    _, optimum = brute_force(groups, n_replicas, perf)
    result = solve_exact(groups, n_replicas, perf, node_limit=1, time_limit_s=None)
    assert result.lower_bound_s <= optimum * (1 + 1e-9)
