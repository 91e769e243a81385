"""The multi-node tier: verl's rollout path on a two-node Ray cluster on this machine.

Selected only on request — ``TAILSIEVE_MULTINODE_TIER=1`` (``bash scripts/test_multinode_tier.sh``) —
because it needs its own Ray cluster: the CPU suite starts a one-node Ray once per test run
(tests/integration/conftest.py), and one pytest process holds one Ray connection. Here a head and a
worker node, each its own raylet (``ray.cluster_utils.Cluster``), both bound to loopback: no traffic
leaves 127.0.0.1. Each node carries a custom resource naming it. Everything else is the integration
tier's: its fixtures (assets, TransferQueue, the rollout-only harness on verl's real rollout path)
with the simulated replicas, which verl's layout spreads over the two nodes (2 per node).
"""

from __future__ import annotations

import os
import tempfile

if os.environ.get("TAILSIEVE_MULTINODE_TIER") == "1":
    # Before Ray is imported (tier_gate imports verl): on Linux, Ray rewrites a loopback address given to
    # ray.init into the machine's outward IP (services.resolve_ip_for_localhost), where the loopback-bound
    # head does not listen; this switch keeps the driver, like every node, on 127.0.0.1.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # The cluster's own Ray directory: Cluster() records its address in <temp dir>/ray/ray_current_cluster,
    # and a plain ray.init() elsewhere on this machine (another test run) would join it instead of starting.
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="tsmn_"))

import pytest  # noqa: E402

from tier_gate import tier_requested  # noqa: E402
from two_nodes import HEAD, worker_node_args  # noqa: E402

if tier_requested("TAILSIEVE_MULTINODE_TIER", "the multi-node tier", "scripts/test_multinode_tier.sh",
                  needs_entry_point=True, needs_vllm=False):
    from integration.conftest import AGENTS_DIR, assets, harness_factory, transfer_queue  # noqa: F401
else:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def cluster():
    """The head node, on loopback (the driver runs here)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 16, "resources": {HEAD: 1}, "node_ip_address": "127.0.0.1", "include_dashboard": False,
        "object_store_memory": 256 * 1024**2})
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="session")
def worker_node(cluster, transfer_queue):
    """The worker node, added once TransferQueue's actors run on the head (a node loss that takes
    TransferQueue's storage is not what this tier drills)."""
    return cluster.add_node(**worker_node_args())


@pytest.fixture(scope="session")
def ray_session(cluster):
    """The driver joins the cluster at its head (replaces the integration tier's one-node Ray)."""
    import ray

    pythonpath = os.pathsep.join(p for p in (str(AGENTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"VERL_LOGGING_LEVEL": "WARN", "TOKENIZERS_PARALLELISM": "false",
                                       "PYTHONPATH": pythonpath}})
    yield ray
    ray.shutdown()
