"""The ``tailsieve_agent`` wrapper as verl's agent-loop workers run it, on configs wired the way a
launch wires them (``wire_verl_config``): a stock-verl baseline with stop strings runs every sample
through the user's own agent loop with the stop strings (issue 31: it used to refuse every sample,
"tailsieve_agent cannot wrap agent loop 'tailsieve_agent'"), and so do validation rows in the
TailSieve trainer; a row that names its own agent loop runs it unchanged in both modes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from hydra import compose, initialize_config_module

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, register

from tailsieve_verl.integration.agent_loop import INNER_AGENT_KEY, TailSieveAgentLoop
from tailsieve_verl.integration.config import wire_verl_config

RECORDER = "tailsieve_test_recorder"


@register(RECORDER)
class RecordingAgentLoop(AgentLoopBase):
    """Returns what it was asked to run with, instead of generating."""

    def __init__(self, **kwargs: Any):
        pass

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any):
        return SimpleNamespace(sampling_params=sampling_params, kwargs=kwargs)


def wired(mode: str):
    with initialize_config_module("verl.trainer.config", version_base=None):
        config = compose("ppo_trainer", overrides=[
            f"trainer.v1.trainer_mode={mode}", "+tailsieve.stop=['<END>']", "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={RECORDER}"])
    wire_verl_config(config)
    return config


def run_sample(config, **row: Any):
    """One sample through the wrapper, as verl's worker calls the registered default agent loop."""
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "tailsieve_agent"
    loop = TailSieveAgentLoop(server_manager=SimpleNamespace(), trainer_config=SimpleNamespace(config=config))
    return asyncio.run(loop.run({"temperature": 1.0}, uid="group-1", session_id=0, **row))


@pytest.mark.parametrize("mode", ["sync", "tailsieve"])
def test_a_row_without_an_agent_of_its_own_runs_the_users_default_with_the_stop_strings(mode):
    out = run_sample(wired(mode))  # stock training and validation; TailSieve validation
    assert out.sampling_params == {"temperature": 1.0, "stop": ["<END>"]}
    out = run_sample(wired(mode), **{INNER_AGENT_KEY: None})  # TailSieve's own dispatch of such a row
    assert out.sampling_params["stop"] == ["<END>"] and INNER_AGENT_KEY not in out.kwargs


def test_a_row_naming_its_own_agent_loop_runs_it_unchanged():
    """verl's stock trainer runs such a row's agent loop directly, without the wrapper: the TailSieve
    trainer wraps it (group tags) but adds nothing to its sampling, so both arms sample alike."""
    out = run_sample(wired("tailsieve"), **{INNER_AGENT_KEY: RECORDER})
    assert out.sampling_params == {"temperature": 1.0}
