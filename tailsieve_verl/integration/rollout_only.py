"""Rollout-only TailSieve runs on a CPU: verl's real V1 rollout path with simulated replicas.

    python -m tailsieve_verl.integration.rollout_only --steps 5 <your recipe's Hydra overrides>

composes verl's ``ppo_trainer`` config with your overrides, switches the rollout to
``tailsieve_sim`` (replicas that decode with ``tailsieve.perf_model``; no GPU, no model weights),
and runs ``--steps`` TailSieve steps through verl's own LLMServerManager, router plugin,
AgentLoopManagerTQ workers, TransferQueue and replay buffer, printing the ``tailsieve/*`` metrics
of each step. Only the actor is stubbed (:class:`StubActorWorkerGroup`: no log-probs, no update,
no weight checkpoint) — the policy never changes, which is what a routing dry run wants.
The integration tests use the same classes.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace
from typing import Any, Sequence

from tailsieve_verl.core.errors import MissingPackageError, needs_package

try:  # before verl's trainer imports them, so that `python -m` without ray or verl is one line
    with needs_package("ray", "the rollout-only run (verl's rollout path runs on Ray)", "pip install 'ray[default]'"):
        import ray  # noqa: F401
    with needs_package("verl", "the rollout-only run", "pip install 'verl[verl-core]==0.9.1'"):
        import verl  # noqa: F401
except MissingPackageError as e:
    if __name__ != "__main__":
        raise
    print(f"tailsieve: error: {e}", file=sys.stderr)
    sys.exit(2)

from tailsieve_verl.integration.config import SIM_ROLLOUT_NAME  # noqa: E402
from tailsieve_verl.integration.trainer import TailSieveTrainer  # noqa: E402


class StubActorWorkerGroup:
    """Stands in for the actor/critic workers: no model, no update, no weight checkpoint."""

    world_size = 1

    def update_weights(self, global_steps: int | None = None, mode: str | None = None) -> list:
        return []

    def save_checkpoint(self, local_path: str, *args: Any, **kwargs: Any) -> None:
        os.makedirs(local_path, exist_ok=True)

    def load_checkpoint(self, local_path: str, *args: Any, **kwargs: Any) -> None:
        return None


class RolloutOnlyTrainer(TailSieveTrainer):
    """The TailSieve trainer with the actor stubbed; everything on the rollout path is verl's."""

    def _setup(self) -> None:
        from verl.checkpoint_engine.base import CheckpointEngineManager
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.rollout.llm_server import LLMServerManager

        self.use_critic = self.use_reference_policy = False  # only the rollout runs (see module docstring)
        self._init_tokenizer()
        self._init_dataloader()
        self.llm_server_manager = LLMServerManager.create(config=self.config)  # standalone replicas
        self.actor_rollout_wg = StubActorWorkerGroup()
        engine_cfg = omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine)
        engine_cfg.backend = "naive"
        self.checkpoint_manager = CheckpointEngineManager(
            config=engine_cfg, actor_wg=self.actor_rollout_wg, replicas=self.llm_server_manager.get_replicas())
        self.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=[])  # no colocated reward model
        self._load_checkpoint()

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        return batch

    def _compute_old_log_prob(self, batch, metrics):
        return batch

    def _compute_advantage(self, batch, metrics):
        return batch

    def _update_actor(self, batch, metrics):
        return batch


class RolloutDryRun:
    """A rollout-only trainer plus verl's agent-loop manager, stepped like ``PPOTrainer.fit``."""

    def __init__(self, config: Any):
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ

        self.config = config
        self.trainer = RolloutOnlyTrainer(config=config)
        self.trainer.init()
        self.trainer.curr_step_profile = False
        self.manager = AgentLoopManagerTQ.create(
            config=config, llm_client=self.trainer.get_llm_client(), teacher_client=None,
            reward_loop_worker_handles=None)
        self.trainer.agent_loop_manager = self.manager
        self.trainer.on_train_begin()

    def step(self) -> dict:
        """One training step's rollout: returns its metrics, verl batch, consumed prompt rows' ids."""
        import transfer_queue as tq

        trainer = self.trainer
        trainer.global_steps += 1
        trainer.timing_raw = {}
        metrics: dict = {}
        batch = trainer.step(metrics, trainer.timing_raw)
        extra = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_info"])
        infos = [getattr(x, "data", x) for x in extra["extra_info"]]
        trainer.on_step_end()
        tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
        return {"metrics": metrics, "batch": batch, "extra_info": infos, "outcome": trainer.last_outcome}

    def server_stats(self) -> list[dict]:
        import ray

        return ray.get([r.server_handle.get_stats.remote() for r in self.trainer.llm_server_manager.get_replicas()])

    def close(self) -> None:
        import ray

        for worker in getattr(self.manager, "agent_loop_workers", []):
            ray.kill(worker)
        for replica in self.trainer.llm_server_manager.get_replicas():
            for server in replica.servers:
                ray.kill(server)
        ray.kill(self.trainer.llm_server_manager.global_load_balancer)


def dry_run_overrides(overrides: Sequence[str]) -> list[str]:
    """The user's overrides, then what a CPU dry run needs: simulated replicas (as many as the real
    layout launches), the TailSieve trainer mode, one TransferQueue storage unit."""
    def last(key: str, default: str) -> str:
        values = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=", 1)[0] == key]
        return values[-1] if values else default

    return list(overrides) + [
        f"actor_rollout_ref.rollout.name={SIM_ROLLOUT_NAME}",
        f"actor_rollout_ref.rollout.nnodes={last('trainer.nnodes', '1')}",
        f"actor_rollout_ref.rollout.n_gpus_per_node={last('trainer.n_gpus_per_node', '8')}",
        "trainer.v1.trainer_mode=tailsieve", "trainer.device=cpu", "trainer.val_before_train=false",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="rollout steps to run")
    parser.add_argument("--num-cpus", type=int, default=16, help="Ray logical CPUs (TransferQueue needs many)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as on verl's main_ppo command line")
    args = parser.parse_args(argv)

    import ray
    import transfer_queue as tq
    from hydra import compose, initialize_config_module

    from tailsieve_verl.core.errors import TailSieveError

    with initialize_config_module("verl.trainer.config", version_base=None):
        config = compose("ppo_trainer", overrides=dry_run_overrides(args.overrides))
    ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    tq.init(config.transfer_queue)
    try:
        run = RolloutDryRun(config)
    except TailSieveError as exc:
        print(f"tailsieve: {exc}", file=sys.stderr)
        return 2
    try:
        for _ in range(args.steps):
            metrics = run.step()["metrics"]
            shown = {k.removeprefix("tailsieve/"): round(v, 4) for k, v in sorted(metrics.items())
                     if k.startswith("tailsieve/")}
            print(f"step {run.trainer.global_steps}: {shown}", flush=True)
    finally:
        run.close()
        tq.close()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
