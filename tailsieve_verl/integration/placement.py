"""Where verl's rollout replicas run, asked of Ray, for the tail-pool rule of :mod:`core.routing.placement`.

A verl replica launches one server actor per node it spans (``vLLMReplica.launch_servers`` pins each
with a ``NodeAffinitySchedulingStrategy`` to its workers' node; the first server serves), so the
nodes of a replica are the nodes of its ``servers``. Asked once per replica and kept on it: a
replica's servers never move, and a dead one is dropped by the trainer, not asked again.
"""

from __future__ import annotations

from typing import Sequence

import ray

from tailsieve_verl.core.routing.placement import ReplicaPlace, tail_addresses

_NODES = "_tailsieve_nodes"  # the nodes of a replica, cached on the replica object


def _node_id(actor) -> str:
    return ray.get_runtime_context().get_node_id()


def replica_places(replicas: Sequence, timeout_s: float) -> list[ReplicaPlace]:
    """Each replica's address and the Ray node ids of its servers."""
    unknown = [r for r in replicas if not hasattr(r, _NODES)]
    asked = [[server.__ray_call__.remote(_node_id) for server in r.servers] for r in unknown]
    for replica, refs in zip(unknown, asked):
        setattr(replica, _NODES, tuple(ray.get(refs, timeout=timeout_s)))
    return [ReplicaPlace(r.server_address, getattr(r, _NODES)) for r in replicas]


def choose_tail(replicas: Sequence, m: int, one_node: bool, timeout_s: float) -> list[str]:
    """The tail pool's addresses for m tail replicas (:func:`core.routing.placement.tail_addresses`)."""
    return tail_addresses(replica_places(replicas, timeout_s), m, one_node) if m else []
