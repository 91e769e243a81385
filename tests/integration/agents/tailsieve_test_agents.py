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


class TwoOutputAgentLoop(TwoTurnToolAgentLoop):
    """The two-turn tool loop returning each model turn as its own output (``list[AgentLoopOutput]``,
    which verl's TransferQueue worker stores as one trajectory each): the second output's prompt is
    the whole conversation before that turn."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> list[AgentLoopOutput]:
        whole = await super().run(sampling_params, **kwargs)
        mask = whole.response_mask
        if 0 not in mask or 1 not in mask[mask.index(0):]:  # one model turn only
            return [whole]
        first = mask.index(0)
        second = first + mask[first:].index(1)
        return [AgentLoopOutput(prompt_ids=whole.prompt_ids, response_ids=whole.response_ids[:first],
                                response_mask=mask[:first], num_turns=2, metrics=AgentLoopMetrics(),
                                extra_fields=dict(whole.extra_fields)),
                AgentLoopOutput(prompt_ids=whole.prompt_ids + whole.response_ids[:second],
                                response_ids=whole.response_ids[second:], response_mask=mask[second:], num_turns=4,
                                metrics=AgentLoopMetrics(), extra_fields=dict(whole.extra_fields))]


def prompt_number(kwargs: dict) -> int:
    """The i of a conftest prompt ("prompt number {i}: ...")."""
    return int(list(kwargs["raw_prompt"])[-1]["content"].split()[2].rstrip(":"))


def _one_turn_output(prompt_ids: list[int], response: list[int], mask: list[int]) -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response, response_mask=mask, num_turns=2,
                           metrics=AgentLoopMetrics(), extra_fields={"turn_scores": [], "tool_rewards": []})


class ToolError(RuntimeError):
    """A tool that fails (not the engine, not a replica)."""


def one_sample_fails(number: int) -> bool:
    """The first sample's tool call raises for these prompts."""
    return number % 5 == 2 and not every_sample_fails(number)


def every_sample_fails(number: int) -> bool:
    """Every session's tool call raises for these prompts."""
    return number % 7 == 3


class ToolErrorAgentLoop(AgentLoopBase):
    """One model turn, then a tool call that raises for some prompts (:func:`one_sample_fails`,
    :func:`every_sample_fails`) on every dispatch: verl marks such a group ``failure``."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        turn = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids,
                                                  sampling_params=dict(sampling_params))
        number = prompt_number(kwargs)
        if turn.stop_reason not in ABORTED and (every_sample_fails(number) or (
                one_sample_fails(number) and int(kwargs["session_id"]) == 0)):
            raise ToolError(f"the tool failed for prompt number {number}")
        return _one_turn_output(prompt_ids, list(turn.token_ids), [1] * len(turn.token_ids))


SLOW_TOOL_S = 12.0
SLOW_TOOL_PROMPTS = frozenset({1, 5, 9})  # of the first step's 12 fresh prompts (data.shuffle=false)


class SlowToolAgentLoop(AgentLoopBase):
    """A short model turn; for :data:`SLOW_TOOL_PROMPTS` a tool call of :data:`SLOW_TOOL_S` (which an
    abort cannot interrupt) and a second turn; the other prompts answer in one turn."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        first = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids,
                                                   sampling_params={**sampling_params, "max_tokens": 8})
        response, mask = list(first.token_ids), [1] * len(first.token_ids)
        if first.stop_reason not in ABORTED and prompt_number(kwargs) in SLOW_TOOL_PROMPTS:
            await asyncio.sleep(SLOW_TOOL_S)
            response, mask = response + prompt_ids[-2:], mask + [0, 0]
            second = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids + response,
                                                        sampling_params={**sampling_params, "max_tokens": 4})
            response, mask = response + list(second.token_ids), mask + [1] * len(second.token_ids)
        return _one_turn_output(prompt_ids, response, mask)
