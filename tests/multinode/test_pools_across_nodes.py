"""TailSieve's pools on a two-node Ray cluster (2 simulated replicas per node, verl's layout): the tail
pool on one node and the bulk pool on both; an adaptive run whose m moves across the node boundary;
every step audited as in the soak (B whole groups, each prompt trained once, carried at most one step)."""

from __future__ import annotations

import ray

from tailsieve_verl.core.tailsieve.controller import Decision
from two_nodes import HEAD, LAYOUT, WORKER, StepAudit, pools, replica_nodes

B, N = 8, 2
SETTINGS = LAYOUT + ["+tailsieve.q0=2", "+tailsieve.tail_replicas=1", "tailsieve.sim.time_scale=20"]


def _completed(h) -> dict[str, int]:
    replicas = h.trainer.llm_server_manager.get_replicas()
    stats = ray.get([r.server_handle.get_stats.remote() for r in replicas])
    return {r.server_address: s["completed"] for r, s in zip(replicas, stats)}


def test_the_tail_pool_on_one_node_and_the_bulk_pool_on_both(worker_node, harness_factory, tmp_path):
    h = harness_factory(SETTINGS + ["+tailsieve.mode=fixed", "+tailsieve.controller.inner_loop=false",
                                    "+tailsieve.tail_on_one_node=true", f"trainer.default_local_dir={tmp_path}"])
    where = replica_nodes(h)
    assert sorted(where.values()) == [HEAD, HEAD, WORKER, WORKER]  # verl's layout: 2 replicas per node
    audit = StepAudit(B, N)
    audit.step(h)  # the first step has no carried group: one shared pool
    before = _completed(h)
    for _ in range(3):
        audit.step(h)
        split = pools(h)
        assert len(split["tail"]) == 1 and {where[a] for a in split["bulk"]} == {HEAD, WORKER}
    done = {a: n - before[a] for a, n in _completed(h).items()}
    assert all(done[a] > 0 for a in where)  # both pools generated on both nodes' replicas
    # the controller asks for 3 tail replicas: kept on one node, m capped at its 2 replicas
    h.trainer.cycle.decision = Decision(3, 3, "test: a tail larger than a node")
    result = audit.step(h)
    split = pools(h)
    assert result["metrics"]["tailsieve/m"] == 2 and len({where[a] for a in split["tail"]}) == 1
    assert {where[a] for a in split["bulk"]} == {HEAD, WORKER} - {where[split["tail"][0]]}
    print("tail on one node:", audit.check())


def test_an_adaptive_run_whose_m_moves_across_the_node_boundary(worker_node, harness_factory, tmp_path):
    """The controller runs free, except at two steps where its decision moves m to 3 (the tail then
    spans both nodes: single-node replicas in verl's order) and back to 2, as the soak moves it."""
    h = harness_factory(SETTINGS + [f"trainer.default_local_dir={tmp_path}"])
    where = replica_nodes(h)
    audit = StepAudit(B, N)
    tail_nodes, ms = [], []
    forced = {3: Decision(3, 3, "test: across the node boundary"), 4: Decision(2, 2, "test: back to one node")}
    for step in range(1, 8):
        if step in forced:
            h.trainer.cycle.decision = forced[step]
        result = audit.step(h)
        ms.append(int(result["metrics"]["tailsieve/m"]))
        tail_nodes.append({where[a] for a in pools(h)["tail"]})
    assert ms[2:4] == [3, 2] and tail_nodes[2] == {HEAD, WORKER} and len(tail_nodes[3]) == 1
    print(f"adaptive across nodes: m per step {ms}, tail nodes per step {[sorted(n) for n in tail_nodes]};",
          audit.check())
