"""Per-pool engine settings applied to verl's own RolloutConfig dataclass."""

from __future__ import annotations

from hydra import compose, initialize_config_module

from verl.utils.config import omega_conf_to_dataclass

from types import SimpleNamespace

from tailsieve_verl.core.kinds import Pool
from tailsieve_verl.core.routing.placement import ReplicaPlace, tail_addresses
from tailsieve_verl.integration.config import wire_verl_config
from tailsieve_verl.integration.engine_config import (
    has_pool_engine_settings,
    launch_pool,
    launched_tail,
    pool_engine,
    settings_from_rollout_config,
    specialise_rollout_config,
)


def test_tail_and_bulk_replicas_get_their_own_engine_settings():
    with initialize_config_module("tailsieve_verl.config", version_base=None):
        config = compose("tailsieve_trainer", overrides=[
            "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.name=vllm", "data.train_batch_size=32", "tailsieve.q0=4",
            "tailsieve.tail_replicas=1", "actor_rollout_ref.model.mtp.enable=true",
            "actor_rollout_ref.rollout.max_num_seqs=256",
            "+tailsieve.tail.max_num_seqs=32", "+tailsieve.tail.num_speculative_tokens=4",
            "+tailsieve.tail.engine_kwargs.max_num_batched_tokens=4096", "+tailsieve.bulk.mtp_enable=false"])
    wire_verl_config(config)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    settings = settings_from_rollout_config(rollout)
    assert has_pool_engine_settings(settings)
    assert [launch_pool(rank, settings) for rank in range(4)] == [Pool.TAIL, Pool.BULK, Pool.BULK, Pool.BULK]

    tail = specialise_rollout_config(rollout, pool_engine(0, settings))
    assert tail.max_num_seqs == 32
    assert tail.mtp.enable_rollout and tail.mtp.num_speculative_tokens == 4
    assert tail.engine_kwargs["vllm"]["max_num_batched_tokens"] == 4096
    bulk = specialise_rollout_config(rollout, pool_engine(2, settings))
    assert bulk.max_num_seqs == 256 and not bulk.mtp.enable_rollout
    assert rollout.max_num_seqs == 256  # the shared config is not mutated


def test_on_a_mixed_layout_the_tail_pool_is_the_replicas_launched_with_its_engine():
    """Rank 0 spans two nodes and was launched with the tail engine; the placement rule alone would
    pick the first single-node replica (rank 1, a bulk engine) for the tail."""
    with initialize_config_module("tailsieve_verl.config", version_base=None):
        config = compose("tailsieve_trainer", overrides=[
            "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.name=vllm", "data.train_batch_size=32", "tailsieve.q0=4",
            "tailsieve.tail_replicas=1", "+tailsieve.tail.max_num_seqs=32"])
    settings = wire_verl_config(config)
    nodes = {0: ("a", "b"), 1: ("a",), 2: ("b",), 3: ("b",)}
    replicas = [SimpleNamespace(replica_rank=rank, server_address=f"10.0.0.{rank}:8000") for rank in nodes]
    by_placement = tail_addresses([ReplicaPlace(r.server_address, nodes[r.replica_rank]) for r in replicas], 1)
    assert by_placement == ["10.0.0.1:8000"]  # a bulk-engine replica: why placement must not decide here
    assert launched_tail(replicas, settings) == ["10.0.0.0:8000"]
    assert launched_tail(list(reversed(replicas)), settings) == ["10.0.0.0:8000"]


def test_a_pools_batch_size_schedule_reaches_vllms_speculative_config():
    """tailsieve.<pool>.spec_schedule, in --spec-schedule text or vLLM's list, becomes the pool's
    num_speculative_tokens_per_batch_size (its deepest k the pool's depth); num_speculative_tokens=0 is off."""
    with initialize_config_module("tailsieve_verl.config", version_base=None):
        config = compose("tailsieve_trainer", overrides=[
            "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.name=vllm", "data.train_batch_size=32", "tailsieve.q0=4",
            "tailsieve.tail_replicas=2", "actor_rollout_ref.model.mtp.enable=true",
            "+tailsieve.tail.spec_schedule='1-8:6,9-32:2'", "+tailsieve.bulk.num_speculative_tokens=0"])
    wire_verl_config(config)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    settings = settings_from_rollout_config(rollout)
    tail = specialise_rollout_config(rollout, pool_engine(1, settings))
    assert tail.mtp.enable_rollout and tail.mtp.num_speculative_tokens == 6
    assert tail.engine_kwargs["vllm"]["speculative_config"] == {"num_speculative_tokens_per_batch_size": [[1, 8, 6], [9, 32, 2]]}
    bulk = specialise_rollout_config(rollout, pool_engine(2, settings))
    assert not bulk.mtp.enable_rollout and "speculative_config" not in (bulk.engine_kwargs.get("vllm") or {})
