#!/usr/bin/env bash
# The multi-node tier: verl's rollout path with simulated replicas on a two-node Ray cluster on this
# machine (a head and a worker node, each its own raylet, both on loopback): pools across nodes, a
# node lost mid-step and the resume (tests/multinode). Its own pytest process, since the CPU suite
# holds a one-node Ray. Reuses .venv (scripts/setup_env.sh); see docs/testing.md for the measured
# wall time. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export TAILSIEVE_MULTINODE_TIER=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/multinode "$@"
