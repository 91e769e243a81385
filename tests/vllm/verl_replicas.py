"""Start verl's own vLLM rollout replicas (``vLLMReplica.init_standalone``) on CPU for the tier, as the
TailSieve trainer launches them: the replica class registered as verl's ``vllm`` rollout once the plugin
installed its own (``engine_config.install_tailsieve_vllm``: each replica takes its pool's engine
settings from ``rollout.custom["tailsieve"]``, keyed on its rank) and the CPU fixes wrapped around it.

Settings are the verified CPU recipe (ARCHITECTURE.md): eager mode, no sleep mode, no cache
freeing, a logical Ray GPU per replica so verl's resource check passes, a 1 GiB KV cache, and the
vLLM 0.32 compatibility server from :mod:`tailsieve_verl.integration.vllm_cpu_compat`. The engines
log stats (``rollout.disable_log_stats=False``, verl's default is True): vLLM fills its Prometheus
``/metrics`` counters, the speculation ones included, only then.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 64


def verl_config(model_dir: str | Path, n_replicas: int, overrides: tuple[str, ...] = ()):
    """verl's full trainer config (hydra) with the rollout set up for ``n_replicas`` small CPU replicas
    (TP1), plus ``overrides``; TailSieve's launch wiring (``wire_verl_config``) applied, as the trainer
    applies it before any worker starts: the ``tailsieve`` section lands in ``rollout.custom``."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from tailsieve_verl.integration.config import wire_verl_config

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.enforce_eager=True",
            "actor_rollout_ref.rollout.free_cache_engine=False",
            "actor_rollout_ref.rollout.load_format=auto",
            f"actor_rollout_ref.rollout.max_model_len={MAX_MODEL_LEN}",
            f"actor_rollout_ref.rollout.max_num_seqs={MAX_NUM_SEQS}",
            "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
            "actor_rollout_ref.rollout.prompt_length=128",
            "actor_rollout_ref.rollout.response_length=512",
            "actor_rollout_ref.rollout.disable_log_stats=False",
            f"trainer.n_gpus_per_node={n_replicas}",
            *overrides,
        ])
    with open_dict(cfg):
        cfg.actor_rollout_ref.rollout.enable_sleep_mode = False
    wire_verl_config(cfg)
    return cfg


def init_ray(n_replicas: int) -> None:
    import ray

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not ray.is_initialized():
        # Each replica's bundle asks for 2 CPUs + 1 (logical) GPU and its server actor one more CPU.
        # Loopback node address: verl's HTTP servers bind the node IP, and every request of the tier
        # must stay on this machine's loopback.
        ray.init(address="local", num_cpus=4 * n_replicas + 4, num_gpus=n_replicas, include_dashboard=False,
                 log_to_driver=False, _node_ip_address="127.0.0.1")


def plugin_replica_class():
    """The class verl's ``vllm`` rollout entry gives once the plugin (the TailSieve trainer does this in its
    process) and the CPU fixes are installed: TailSieve's replica with the CPU compatibility server."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from tailsieve_verl.integration.engine_config import install_tailsieve_vllm
    from tailsieve_verl.integration.vllm_cpu_compat import install_vllm_cpu_compat

    install_tailsieve_vllm()
    install_vllm_cpu_compat()
    return RolloutReplicaRegistry.get("vllm")


async def start_replicas(cfg, n_replicas: int):
    """Start ``n_replicas`` standalone replicas of the plugin's class concurrently; returns them in rank order."""
    replica_cls = plugin_replica_class()
    replicas = [replica_cls(replica_rank=r, config=cfg.actor_rollout_ref.rollout,
                            model_config=cfg.actor_rollout_ref.model, gpus_per_node=1)
                for r in range(n_replicas)]
    await asyncio.gather(*(r.init_standalone() for r in replicas))
    return replicas
