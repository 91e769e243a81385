"""Agent loops the integration tier registers with verl (``agents.yaml``, loaded by every agent-loop
worker through ``actor_rollout_ref.rollout.agent.agent_loop_config_path``). This folder is on the
Ray workers' PYTHONPATH (see ``conftest.ray_session``)."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

TOOL_CALL_S = 2.0  # longer than a simulated first turn: at the cutoff, unfinished samples mostly wait on it
SECOND_TURN_TOKENS = 4  # a short answer after the tool: a sample is in its first turn or waiting on the tool
ABORTED = ("aborted", "abort")


class TwoTurnToolAgentLoop(AgentLoopBase):
    """A tool loop of two model turns: generate, call a tool (a wait), append its answer (masked
    out) and generate again. The second turn is a new request sent after the first one finished —
    the request a bulk cutoff must not strand."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        limit = self.rollout_config.response_length
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        first = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids,
                                                   sampling_params=dict(sampling_params))
        response, mask = list(first.token_ids), [1] * len(first.token_ids)
        if first.stop_reason not in ABORTED and len(response) + 3 < limit:
            await asyncio.sleep(TOOL_CALL_S)
            tool_answer = prompt_ids[-2:]
            response, mask = response + tool_answer, mask + [0] * len(tool_answer)
            second = await self.server_manager.generate(
                request_id=uuid4().hex, prompt_ids=prompt_ids + response,
                sampling_params={**sampling_params, "max_tokens": min(SECOND_TURN_TOKENS, limit - len(response))})
            response, mask = response + list(second.token_ids), mask + [1] * len(second.token_ids)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response[:limit], response_mask=mask[:limit],
                               num_turns=4, metrics=AgentLoopMetrics(),
                               extra_fields={"turn_scores": [], "tool_rewards": []})
