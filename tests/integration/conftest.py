"""Fixtures for the verl integration tier: one Ray session and one TransferQueue per test run, a
tiny local tokenizer/model config (nothing downloaded), a prompt parquet, composed verl configs, and
a rollout-only TailSieve trainer.

What is stubbed, and why (see ``tailsieve_verl.integration.rollout_only``): the actor worker group
(model update, log-probs, checkpoint of weights) — there is no GPU and the policy update is not
what these tests check. Everything on the rollout path is verl's own: LLMServerManager, the router
plugin loader, AgentLoopManagerTQ workers and agent loops, TransferQueue, the V1 ReplayBuffer,
CheckpointEngineManager (naive backend), the trainer's step()/checkpoint code — with the simulated
replicas as the inference servers.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

N_PROMPTS = 96
AGENTS_DIR = Path(__file__).parent / "agents"
AGENTS_YAML = AGENTS_DIR / "agents.yaml"


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


def _write_prompts(path: Path, n_prompts: int = N_PROMPTS) -> Path:
    import pandas as pd

    rows = [{"data_source": "tailsieve_test",
             "prompt": [{"role": "user", "content": f"prompt number {i}: the sum of {i} and {i * 7 % 13}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)},
             "extra_info": {"split": "train", "index": 0, "prompt_id": f"p{i}"}}  # index deliberately not unique
            for i in range(n_prompts)]
    pd.DataFrame(rows).to_parquet(path)
    return path


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tailsieve_integration")
    return SimpleNamespace(model=_write_tiny_model(root / "model"), data=_write_prompts(root / "train.parquet"),
                           small_data=_write_prompts(root / "small.parquet", 12),
                           epoch_data=_write_prompts(root / "epoch.parquet", 16),  # two steps of 8 an epoch
                           root=root)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # AGENTS_DIR: the test agent loops (agents/agents.yaml), imported by the agent-loop workers
        pythonpath = os.pathsep.join(p for p in (str(AGENTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
        # address="local": a cluster of its own, never another test run's or a developer's already running here
        ray.init(address="local", num_cpus=16, object_store_memory=256 * 1024**2, include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": {"VERL_LOGGING_LEVEL": "WARN", "TOKENIZERS_PARALLELISM": "false",
                                           "PYTHONPATH": pythonpath}})
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
        "+tailsieve.sim.prompt_sigma=0.8", "+tailsieve.sim.sample_sigma=0.2", "+tailsieve.poll_interval_s=0.02", "+tailsieve.step_end_poll_s=0.02",
        "+tailsieve.drain_timeout_s=120", "+tailsieve.sim.time_scale=10",
    ]
    given = {o.split("=", 1)[0] for o in overrides}
    base = [o for o in base if o.split("=", 1)[0] not in given]  # a test's override replaces the default
    with initialize_config_module("verl.trainer.config", version_base=None):
        return hydra_compose("ppo_trainer", overrides=base + overrides)


@pytest.fixture(scope="session")
def transfer_queue(ray_session, assets):
    import transfer_queue as tq

    tq.init(compose(assets, []).transfer_queue)
    yield tq
    tq.close()


class Harness:
    """A :class:`RolloutDryRun` (the product's CPU dry run) whose steps also list the consumed
    groups' ``extra_info.prompt_id`` — the test oracle for "each prompt exactly once"."""

    def __init__(self, assets, overrides: list[str]):
        from tailsieve_verl.integration.rollout_only import RolloutDryRun

        self.run = RolloutDryRun(compose(assets, overrides))
        self.trainer = self.run.trainer

    def step(self) -> dict:
        result = self.run.step()
        result["prompt_ids"] = [info["prompt_id"] for info in result["extra_info"]]
        return result

    def server_stats(self) -> list[dict]:
        return self.run.server_stats()

    def close(self) -> None:
        if self.run is not None:
            self.run.close()
            self.run = None


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
