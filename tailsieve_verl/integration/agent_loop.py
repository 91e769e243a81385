"""Agent-loop side of TailSieve: group identity on every request, aborted samples kept out of
TransferQueue, per-group measurements for the controller.

* :class:`TailSieveAgentLoopManager` (set by the trainer as ``rollout.agent.agent_loop_manager_class``)
  is verl's ``AgentLoopManagerTQ`` with :class:`TailSieveAgentLoopWorker` workers.
* The worker opens a :class:`GroupContext` (a context variable) around each prompt group, so every
  agent loop of the group — whatever its class (single-turn, tool, user-registered) — runs inside it.
* :class:`GroupTaggedClient` (the trainer's ``get_llm_client``) tags each request id with the group
  uid for the pool router, and records aborted outputs in the group context.
* A sample whose generation came back aborted is never written to TransferQueue (and the trainer
  never selects its group), so no aborted trajectory can be consumed. When the group settles, the
  worker reports its duration and token counts to the router's ledger.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
from verl.workers.rollout.llm_server import LLMServerClient

from tailsieve_verl.integration.router import tag_request_id

logger = logging.getLogger(__name__)

ABORT_REASONS = ("aborted", "abort")


@dataclass
class GroupContext:
    """Mutable per-group state shared by the group's concurrent sessions (one worker process)."""

    uid: str
    aborted: bool = False
    failed: bool = False
    aborted_tokens: int = 0
    tokens: list[int] = field(default_factory=list)


_GROUP: contextvars.ContextVar[GroupContext | None] = contextvars.ContextVar("tailsieve_group", default=None)


class GroupTaggedClient(LLMServerClient):
    """verl's LLM client with the group uid in the routed request id and abort bookkeeping."""

    async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any):
        group = _GROUP.get()
        if group is not None:
            request_id = tag_request_id(group.uid, str(request_id))
        try:
            output = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        except Exception:
            if group is not None:
                group.failed = True
            raise
        if group is not None and output.stop_reason in ABORT_REASONS:
            group.aborted = True
            group.aborted_tokens += len(output.token_ids)
        return output


class TailSieveAgentLoopWorker(AgentLoopWorkerTQ.__ray_actor_class__):
    """verl's TransferQueue agent-loop worker, run inside a :class:`GroupContext` per prompt group."""

    async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False) -> None:
        group = GroupContext(uid=str(prompt["uid"]))
        token = _GROUP.set(group)
        start = time.monotonic()
        try:
            await super()._run_prompt(prompt, sampling_params, trajectory, trace)
        finally:
            _GROUP.reset(token)
        report = {"uid": group.uid, "duration_s": time.monotonic() - start, "tokens": list(group.tokens),
                  "aborted_tokens": group.aborted_tokens, "aborted": group.aborted, "failed": group.failed}
        balancer = getattr(self.llm_client, "_load_balancer", None)
        if balancer is not None and hasattr(balancer, "report_group"):
            balancer.report_group.remote(report)

    async def _agent_loop_postprocess(self, output, validate, **kwargs) -> None:
        group = _GROUP.get()
        if group is not None and group.aborted:
            return  # an aborted sample never enters TransferQueue
        outputs = output if isinstance(output, list) else [output]
        if group is not None and outputs:
            group.tokens.append(len(outputs[-1].response_ids))
        await super()._agent_loop_postprocess(output, validate, **kwargs)


_WORKER_ACTOR = ray.remote(TailSieveAgentLoopWorker)


class TailSieveAgentLoopManager(AgentLoopManagerTQ):
    """verl's ``AgentLoopManagerTQ`` whose workers are :class:`TailSieveAgentLoopWorker`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = _WORKER_ACTOR


