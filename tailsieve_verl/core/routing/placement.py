"""Which replicas form the tail pool, given where verl placed them (framework-free).

verl places the replicas: replica r takes the GPU slots ``[r·w, (r+1)·w)`` (w = tp · dp · pp) of
nodes filled in order, so a replica spans nodes when w exceeds a node's GPUs or does not divide
them. TailSieve only chooses which whole replicas serve the tail pool — a replica is never split
between pools. The tail pool serves the longest groups, whose time is per-token latency, and a
replica spanning nodes pays a cross-node collective on every token: the tail takes replicas that
sit on one node first, then (only if m asks for more) the spanning ones. With ``one_node`` the tail
is kept on a single node — the one holding the most single-node replicas — and m is capped there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tailsieve_verl.core.errors import TailSieveError


class PlacementError(TailSieveError):
    """No tail pool satisfies the placement rule on this cluster."""


@dataclass(frozen=True)
class ReplicaPlace:
    """A replica by its server address, and the Ray nodes its servers run on (its first server's first)."""

    address: str
    nodes: tuple[str, ...]

    @property
    def spans_nodes(self) -> bool:
        return len(set(self.nodes)) > 1


def tail_addresses(replicas: Sequence[ReplicaPlace], m: int, one_node: bool = False) -> list[str]:
    """The tail pool's addresses for a tail of ``m`` replicas (fewer under ``one_node`` when the
    fullest node holds fewer than m), in verl's replica order within each rule."""
    if m <= 0:
        return []
    single = [r for r in replicas if not r.spans_nodes]
    if not one_node:
        return [r.address for r in single + [r for r in replicas if r.spans_nodes]][:m]
    by_node: dict[str, list[str]] = {}
    for replica in single:  # nodes in the order of their first replica: ties go to the earlier node
        by_node.setdefault(replica.nodes[0], []).append(replica.address)
    if not by_node:
        raise PlacementError(
            "tailsieve.tail_on_one_node=true, but every rollout replica spans several nodes (its tp x dp x pp "
            "exceeds or does not divide a node's GPUs); lower the rollout parallel sizes or set "
            "tailsieve.tail_on_one_node=false")
    fullest = max(by_node.values(), key=len)
    return fullest[:m]

