"""verl's vLLM server with what the TailSieve trainer asks of every server it runs on.

* ``abort_groups(group_uids)``: the bulk cutoff aborts only the groups it carries. verl's
  ``abort_all_requests`` pauses the whole engine and parks later admissions until a resume, which
  would abort committed groups sharing the replica and park a multi-turn loop's next turn. Here the
  engine keeps running: the requests of those groups are aborted through ``AsyncLLM.abort`` (by the
  id the server was given, ``ts:<group uid>:<rest>``, see :mod:`integration.router`; vLLM maps it
  to its internal ids, suffixes included), a request of theirs still on its way into the engine is
  cancelled, and their later requests (a next turn, a sample not sent yet) come back aborted at once.
* ``progress()``: tokens generated so far and requests in flight, for the trainer's stall detection.
* ``check_engine()``: the engine's own health, not just the Ray actor's (a dead engine process
  behind a live actor still answers ``get_server_address``).

Installed for ``rollout.name=vllm`` by the TailSieve trainer (:func:`integration.engine_config.install_tailsieve_vllm`);
a module-level class so Ray workers import it by path.
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

from tailsieve_verl.integration.router import AbortedGroups, group_of_request


class TailSieveVLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server plus per-group abort, progress and engine health (see module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._aborted_groups = AbortedGroups()
        self._group_requests: dict[str, dict[str, asyncio.Task]] = {}
        self._completed_tokens = 0

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       *args: Any, **kwargs: Any) -> TokenOutput:
        group = group_of_request(request_id)
        if group is None:
            return await self._counted(super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs))
        if group in self._aborted_groups:
            return self._aborted_output()
        task = asyncio.ensure_future(super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs))
        self._group_requests.setdefault(group, {})[request_id] = task
        try:
            return await self._counted(task)
        except asyncio.CancelledError:
            if task.cancelled() and group in self._aborted_groups:  # cancelled by abort_groups, not by the caller
                return self._aborted_output()
            raise
        finally:
            requests = self._group_requests.get(group, {})
            requests.pop(request_id, None)
            if not requests:
                self._group_requests.pop(group, None)

    async def _counted(self, generation) -> TokenOutput:
        output = await generation
        self._completed_tokens += len(output.token_ids)
        return output

    def _aborted_output(self) -> TokenOutput:
        return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted",
                           extra_fields={"global_steps": self.global_steps})

    async def abort_groups(self, group_uids: list[str]) -> dict[str, Any]:
        """Abort these groups' requests (partial tokens come back with stop_reason="aborted") and
        answer their later requests aborted at once; nothing is paused."""
        if self.node_rank != 0:  # only node rank 0 owns the engine (verl's abort_all_requests does the same)
            return {"aborted_count": 0, "request_ids": []}
        groups = self._aborted_groups.add(group_uids)
        processor = self.engine.output_processor
        known = getattr(processor, "external_req_ids", None) or processor.request_states  # vLLM < 0.32: one id
        in_engine = [rid for rid in list(known) if group_of_request(rid) in groups]
        if in_engine:
            await self.engine.abort(in_engine)
        entering = [task for group in groups for rid, task in self._group_requests.get(group, {}).items()
                    if rid not in in_engine and not task.done()]
        for task in entering:  # on its way into the engine: vLLM aborts a cancelled generate itself
            task.cancel()
        return {"aborted_count": len(in_engine) + len(entering), "request_ids": in_engine}

    def progress(self) -> dict[str, int]:
        """Tokens generated so far (finished requests and the running ones) and requests in flight."""
        if self.node_rank != 0:
            return {"tokens": 0, "in_flight": 0}
        states = list(self.engine.output_processor.request_states.values())
        running = sum(s.detokenizer.num_output_tokens() for s in states if s.detokenizer is not None)
        return {"tokens": self._completed_tokens + running, "in_flight": len(states)}

    async def check_engine(self) -> bool:
        """Raises when the engine is dead (vLLM's own health check)."""
        if self.node_rank == 0:
            await self.engine.check_health()
        return True
