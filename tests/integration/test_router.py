"""The pool router as verl's router plugin sees it (plain class; verl wraps it in ray.remote)."""

from __future__ import annotations

from collections import Counter

import pytest

from tailsieve_verl.core.kinds import Pool
from tailsieve_verl.integration.router import AbortedGroups, PoolRouter, tag_request_id

SERVERS = {f"10.0.{node}.1:8000": f"handle-{node}" for node in range(4)}  # one replica per node
ADDRS = list(SERVERS)


def acquire(router: PoolRouter, group: str, nonce: str, release: bool = True) -> str:
    address, handle = router.acquire_server(tag_request_id(group, nonce))
    assert handle == SERVERS[address]
    if release:
        router.release_server(address)
    return address


def burst(router: PoolRouter, groups: dict[str, str], n: int) -> dict[str, list[str]]:
    """A synchronous step: every sample submitted before any finishes (nothing released)."""
    router.assign_groups(groups)
    return {g: [acquire(router, g, f"s{k}", release=False) for k in range(n)] for g in groups}


def test_samples_spread_by_least_inflight_within_their_pool_like_stock_verl():
    router = PoolRouter(dict(SERVERS), {"router_class": "x"})
    router.set_pools([ADDRS[0]])
    groups = {f"t{i}": Pool.TAIL for i in range(2)} | {f"b{i}": Pool.BULK for i in range(6)}
    placed = burst(router, groups, n=3)
    assert {a for g in groups if groups[g] == Pool.TAIL for a in placed[g]} == {ADDRS[0]}
    bulk = Counter(a for g in groups if groups[g] == Pool.BULK for a in placed[g])
    assert set(bulk) == set(ADDRS[1:]) and set(bulk.values()) == {6}  # 18 samples, 6 per bulk replica
    assert all(len(set(placed[g])) == 3 for g in groups if groups[g] == Pool.BULK)  # each group spread
    assert router.group_servers(["b0"]) == {"b0": sorted(placed["b0"])}
    for address in [a for addrs in placed.values() for a in addrs]:
        router.release_server(address)
    assert router.get_total_inflight() == 0


def test_group_atomic_keeps_a_group_on_one_replica_and_balances_groups():
    router = PoolRouter(dict(SERVERS))
    router.set_pools([ADDRS[0]], group_atomic=True)
    groups = {f"t{i}": Pool.TAIL for i in range(2)} | {f"b{i}": Pool.BULK for i in range(6)}
    placed = burst(router, {g: p for g, p in groups.items()}, n=1)
    for sample in range(1, 4):  # later samples (and turns) of each group follow its first request
        for group in groups:
            assert acquire(router, group, f"s{sample}") == placed[group][0]
    bulk = Counter(placed[g][0] for g in groups if groups[g] == Pool.BULK)
    assert set(bulk) == set(ADDRS[1:]) and set(bulk.values()) == {2}


def test_pools_move_between_steps_and_untagged_requests_use_every_replica():
    router = PoolRouter(dict(SERVERS))
    router.set_pools(ADDRS[:2])
    assert router.pools() == {Pool.TAIL: ADDRS[:2], Pool.BULK: ADDRS[2:]}
    router.set_pools([])  # uniform boundary: m = 0
    placed = burst(router, {f"g{i}": Pool.BULK for i in range(8)}, n=1)
    assert Counter(a for addrs in placed.values() for a in addrs) == Counter({a: 2 for a in ADDRS})
    router.set_pools(ADDRS[:1])
    router.assign_groups({f"v{i}": Pool.ANY for i in range(4)})
    assert {acquire(router, f"v{i}", "a", release=False) for i in range(4)} <= set(ADDRS)
    address, _ = router.acquire_server("plain-uuid")  # a request with no group tag
    assert address in SERVERS
    router.assign_groups({"s": "tail"})  # a pool's string (JSON, an older caller) is its member
    assert acquire(router, "s", "a") == ADDRS[0]
    with pytest.raises(ValueError, match="unknown pool 'nowhere'"):
        router.assign_groups({"x": "nowhere"})
    with pytest.raises(ValueError, match="unknown replica addresses"):
        router.set_pools(["10.9.9.9:1"])


def test_a_removed_replica_hands_its_groups_to_the_rest_of_its_pool():
    router = PoolRouter(dict(SERVERS))
    router.set_pools([ADDRS[0]])
    router.assign_groups({"g": Pool.BULK, "t": Pool.TAIL})
    first = acquire(router, "g", "1")
    router.remove_servers([first])
    again = acquire(router, "g", "2")
    assert again != first and again in ADDRS[1:]
    router.remove_servers([ADDRS[0]])  # the tail pool is empty: its groups go to the survivors
    assert acquire(router, "t", "1") in router.get_all_servers()


