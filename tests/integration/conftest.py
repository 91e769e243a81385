"""Fixtures for the verl integration tier: one Ray session and one TransferQueue per test run, a
tiny local tokenizer/model config (nothing downloaded), a prompt parquet, composed verl configs, and
a rollout-only TailSieve trainer.

What is stubbed, and why: the actor worker group (model update, log-probs, checkpoint of weights)
— there is no GPU and the policy update is not what these tests check. Everything on the rollout
path is verl's own: LLMServerManager, the router plugin loader, AgentLoopManagerTQ workers and
agent loops, TransferQueue, the V1 ReplayBuffer, CheckpointEngineManager (naive backend), the
trainer's step()/checkpoint code — with the simulated replicas as the inference servers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

N_PROMPTS = 96


def _write_tiny_model(out: Path) -> Path:
    from transformers import AutoTokenizer, Qwen3Config

    from tailsieve_verl.tools.tiny_qwen3 import VOCAB_SIZE, build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, intermediate_size=128, max_position_embeddings=1024,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(str(out))
    return out


def _write_prompts(path: Path) -> Path:
    import pandas as pd

    rows = [{"data_source": "tailsieve_test",
             "prompt": [{"role": "user", "content": f"prompt number {i}: the sum of {i} and {i * 7 % 13}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)},
             "extra_info": {"split": "train", "index": 0, "prompt_id": f"p{i}"}}  # index deliberately not unique
            for i in range(N_PROMPTS)]
    pd.DataFrame(rows).to_parquet(path)
    return path


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tailsieve_integration")
    return SimpleNamespace(model=_write_tiny_model(root / "model"), data=_write_prompts(root / "train.parquet"),
                           root=root)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=16, object_store_memory=256 * 1024**2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"VERL_LOGGING_LEVEL": "WARN", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


def compose(assets, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    base = [
        f"actor_rollout_ref.model.path={assets.model}",
        f"data.train_files={assets.data}", f"data.val_files={assets.data}",
        "data.max_prompt_length=64", "data.max_response_length=48", "data.dataloader_num_workers=0",
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.name=tailsieve_sim", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=4", "trainer.n_gpus_per_node=4", "trainer.nnodes=1",
        "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.calculate_log_probs=false",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=false",
        "algorithm.use_kl_in_reward=false", "trainer.logger=[console]", "trainer.val_before_train=false",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "trainer.v1.trainer_mode=tailsieve", "trainer.device=cpu",
        f"trainer.default_local_dir={assets.root}/ckpt",
        "+tailsieve.perf_model='linear:a=0.002,c=0.0002'", "+tailsieve.sim.mean_response_len=16",
        "+tailsieve.sim.prompt_sigma=0.8", "+tailsieve.sim.sample_sigma=0.2", "+tailsieve.poll_interval_s=0.02",
        "+tailsieve.drain_timeout_s=120", "+tailsieve.sim.time_scale=10",
    ]
    with initialize_config_module("verl.trainer.config", version_base=None):
        return hydra_compose("ppo_trainer", overrides=base + overrides)


@pytest.fixture(scope="session")
def transfer_queue(ray_session, assets):
    import transfer_queue as tq

    tq.init(compose(assets, []).transfer_queue)
    yield tq
    tq.close()


class _StubActorWorkerGroup:
    """Stands in for the actor/critic workers: no model, no update, no weight checkpoint."""

    world_size = 1

    def update_weights(self, global_steps=None, mode=None):
        return []

    def save_checkpoint(self, local_path, *args, **kwargs):
        os.makedirs(local_path, exist_ok=True)

    def load_checkpoint(self, local_path, *args, **kwargs):
        return None


def rollout_only_trainer_cls():
    from omegaconf import OmegaConf

    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.llm_server import LLMServerManager

    from tailsieve_verl.integration.trainer import TailSieveTrainer

    class RolloutOnlyTrainer(TailSieveTrainer):
        """TailSieveTrainer with the actor stubbed (see module docstring)."""

        def _setup(self):
            self._init_tokenizer()
            self._init_dataloader()
            self.llm_server_manager = LLMServerManager.create(config=self.config)
            self.actor_rollout_wg = _StubActorWorkerGroup()
            engine_cfg = omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine)
            engine_cfg.backend = "naive"
            self.checkpoint_manager = CheckpointEngineManager(
                config=engine_cfg, actor_wg=self.actor_rollout_wg, replicas=self.llm_server_manager.get_replicas())
            self.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=[])
            self._load_checkpoint()

        def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
            return batch

        def _compute_old_log_prob(self, batch, metrics):
            return batch

        def _compute_advantage(self, batch, metrics):
            return batch

        def _update_actor(self, batch, metrics):
            return batch

    return RolloutOnlyTrainer


class Harness:
    """Builds a rollout-only trainer plus verl's agent-loop manager, and runs steps like fit()."""

    def __init__(self, assets, overrides: list[str]):
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ

        self.config = compose(assets, overrides)
        self.trainer = rollout_only_trainer_cls()(config=self.config)
        self.trainer.init()
        self.trainer.curr_step_profile = False
        self.manager = AgentLoopManagerTQ.create(
            config=self.config, llm_client=self.trainer.get_llm_client(), teacher_client=None,
            reward_loop_worker_handles=None)
        self.trainer.agent_loop_manager = self.manager
        self.trainer.on_train_begin()

    def step(self) -> dict:
        import transfer_queue as tq

        trainer = self.trainer
        trainer.global_steps += 1
        trainer.timing_raw = {}
        metrics: dict = {}
        batch = trainer.step(metrics, {})
        prompts = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_info"])
        prompt_ids = [getattr(x, "data", x)["prompt_id"] for x in prompts["extra_info"]]
        trainer.on_step_end()
        tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
        return {"metrics": metrics, "batch": batch, "prompt_ids": prompt_ids, "outcome": trainer.last_outcome}

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


@pytest.fixture
def harness_factory(transfer_queue, assets):
    made: list[Harness] = []

    def make(overrides: list[str]) -> Harness:
        h = Harness(assets, overrides)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def dump(obj) -> str:
    return json.dumps(obj, default=str)
