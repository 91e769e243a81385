"""The E2E tier's workload: a forced response length per prompt and a reward with variance.

* :class:`ForcedLengthAgentLoop` is verl's ``SingleTurnAgentLoop`` with one change: each request's
  sampling params say ``min_tokens = max_tokens = extra_info["forced_len"]``. vLLM suppresses EOS
  until ``min_tokens`` and stops at ``max_tokens``, so every finished sample of a prompt has exactly
  its prompt's length — a random model never stops on its own, and a prompt's identity then decides
  whether it is a tail, as TailSieve assumes. A trained response shorter than its prompt's forced
  length can only be a cut-off (aborted) one, which is what the tier checks. Registered through
  verl's ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` (agent_loops.yaml) and selected
  with ``agent.default_agent_loop=e2e_forced_length``, in stock and TailSieve runs alike (TailSieve's
  agent loop wraps the default loop).
* :func:`compute_score` (``reward.custom_reward_function``): the share of the letter "e" in the
  decoded response. Samples of one prompt differ (temperature 1), so GRPO's group advantages are
  non-zero and the actor's grad_norm is > 0 — a math reward scores every output of a random model 0.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


def forced_len(extra_info: Any) -> int:
    info = getattr(extra_info, "data", extra_info) or {}
    return int(info["forced_len"])


class ForcedLengthAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any):
        length = forced_len(kwargs["extra_info"])
        return await super().run({**sampling_params, "min_tokens": length, "max_tokens": length}, **kwargs)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> float:
    return solution_str.count("e") / (len(solution_str) + 1)
