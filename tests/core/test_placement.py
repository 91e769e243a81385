"""The tail pool's placement rule (core.routing.placement): whole replicas, single-node ones first, one node on request."""

from __future__ import annotations

import pytest

from tailsieve_verl.core.routing.placement import PlacementError, ReplicaPlace, tail_addresses


def _layout(nodes_of_replicas: list[tuple[str, ...]]) -> list[ReplicaPlace]:
    return [ReplicaPlace(f"r{i}", nodes) for i, nodes in enumerate(nodes_of_replicas)]


TWO_NODES = _layout([("a",), ("a",), ("b",), ("b",)])  # 4 x TP1 on two 2-GPU nodes


def test_the_tail_is_the_first_m_replicas_and_crosses_the_node_boundary_when_m_asks():
    assert [tail_addresses(TWO_NODES, m) for m in range(4)] == [[], ["r0"], ["r0", "r1"], ["r0", "r1", "r2"]]


def test_a_replica_spanning_nodes_joins_the_tail_only_after_every_single_node_one():
    # TP2 on 3-GPU nodes, verl's slots in order: r1 takes slots 2-3, one GPU on each node
    layout = _layout([("a",), ("a", "b"), ("b",)])
    assert tail_addresses(layout, 2) == ["r0", "r2"]
    assert tail_addresses(layout, 2, one_node=True) == ["r0"]  # capped at the fullest node's single-node replicas
    assert tail_addresses(layout, 3) == ["r0", "r2", "r1"]


def test_one_node_keeps_the_tail_on_the_node_with_the_most_replicas_and_caps_m_there():
    assert tail_addresses(TWO_NODES, 3, one_node=True) == ["r0", "r1"]  # a tie: the earlier node
    uneven = _layout([("a",), ("b",), ("b",), ("b",), ("a",)])
    assert tail_addresses(uneven, 2, one_node=True) == ["r1", "r2"]
    assert tail_addresses(uneven, 0, one_node=True) == []


def test_one_node_where_every_replica_spans_nodes_is_one_clear_error():
    with pytest.raises(PlacementError, match="every rollout replica spans several nodes") as err:
        tail_addresses(_layout([("a", "b"), ("c", "d")]), 1, one_node=True)
    assert "\n" not in str(err.value)
