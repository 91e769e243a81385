"""Agent-loop side of TailSieve: group identity on every request, aborted samples kept out of
TransferQueue, per-sample measurements for the controller — on verl's unchanged
``AgentLoopManagerTQ`` / ``AgentLoopWorkerTQ``.

* :class:`TailSieveAgentLoop` (registered as ``tailsieve_agent``) wraps the agent loop the row would
  have run: the TailSieve trainer's dispatch moves a row's own ``agent_name`` into
  ``tailsieve_inner_agent``; a row that names none runs the user's ``default_agent_loop``, which the
  launch wiring (``integration.config.wire_agent_loop``) recorded before making the wrapper verl's
  default — in every trainer mode, for training and validation alike. It runs the inner loop inside
  a :class:`GroupContext` (a context variable), so single-turn, tool and user-registered loops all
  work unchanged.
* :class:`GroupTaggedClient` (the trainer's ``get_llm_client``) tags each request id with the group
  uid — for the pool router, and for the server, which aborts a group's requests by that tag
  (``abort_groups``) — and counts in the context every token the model generates for the sample.
* A sample whose generation came back aborted raises :class:`SampleAborted` out of the agent loop:
  verl then writes no trajectory for it and marks its group ``failure``, so an aborted trajectory
  never enters TransferQueue; the trainer never selects such a group either.
* ``tailsieve.stop`` strings are added to the sampling params of every row that names no agent loop
  of its own (the rows verl's stock trainer would also send through the wrapper), so a stock-verl
  baseline and a TailSieve run sample alike.
* Each sample's duration and work (its generated tokens, all turns, aborted ones included) are reported
  to the router's ledger (worker clock only), whatever the inner loop returns (one output or a list).
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any

import hydra
from omegaconf import OmegaConf

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, _agent_loop_registry, register
from verl.workers.rollout.llm_server import LLMServerClient

from tailsieve_verl.integration.config import AGENT_LOOP as AGENT_NAME
from tailsieve_verl.integration.config import INNER_AGENT_LOOP_KEY
from tailsieve_verl.integration.router import group_of_request, tag_request_id

logger = logging.getLogger(__name__)

INNER_AGENT_KEY = "tailsieve_inner_agent"  # per row: the row's own agent_name (the trainer's dispatch)
ABORT_REASONS = ("aborted", "abort")


class SampleAborted(RuntimeError):
    """Raised for a sample aborted at the bulk cutoff (expected; its group is carried)."""


@dataclass
class GroupContext:
    """State of one sample (session) of a prompt group, shared with the LLM client via a contextvar."""

    uid: str
    session_id: int = 0
    aborted: bool = False
    failed: bool = False
    # the sample's work (core.tailsieve.selector.group_work): every token the model generated for it, over all its
    # turns, an aborted turn's partial tokens included — what its outputs' response_mask marks 1, and
    # more when a turn was aborted or verl cut the response at response_length
    generated_tokens: int = 0
    refused: str | None = None  # the engine's reason, when it rejected a request of this sample


def refusal_reason(exc: BaseException) -> str | None:
    """The engine's reason when it explicitly refused the request — vLLM's request validation raises a
    ``VLLMClientError`` (``VLLMValidationError`` and kin), which no retry fixes — else None. Anything
    else, verl's own checks included (its ``ValueError`` when a multi-turn loop outgrows
    ``max_model_len``), fails the group as stock verl fails it: kept, trained with what succeeded."""
    import ray

    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else None
    if cause is None or "VLLMClientError" not in {c.__name__ for c in type(cause).__mro__}:
        return None
    return " ".join(f"{type(cause).__name__}: {cause}".split())[:300]


_SAMPLE: contextvars.ContextVar[GroupContext | None] = contextvars.ContextVar("tailsieve_sample", default=None)


class GroupTaggedClient(LLMServerClient):
    """verl's LLM client with the group uid in the routed request id and abort bookkeeping."""

    async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any):
        sample = _SAMPLE.get()
        if sample is not None:
            request_id = tag_request_id(sample.uid, str(request_id))
        try:
            output = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        except Exception as exc:
            if sample is not None:
                sample.failed = True
                sample.refused = sample.refused or refusal_reason(exc)
            raise
        if sample is not None:
            sample.generated_tokens += len(output.token_ids)
            sample.aborted = sample.aborted or output.stop_reason in ABORT_REASONS
            if not sample.aborted and hasattr(self._load_balancer, "report_progress"):  # it may go on to a tool call
                self._load_balancer.report_progress.remote(sample.uid, sample.session_id, sample.generated_tokens)
        return output

    def _vllm_request_id(self, request_id: str) -> str:
        """verl sends every turn to the server under a fresh id; keep the group tag in front of it."""
        server_id = super()._vllm_request_id(request_id)
        group = group_of_request(request_id)
        return server_id if group is None or server_id == request_id else tag_request_id(group, server_id)


@register(AGENT_NAME)
class TailSieveAgentLoop(AgentLoopBase):
    """Runs the row's own agent loop inside a :class:`GroupContext` (see module docstring)."""

    def __init__(self, **kwargs: Any):
        self._init_kwargs = kwargs
        self.server_manager = kwargs["server_manager"]
        config = kwargs["trainer_config"].config
        rollout = config.actor_rollout_ref.rollout
        default = rollout.agent.default_agent_loop
        # Recorded by the launch wiring (integration.config.wire_agent_loop) when it made this wrapper verl's default.
        self.default_agent = OmegaConf.select(rollout, f"custom.{INNER_AGENT_LOOP_KEY}", default=None) or default
        # Validated at start-up (integration.config): the stop strings every request carries.
        self.stop = list(OmegaConf.select(config, "tailsieve.stop", default=None) or ())

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput | list[AgentLoopOutput]:
        own_agent = kwargs.pop(INNER_AGENT_KEY, None)
        inner_name = own_agent or self.default_agent
        if inner_name == AGENT_NAME or inner_name not in _agent_loop_registry:
            raise ValueError(f"tailsieve_agent cannot wrap agent loop {inner_name!r}; registered: "
                             f"{sorted(_agent_loop_registry)}")
        inner = hydra.utils.instantiate(config=_agent_loop_registry[inner_name], **self._init_kwargs)
        if self.stop and own_agent is None:
            sampling_params = {**sampling_params, "stop": self.stop}
        sample = GroupContext(uid=str(kwargs["uid"]), session_id=int(kwargs.get("session_id") or 0))
        token = _SAMPLE.set(sample)
        start = time.monotonic()
        output = None
        try:
            output = await inner.run(sampling_params, **kwargs)
        finally:
            _SAMPLE.reset(token)
            self._report(sample, time.monotonic() - start, output)
        if sample.aborted:
            raise SampleAborted(f"group {sample.uid} sample {kwargs.get('session_id')} aborted at the bulk cutoff "
                                f"(expected: the group is carried to the next step)")
        return output

    def _report(self, sample: GroupContext, duration_s: float,
                output: AgentLoopOutput | list[AgentLoopOutput] | None) -> None:
        """The sample's measurements, for the router's ledger; the work is the client's count, so a loop
        that returns several outputs (verl's TransferQueue worker stores each) is measured like one."""
        balancer = getattr(self.server_manager, "_load_balancer", None)
        if balancer is None or not hasattr(balancer, "report_sample"):
            return
        balancer.report_sample.remote({
            "uid": sample.uid, "session_id": sample.session_id, "duration_s": duration_s,
            "tokens": sample.generated_tokens, "aborted": sample.aborted, "refused": sample.refused,
            "failed": sample.failed or (output is None and not sample.aborted)})
