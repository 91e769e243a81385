"""Routing policies: structure of each policy, conservation/atomicity, best-k optimality over its
family, and one clear error per impossible request."""

from __future__ import annotations

import numpy as np
import pytest

from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.routing.oracle import SetCost, brute_force
from tailsieve_verl.core.engine.perf import LinearPerf, parse_perf_model
from tailsieve_verl.core.routing.policies import (POLICIES, RoutingError, TimeEstimate, balanced_assignment,
                                          least_inflight_assignment, route, tail_order, time_balanced_assignment,
                                          topk_assignment)
from tailsieve_verl.core.engine.replica import evaluate_assignment, evaluate_samples
from tailsieve_verl.core.data.trace import Group

DENSE = parse_perf_model("table:h200-dense")
LINEAR = LinearPerf(0.01, 0.0005)


def random_groups(seed: int, n_groups: int = 12, n: int = 4, max_len: int = 3000) -> list[Group]:
    rng = np.random.default_rng(seed)
    return [Group(f"p{i}", tuple(int(v) for v in rng.integers(1, max_len, size=n))) for i in range(n_groups)]


def _kwargs(policy: str) -> dict:
    return {"k": 3, "tail_replicas": 1} if policy in ("topk", "topk-balanced") else {}


GROUP_ATOMIC = {"uniform", "uniform-oracle", "topk", "topk-balanced", "best-k", "exact"}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_every_sample_assigned_once_and_groups_atomic_where_promised(policy, seed):
    groups = random_groups(seed, n_groups=9)
    routing = route(policy, groups, 4, DENSE, time_limit_s=2.0, **_kwargs(policy))
    s = routing.sample_assignment
    assert s.shape == (sum(g.n for g in groups),) and s.dtype == np.int64
    assert s.min() >= 0 and s.max() < 4
    ev = routing.evaluation
    assert [len(x) for x in ev.response_finish_s] == [g.n for g in groups]
    # A group finishes with its last sample, wherever it ran.
    assert ev.group_finish_s.tolist() == [float(x.max()) for x in ev.response_finish_s]
    assert routing.group_atomic == (policy in GROUP_ATOMIC)
    assert routing.makespan_s == pytest.approx(evaluate_samples(groups, s, 4, DENSE).makespan_s)
    if routing.group_atomic:
        a = routing.assignment
        assert a.shape == (len(groups),) and a.dtype == np.int64
        assert s.tolist() == np.repeat(a, [g.n for g in groups]).tolist()
        for i, r in enumerate(a):
            assert ev.group_finish_s[i] <= ev.replica_times_s[r] + 1e-12
        assert routing.makespan_s == pytest.approx(evaluate_assignment(groups, a, 4, DENSE).makespan_s)
    else:
        assert routing.assignment is None


