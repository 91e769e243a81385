"""Per-pool engine configuration (route specialisation).

verl launches every rollout replica from one ``RolloutConfig``. TailSieve gives the tail pool (the
first ``tailsieve.tail_replicas`` replica ranks) and the bulk pool their own ``max_num_seqs``, MTP
speculative decoding switch and depth (``num_speculative_tokens``, 0 = off), vLLM's batch-size schedule
(``spec_schedule``: ``num_speculative_tokens_per_batch_size``) and extra vLLM ``engine_kwargs``:
the tail pool is a low-concurrency, long-horizon stream where deeper speculation pays off, the bulk
pool is a high-concurrency batch where it would not.

Engines are configured at launch, so a replica keeps its pool's engine settings for the whole run;
with per-pool settings the trainer therefore pins the split at ``tail_replicas`` (the controller
still moves q).

MTP drafter weights across weight updates (read in verl 0.9.1's vLLM worker extension,
``vllm_rollout/utils.py``: with ``speculative_config.method == "mtp"`` every weight update is also
loaded into the drafter, by parameter name): under **Megatron** (``mtp.enable=true``, the model has
MTP layers) the actor exports the MTP layers with the policy, so the tail pool's drafter follows the
policy each step (trained when ``mtp.enable_train=true``, otherwise the unchanged checkpoint MTP
weights are re-sent). Under **FSDP** the HF model class carries no MTP layers, so nothing under
their names is sent: the drafter keeps the MTP weights loaded at engine start while its shared
parts (embeddings, head) follow the policy — a stale but valid proposer whose acceptance rate, not
correctness, degrades as the policy drifts. A GPU run is needed to measure that drift.

The settings travel to the replicas inside ``actor_rollout_ref.rollout.custom["tailsieve"]`` (a
free-form field of verl's RolloutConfig), written by :func:`tailsieve_verl.integration.config.wire_verl_config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.kinds import Pool
from tailsieve_verl.integration.config import PoolEngineConfig, TailSieveConfig, parse_tailsieve_section


def settings_from_rollout_config(rollout_config: Any) -> TailSieveConfig:
    """The TailSieve settings carried by a RolloutConfig (dataclass or DictConfig)."""
    custom = getattr(rollout_config, "custom", None)
    if custom is None and isinstance(rollout_config, Mapping):
        custom = rollout_config.get("custom")
    section = (custom or {}).get("tailsieve") if custom is not None else None
    return parse_tailsieve_section(section or {})


def launch_pool(replica_rank: int, settings: TailSieveConfig) -> Pool:
    """Pool a replica belongs to at launch: ranks ``0 .. initial_m - 1`` form the tail pool."""
    return Pool.TAIL if replica_rank < settings.initial_m else Pool.BULK


def launched_tail(replicas: Sequence, settings: TailSieveConfig) -> list[str]:
    """The addresses of the replicas launched with the tail pool's engine: with per-pool engine
    settings these, not the placement rule's picks, are the tail pool (a bulk-engine replica must never
    serve it, wherever it runs)."""
    return [r.server_address for r in replicas if launch_pool(r.replica_rank, settings) is Pool.TAIL]


def pool_engine(replica_rank: int, settings: TailSieveConfig) -> PoolEngineConfig:
    return settings.tail if launch_pool(replica_rank, settings) is Pool.TAIL else settings.bulk


def pool_engine_models(settings: TailSieveConfig, rollout_max_num_seqs: int) -> tuple[EngineConfig, EngineConfig]:
    """(tail, bulk) engine models of the pools' replicas, as far as the settings say: each pool's
    concurrency limit (``tailsieve.{tail,bulk}.max_num_seqs``, else verl's ``rollout.max_num_seqs``)."""
    return tuple(EngineConfig(max_num_seqs=int(pool.max_num_seqs or rollout_max_num_seqs))
                 for pool in (settings.tail, settings.bulk))


def has_pool_engine_settings(settings: TailSieveConfig) -> bool:
    return settings.active and not (settings.tail.is_default() and settings.bulk.is_default())


def specialise_rollout_config(rollout_config: Any, pool: PoolEngineConfig) -> Any:
    """A copy of verl's RolloutConfig dataclass with one pool's engine settings applied."""
    changes: dict[str, Any] = {}
    if pool.max_num_seqs is not None:
        changes["max_num_seqs"] = pool.max_num_seqs
    depth = pool.depth()
    if pool.mtp_enable is not None or depth is not None:
        mtp_changes: dict[str, Any] = {"enable_rollout": pool.wants_speculation()}
        if depth:
            mtp_changes["num_speculative_tokens"] = depth
        changes["mtp"] = dataclasses.replace(rollout_config.mtp, **mtp_changes)
    vllm_kwargs = dict(pool.engine_kwargs)
    if pool.spec_schedule is not None:  # vLLM's dynamic SD, merged into verl's MTP speculative config
        speculative = dict(vllm_kwargs.get("speculative_config") or {})
        speculative["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in pool.schedule()]
        vllm_kwargs["speculative_config"] = speculative
    if vllm_kwargs:
        merged = {key: dict(value) for key, value in (rollout_config.engine_kwargs or {}).items()}
        merged.setdefault("vllm", {}).update(vllm_kwargs)
        changes["engine_kwargs"] = merged
    return dataclasses.replace(rollout_config, **changes) if changes else rollout_config


def _load_tailsieve_vllm():
    import ray
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

    from tailsieve_verl.integration.vllm_server import TailSieveVLLMHttpServer

    class TailSieveVLLMReplica(vLLMReplica):
        """verl's vLLMReplica launched with its pool's engine settings (keyed on replica_rank), whose
        servers abort single groups and report progress (:mod:`integration.vllm_server`)."""

        def __init__(self, replica_rank: int, config: Any, *args: Any, **kwargs: Any):
            super().__init__(replica_rank, config, *args, **kwargs)
            settings = settings_from_rollout_config(self.config)
            self.pool = launch_pool(replica_rank, settings)
            if has_pool_engine_settings(settings):
                self.config = specialise_rollout_config(self.config, pool_engine(replica_rank, settings))
            self.server_class = ray.remote(TailSieveVLLMHttpServer)

    return TailSieveVLLMReplica


def install_tailsieve_vllm() -> None:
    """Point verl's ``vllm`` replica entry at :class:`TailSieveVLLMReplica` (the TailSieve trainer's
    process only, so stock runs keep verl's own class)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register("vllm", _load_tailsieve_vllm)