def test_sample_ledger_aggregates_a_group():
    router = PoolRouter(dict(SERVERS))
    router.assign_groups({"g": Pool.BULK})  # the ledger keeps reports of dispatched groups only
    router.report_sample({"uid": "g", "session_id": 1, "duration_s": 2.0, "tokens": 7, "aborted": False,
                          "failed": False})
    assert router.take_reports({"g": 2}) == {}
    router.report_sample({"uid": "g", "session_id": 0, "duration_s": 3.0, "tokens": 5, "aborted": False,
                          "failed": False})
    report = router.take_reports({"g": 2})["g"]
    assert report["duration_s"] == 3.0 and report["tokens"] == (5, 7) and not report["aborted"]
    assert router.take_reports({"g": 1}) == {}  # taken once


def test_reports_wait_for_each_groups_own_sample_count():
    """verl's per-row ``__rollout_n__``: a group of 1 sample is reported next to a group of 3."""
    router = PoolRouter(dict(SERVERS))
    router.assign_groups({"one": Pool.BULK, "three": Pool.BULK})
    sample = {"duration_s": 1.0, "tokens": 4, "aborted": False, "failed": False}
    router.report_sample({**sample, "uid": "one", "session_id": 0})
    for session in range(2):
        router.report_sample({**sample, "uid": "three", "session_id": session})
    assert set(router.take_reports({"one": 1, "three": 3})) == {"one"}
    router.report_sample({**sample, "uid": "three", "session_id": 2})
    assert router.take_reports({"three": 3})["three"]["tokens"] == (4, 4, 4)


def test_an_aborted_groups_report_keeps_every_samples_work_and_which_the_abort_cut():
    """Its abort score and the bias monitor's reference need the finished samples' work too (issue 31)."""
    router = PoolRouter(dict(SERVERS))
    router.assign_groups({"g": Pool.BULK})
    for session, (tokens, aborted) in enumerate([(9, False), (4, True), (0, True)]):
        router.report_sample({"uid": "g", "session_id": session, "duration_s": 1.0, "tokens": tokens,
                              "aborted": aborted, "failed": False})
    report = router.take_reports({"g": 3})["g"]
    assert report["tokens"] == (9, 4, 0) and report["sample_aborted"] == (False, True, True) and report["aborted"]


def test_a_partial_report_counts_the_finished_turns_of_a_sample_still_in_its_agent_loop():
    """An aborted group leaves its step while a sample waits on a tool call: that sample's work so far
    (its last progress report) is in the group's report, cut by the abort (issue 31)."""
    router = PoolRouter(dict(SERVERS))
    router.assign_groups({"g": Pool.BULK})
    router.report_progress("g", 0, 5)
    router.report_progress("g", 1, 3)
    router.report_progress("g", 1, 11)  # its second turn
    router.report_sample({"uid": "g", "session_id": 0, "duration_s": 2.0, "tokens": 6, "aborted": True, "failed": False})
    report = router.take_partial_reports(["g"])["g"]
    assert report["tokens"] == (6, 11) and report["sample_aborted"] == (True, True)
    assert router.take_partial_reports(["g"]) == {}


def test_full_determinism_routes_each_pool_as_stock_verls_balancer_does():
    """``rollout.full_determinism``: inside its pool a request goes where stock verl's balancer over
    that pool sends it (a hash of the agent loop's own request id, not of the group tag), every time."""
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    router = PoolRouter(dict(SERVERS))
    router.set_pools([ADDRS[0]], full_determinism=True)
    stock = GlobalRequestLoadBalancer({a: SERVERS[a] for a in ADDRS[1:]}, full_determinism=True)
    router.assign_groups({f"g{i}": Pool.BULK for i in range(3)} | {"t": Pool.TAIL})
    for nonce in (f"det-{k}" for k in range(12)):
        expected = stock.acquire_server(nonce)[0]
        assert [acquire(router, f"g{i}", nonce, release=False) for i in range(3)] == [expected] * 3
        assert acquire(router, "t", nonce) == ADDRS[0]
    router.set_pools([ADDRS[0]], full_determinism=False)  # back to least in flight
    assert router.get_total_inflight() == 0 and not router.full_determinism


def test_aborted_groups_are_remembered_and_bounded():
    groups = AbortedGroups(capacity=3)
    assert groups.add(["a", "b"]) == {"a", "b"} and "a" in groups and "c" not in groups
    groups.add(["c", "d"])
    assert "a" not in groups and {"b", "c", "d"} == {u for u in "abcd" if u in groups}