def test_verl_spreads_every_round_of_samples_over_all_replicas():
    groups = random_groups(0, n_groups=6, n=4)  # 24 samples on 4 replicas: 6 rounds
    s = route("verl", groups, 4, DENSE).sample_assignment
    for start in range(0, 24, 4):
        assert sorted(s[start:start + 4].tolist()) == [0, 1, 2, 3]  # least in flight: one per replica a round
    # a group of n = R samples runs one sample per replica (the group spreads)
    assert all(sorted(s[4 * i:4 * i + 4].tolist()) == [0, 1, 2, 3] for i in range(6))
    assert least_inflight_assignment(7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_per_sample_spreading_beats_group_round_robin_on_a_long_group():
    # One group of long samples: group round-robin stacks all of them on one replica.
    groups = [Group("long", (4000,) * 4)] + [Group(f"s{i}", (200,) * 4) for i in range(7)]
    verl = route("verl", groups, 4, LINEAR)
    uniform = route("uniform", groups, 4, LINEAR)
    assert verl.makespan_s < uniform.makespan_s


def test_clairvoyant_sample_no_worse_than_verl_or_group_best_k():
    for seed in range(3):
        groups = random_groups(seed, n_groups=8)
        sample = route("clairvoyant-sample", groups, 4, DENSE)
        assert sample.makespan_s <= route("verl", groups, 4, DENSE).makespan_s * (1 + 1e-9)
        assert sample.makespan_s <= route("best-k", groups, 4, DENSE).makespan_s * (1 + 1e-9)


def test_time_balanced_heap_matches_the_scan_over_every_replica():
    """The O(log R) heap takes the same decisions as scoring every replica per group."""
    for seed in range(4):
        groups = random_groups(seed, n_groups=30, n=3)
        R = 5
        estimate = TimeEstimate.shared(DENSE, max(g.max_len for g in groups), -(-sum(g.n for g in groups) // R))
        works = estimate.request_times(groups).tolist()
        longest, load, expected = [0] * R, [0.0] * R, np.zeros(len(groups), dtype=np.int64)
        for i in tail_order(groups):
            after = [estimate.replica_cum[max(longest[r], groups[i].max_len)] - estimate.replica_cum[longest[r]]
                     + load[r] + works[i] for r in range(R)]
            r = after.index(min(after))
            expected[i], load[r], longest[r] = r, after[r], max(longest[r], groups[i].max_len)
        assert time_balanced_assignment(groups, R, DENSE).tolist() == expected.tolist()


def test_uniform_is_round_robin_in_trace_order():
    groups = random_groups(0, n_groups=7)
    assert route("uniform", groups, 3, DENSE).assignment.tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_token_lpt_balances_tokens():
    work = [10, 9, 5, 5, 1]
    a = balanced_assignment(work, 2).tolist()
    assert sorted(sum(w for w, r in zip(work, a) if r == k) for k in range(2)) == [15, 15]


@pytest.mark.parametrize("seed", range(3))
def test_time_estimate_is_exact_for_a_linear_model(seed):
    groups = random_groups(seed, n_groups=6)
    estimate = TimeEstimate(LINEAR, max(g.max_len for g in groups), 8)
    for subset in (groups[:1], groups[:3], groups):
        expected = evaluate_assignment(subset, [0] * len(subset), 1, LINEAR).makespan_s
        got = estimate.replica_cum[max(g.max_len for g in subset)] + estimate.request_times(subset).sum()
        assert got == pytest.approx(expected, rel=1e-9)


def test_uniform_oracle_balances_time_not_tokens():
    # Under a = 1 s/step the replica with the 1000-token response already pays 1000 s; balancing
    # tokens would add more to it, balancing time gives the short groups to the other replica.
    perf = LinearPerf(1.0, 0.01)
    groups = [Group("long", (1000,))] + [Group(f"s{i}", (100,)) for i in range(30)]
    by_time = route("uniform-oracle", groups, 2, perf)
    by_tokens = evaluate_assignment(groups, balanced_assignment([g.total_len for g in groups], 2), 2, perf)
    assert by_time.assignment.tolist() == time_balanced_assignment(groups, 2, perf).tolist()
    assert by_time.makespan_s < by_tokens.makespan_s
    assert by_time.makespan_s == pytest.approx(1000 * 1.01)


def test_topk_sends_the_k_longest_to_the_tail_pool_round_robin():
    groups = random_groups(5, n_groups=10)
    a = route("topk", groups, 5, DENSE, k=4, tail_replicas=2).assignment
    tail = tail_order(groups)[:4]
    assert [int(a[i]) for i in tail] == [0, 1, 0, 1]
    bulk = [i for i in range(10) if i not in tail]
    assert [int(a[i]) for i in bulk] == [2 + j % 3 for j in range(len(bulk))]


def test_topk_balanced_balances_the_bulk_by_work():
    groups = random_groups(6, n_groups=14)
    by_tokens = topk_assignment(groups, 4, 2, 1, balanced=True)
    bulk = [i for i in range(14) if by_tokens[i] != 0]
    assert len(bulk) == 12 and min(by_tokens[bulk]) == 1
    assert by_tokens[bulk].tolist() == balanced_assignment([groups[i].total_len for i in bulk], 3, offset=1).tolist()
    by_time = route("topk-balanced", groups, 4, DENSE, k=2).assignment
    assert by_time[bulk].tolist() == time_balanced_assignment([groups[i] for i in bulk], 3, DENSE, offset=1).tolist()


def test_topk_default_tail_pool_is_one_replica():
    routing = route("topk", random_groups(1), 3, DENSE, k=2)
    assert routing.tail_replicas == 1 and set(routing.assignment[tail_order(random_groups(1))[:2]]) == {0}


@pytest.mark.parametrize("seed", range(4))
def test_best_k_is_the_best_of_its_family(seed):
    groups = random_groups(seed, n_groups=10)
    best = route("best-k", groups, 3, DENSE)
    family = [route("topk-balanced", groups, 3, DENSE, k=k, tail_replicas=m).makespan_s
              for m in (1, 2) for k in range(0, 11)]
    family.append(route("uniform-oracle", groups, 3, DENSE).makespan_s)
    assert best.makespan_s == pytest.approx(min(family), rel=1e-9)
    fixed_m = route("best-k", groups, 3, DENSE, tail_replicas=2)
    assert fixed_m.tail_replicas == 2
    assert fixed_m.makespan_s >= best.makespan_s * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_exact_policy_is_optimal_and_beats_every_other_group_policy(seed):
    groups = random_groups(seed, n_groups=8, n=2)
    perf = DENSE if seed % 2 else LINEAR
    exact = route("exact", groups, 3, perf, time_limit_s=None)
    _, optimum = brute_force(groups, 3, perf)
    assert exact.optimal and exact.lower_bound_s == pytest.approx(exact.makespan_s)
    assert exact.makespan_s == pytest.approx(optimum, rel=1e-9)
    for policy in sorted(GROUP_ATOMIC - {"exact"}):  # per-sample policies may split a group: not its family
        other = route(policy, groups, 3, perf, **_kwargs(policy))
        assert exact.makespan_s <= other.makespan_s * (1 + 1e-9)


def test_exact_out_of_time_says_so():
    groups = random_groups(9, n_groups=40, n=2)
    routing = route("exact", groups, 4, DENSE, node_limit=5)
    assert not routing.optimal and routing.search_nodes == 5
    assert routing.lower_bound_s < routing.makespan_s
    assert 0 < routing.gap_to_bound < 1
    assert routing.makespan_s <= route("best-k", groups, 4, DENSE).makespan_s * (1 + 1e-9)


def test_tail_isolation_wins_in_the_long_tail_regime():
    # One very long group and many short ones: isolating it beats count-balanced routing.
    groups = [Group("tail", (16000,) * 4)] + [Group(f"b{i}", (800,) * 16) for i in range(31)]
    uniform = route("uniform", groups, 4, DENSE)
    best = route("best-k", groups, 4, DENSE)
    assert best.makespan_s < uniform.makespan_s
    counts = np.bincount(best.assignment, minlength=4)
    assert counts[best.assignment[0]] == counts.min() < len(groups) / 4  # the tail's replica runs the fewest
    isolated = route("topk-balanced", groups, 4, DENSE, k=1)
    assert isolated.makespan_s < uniform.makespan_s and isolated.assignment[0] == 0
    assert np.count_nonzero(isolated.assignment == 0) == 1


def test_set_cost_matches_evaluator_with_cap():
    groups = random_groups(2, n_groups=5)
    cost = SetCost(groups, DENSE, EngineConfig(max_num_seqs=3))
    assert cost.table is None
    a = [0, 1, 0, 1, 1]
    assert cost.makespan(a, 2) == pytest.approx(evaluate_assignment(groups, a, 2, DENSE,
                                                                    EngineConfig(max_num_seqs=3)).makespan_s)


@pytest.mark.parametrize("policy, n_replicas, kwargs, needle", [
    ("roundrobin", 2, {}, "unknown policy 'roundrobin'"),
    ("uniform", 0, {}, "--replicas must be an integer >= 1"),
    ("exact", -1, {}, "--replicas must be an integer >= 1"),
    ("topk", 3, {}, "needs --k"),
    ("topk", 3, {"k": 13}, "--k must be between 0 and the number of groups"),
    ("topk-balanced", 3, {"k": -1}, "--k must be between 0"),
    ("topk", 3, {"k": 2, "tail_replicas": 3}, "--tail-replicas must be between 1 and replicas - 1 = 2"),
    ("topk", 3, {"k": 2, "tail_replicas": 0}, "--tail-replicas must be between 1"),
    ("topk", 1, {"k": 2}, "at least 2 replicas"),
    ("best-k", 1, {}, "best-k needs at least 2 replicas"),
    ("best-k", 3, {"k": 2}, "best-k chooses k itself"),
    ("best-k", 3, {"tail_replicas": 3}, "--tail-replicas must be between 1 and replicas - 1"),
    ("uniform", 3, {"k": 2}, "--k does not apply"),
    ("uniform-oracle", 3, {"tail_replicas": 1}, "--tail-replicas does not apply"),
    ("uniform", 3, {"engine": 4}, "engine must be an EngineConfig"),
])
def test_impossible_requests_raise_one_clear_error(policy, n_replicas, kwargs, needle):
    with pytest.raises(RoutingError, match=needle.replace("(", r"\(")):
        route(policy, random_groups(0), n_replicas, DENSE, **kwargs)


def test_empty_group_list():
    with pytest.raises(RoutingError, match="no groups"):
        route("uniform", [], 2, DENSE)
