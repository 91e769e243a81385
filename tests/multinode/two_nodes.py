"""The two-node cluster's layout and where things run on it, and the soak's step audits
(tests/integration/test_soak.py) for runs that span harnesses and nodes: each step trains exactly B
whole groups generated in that step; across the run no prompt fetch is lost, trained twice, or
carried for more than one step."""

from __future__ import annotations

from collections import Counter

import ray

HEAD, WORKER = "tailsieve_head", "tailsieve_worker"  # the nodes' custom resources
# 4 replicas (TP1) as 2 nodes x 2 GPUs; one agent-loop worker per node (verl round-robins them)
LAYOUT = ["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.nnodes=2",
          "actor_rollout_ref.rollout.n_gpus_per_node=2", "actor_rollout_ref.rollout.agent.num_workers=2"]


def worker_node_args() -> dict:
    """The worker node, as the cluster starts it and as a test brings it back."""
    return {"num_cpus": 4, "resources": {WORKER: 1}, "node_ip_address": "127.0.0.1",
            "object_store_memory": 150 * 1024**2}


class StepAudit:
    def __init__(self, batch_size: int, samples: int):
        self.batch_size, self.samples = batch_size, samples
        self.consumed: Counter = Counter()
        self.carried: set[str] = set()
        self.seen_uids: set[str] = set()
        self.lost = self.deferred = self.steps = 0

    def step(self, h) -> dict:
        """Run one step of harness ``h`` and audit it."""
        result = h.step()
        outcome, batch = result["outcome"], result["batch"]
        groups = Counter(key.split("_")[0] for key in batch.keys)
        assert len(groups) == self.batch_size and set(groups.values()) == {self.samples}  # B whole groups
        assert all(tag["global_steps"] == h.trainer.global_steps for tag in batch.tags)  # none stale
        assert not set(groups) & self.seen_uids  # no trajectory of an earlier attempt resurfaces
        self.seen_uids |= set(groups)
        self.consumed.update(outcome.consumed_ids)
        carried = set(outcome.carried_ids)
        self.lost += len(self.carried - set(outcome.consumed_ids) - carried)
        self.deferred += len(self.carried & carried)  # carried again: waited more than one step
        self.carried = carried
        self.steps += 1
        return result

    def check(self) -> str:
        """Assert exactly-once and deferral <= 1 over every audited step; a one-line summary."""
        duplicated = sum(count - 1 for count in self.consumed.values() if count > 1)
        assert (self.lost, duplicated, self.deferred) == (0, 0, 0)
        assert sum(self.consumed.values()) == self.steps * self.batch_size
        return (f"{self.steps} steps, {sum(self.consumed.values())} groups trained: 0 lost, 0 duplicated, "
                f"0 carried twice")


def node_names() -> dict[str, str]:
    """Ray node id -> HEAD or WORKER (the node's custom resource), for the live nodes."""
    names = {}
    for node in ray.nodes():
        if node["Alive"]:
            names[node["NodeID"]] = next(n for n in (HEAD, WORKER) if n in node["Resources"])
    return names


def replica_nodes(h) -> dict[str, str]:
    """Each live replica's address -> the node (HEAD / WORKER) its server actually runs on."""
    names = node_names()
    replicas = h.trainer.llm_server_manager.get_replicas()
    found = ray.get([r.server_handle.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
                     for r in replicas])
    return {r.server_address: names[node] for r, node in zip(replicas, found)}


def pools(h) -> dict[str, list[str]]:
    """The router's pools of the last step: {'tail': [...], 'bulk': [...]} by address."""
    return {pool.value: addresses for pool, addresses in ray.get(h.trainer.router.pools.remote()).items()}
