"""Simulated rollout backend ``actor_rollout_ref.rollout.name=tailsieve_sim`` (a product feature): a
simulated inference server, not the closed-loop simulator of :mod:`tailsieve_verl.core.simulation.sim`.

A :class:`SimReplica` is registered in verl's ``RolloutReplicaRegistry``; each replica runs one
:class:`SimServer` Ray actor (CPU only) that speaks the token-in/token-out API of verl's
``vLLMHttpServer`` — ``generate``, ``abort_all_requests`` (pause + abort, parked admissions),
``resume_generation``, ``wait_for_requests_to_drain``, sleep/wake — and decodes with the core's
continuous-batching model: FIFO admission under ``max_num_seqs``, one token per active request per
step, a step costing ``perf.step_time(active, mean_context)`` seconds (the formula of
``core.engine.replica.simulate_replica``), stretched by ``tailsieve.sim.time_scale`` into wall time.

Why: a user can dry-run a recipe's routing on a CPU, and the tests drive verl's real rollout path
(agent loops, TransferQueue, replay buffer, router) without a GPU. The weights are not simulated:
``tailsieve_sim`` runs as standalone replicas (the trainer's weight sync to them is a no-op).

Beyond verl's server API it answers what the TailSieve trainer asks every server it runs on (the
vLLM subclass in :mod:`integration.engine_config` answers the same): ``abort_groups`` (abort one
prompt group's requests, and every later one, without pausing the engine), ``progress`` (tokens
generated so far, for the trainer's stall detection) and ``check_engine`` (liveness of the engine,
not just of the actor). :meth:`SimServer.inject_fault` breaks a server on purpose (fault drills, tests).

Response lengths (documented source): :class:`LengthModel`, a deterministic per-prompt log-normal
model — the prompt's token ids seed its mean (the prompt effect, ``sim.prompt_sigma``), the request
id seeds the sample around it (the sampling effect, ``sim.sample_sigma``). Generated token ids are
real ids of the tokenizer (its non-special vocabulary), so verl's pipeline decodes them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import ray

from tailsieve_verl.core.engine.perf import PerfModel, parse_perf_model
from tailsieve_verl.integration.config import SIM_ROLLOUT_NAME, SimBackendConfig, parse_tailsieve_section
from tailsieve_verl.integration.router import AbortedGroups, group_of_request

logger = logging.getLogger(__name__)


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class VLLMClientError(Exception):
    """Named as vLLM's base of the request errors it refuses with (``vllm.exceptions``), which
    ``integration.agent_loop.refusal_reason`` recognises by name: vLLM is not installed beside verl here."""


class VLLMValidationError(VLLMClientError):
    """vLLM's refusal of a request its validation rejects."""


@dataclass(frozen=True)
class LengthModel:
    """Deterministic response lengths: ``mean · exp(σp·zp − σp²/2) · exp(σs·zs − σs²/2)`` where
    ``zp`` is seeded by the prompt ids and ``zs`` by the request; clipped to ``[1, max_tokens]``."""

    mean: float
    prompt_sigma: float
    sample_sigma: float
    seed: int = 0

    def prompt_mean(self, prompt_ids: list[int]) -> float:
        z = np.random.default_rng(_seed(self.seed, "prompt", *prompt_ids)).standard_normal()
        return self.mean * float(np.exp(self.prompt_sigma * z - self.prompt_sigma**2 / 2))

    def sample(self, prompt_ids: list[int], request_key: str, max_tokens: int) -> int:
        z = np.random.default_rng(_seed(self.seed, "sample", request_key)).standard_normal()
        length = self.prompt_mean(prompt_ids) * float(np.exp(self.sample_sigma * z - self.sample_sigma**2 / 2))
        return int(min(max(round(length), 1), max_tokens))


@dataclass
class _Request:
    request_id: str
    prompt_len: int
    target: int
    tokens: list[int]
    done: asyncio.Future
    generated: int = 0


@dataclass
class SimStats:
    """Cumulative counters of one server (simulated seconds are model seconds, before time_scale)."""

    completed: int = 0
    aborted: int = 0
    tokens: int = 0
    aborted_tokens: int = 0
    busy_sim_s: float = 0.0
    steps: int = 0
    max_active: int = 0
    per_request_finish: dict = field(default_factory=dict)


class SimServer:
    """One simulated inference server (wrapped by ``ray.remote`` in :class:`SimReplica`)."""

    def __init__(self, replica_rank: int, max_num_seqs: int, max_model_len: int, response_length: int,
                 tailsieve_section: dict, vocab_ids: list[int], address: str):
        cfg = parse_tailsieve_section(tailsieve_section)
        self.sim: SimBackendConfig = cfg.sim
        self.perf: PerfModel = parse_perf_model(cfg.sim.perf_model or cfg.perf_model)
        self.lengths = LengthModel(cfg.sim.mean_response_len, cfg.sim.prompt_sigma, cfg.sim.sample_sigma, cfg.sim.seed)
        self.replica_rank = replica_rank
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.response_length = response_length
        self.vocab_ids = np.asarray(vocab_ids, dtype=np.int64)
        self.address = address
        self.global_steps: Optional[int] = None
        self.stats = SimStats()
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []
        self._wake = asyncio.Event()
        self._paused = False
        self._resume_event = asyncio.Event()
        self._resume_event.set()
        self._rejecting = False
        self._loop_task: asyncio.Task | None = None
        self._aborted_groups = AbortedGroups()
        self._chunk: tuple[float, np.ndarray] | None = None  # the decode steps being slept through
        self._fault: str | None = None
        # verl's output type, imported here: a first import inside generate() would block the actor's
        # event loop for seconds, and every other call (progress, abort) with it
        from verl.workers.rollout.replica import TokenOutput

        self._token_output = TokenOutput

    # ---- verl server API -------------------------------------------------------------------
    def get_server_address(self) -> tuple[str, int]:
        return self.address, 0

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       audio_data: Optional[list[Any]] = None, mm_processor_kwargs: Optional[dict] = None,
                       priority: int = 0, **_: Any):
        self._raise_if_engine_dead()
        while self._paused:  # parked behind a closed gate, like vLLMHttpServer._park_until_admitted
            if self._rejecting:
                return self._token_output(token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps})
            await self._resume_event.wait()
        if group_of_request(request_id) in self._aborted_groups:  # a later turn or sample of an aborted group
            self.stats.aborted += 1
            return self._token_output(token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps})
        prompt_ids = [int(t) for t in prompt_ids]
        if self.sim.max_prompt_tokens is not None and len(prompt_ids) > self.sim.max_prompt_tokens:
            raise VLLMValidationError(f"The prompt (length {len(prompt_ids)}) is longer than the engine accepts "
                                      f"({self.sim.max_prompt_tokens} tokens)")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"Prompt length ({len(prompt_ids)}) leaves no room to generate within "
                             f"max_model_len {self.max_model_len}")
        max_tokens = int(sampling_params.get("max_tokens") or self.response_length)
        max_tokens = max(1, min(max_tokens, room, self.response_length))
        target = self.lengths.sample(prompt_ids, request_id, max_tokens)
        rng = np.random.default_rng(_seed(self.lengths.seed, "tokens", request_id))
        tokens = self.vocab_ids[rng.integers(0, len(self.vocab_ids), size=target)].tolist()
        request = _Request(request_id, len(prompt_ids), target, tokens, asyncio.get_running_loop().create_future())
        self._waiting.append(request)
        self._ensure_loop()
        self._wake.set()
        generated, stop_reason = await request.done
        log_probs = [0.0] * generated if sampling_params.get("logprobs") else None
        return self._token_output(token_ids=tokens[:generated], log_probs=log_probs, stop_reason=stop_reason,
                           num_preempted=0, extra_fields={"global_steps": self.global_steps})

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Close the admission gate and abort every waiting and running request (partial tokens are
        returned with stop_reason="aborted"); stays paused until :meth:`resume_generation`."""
        self._paused = True
        self._rejecting = reject_request
        self._resume_event.clear()
        self._exit_if("exit_on_abort")
        victims = self._active + self._waiting
        self._finish_aborted(victims)
        return {"aborted_count": len(victims), "request_ids": [r.request_id for r in victims]}

    async def abort_groups(self, group_uids: list[str]) -> dict:
        """Abort the waiting and running requests of these prompt groups (partial tokens returned with
        stop_reason="aborted") and answer their later requests aborted at once; the engine keeps running."""
        self._exit_if("exit_on_abort")
        groups = self._aborted_groups.add(group_uids)
        victims = [r for r in self._active + self._waiting if group_of_request(r.request_id) in groups]
        self._finish_aborted(victims)
        return {"aborted_count": len(victims), "request_ids": [r.request_id for r in victims]}

    def _finish_aborted(self, victims: list[_Request]) -> None:
        """Settle aborted requests, crediting the running ones with the decode steps of the current chunk."""
        done_steps = self._chunk_steps()
        running = {id(r) for r in self._active}
        for request in victims:
            if id(request) in running:
                steps = min(done_steps, request.target - request.generated)
                request.generated += steps
                self.stats.tokens += steps
        gone = {id(r) for r in victims}
        self._active = [r for r in self._active if id(r) not in gone]
        self._waiting = [r for r in self._waiting if id(r) not in gone]
        for request in victims:
            self.stats.aborted += 1
            self.stats.aborted_tokens += request.generated
            if not request.done.done():
                request.done.set_result((request.generated, "aborted"))
        self._wake.set()

    def progress(self) -> dict:
        """Tokens generated so far (the decode steps under way included) and requests in flight."""
        return {"tokens": self.stats.tokens + len(self._active) * self._chunk_steps(),
                "in_flight": len(self._active) + len(self._waiting)}

    def _chunk_steps(self) -> int:
        """Whole decode steps done so far in the chunk the decode loop is sleeping through."""
        if self._chunk is None:
            return 0
        start, clock = self._chunk
        return int(np.searchsorted(clock, (time.monotonic() - start) / self.sim.time_scale, side="right"))

    def check_engine(self) -> bool:
        """Raises when the engine is dead (the actor may still answer)."""
        self._raise_if_engine_dead()
        return True

    def inject_fault(self, fault: str) -> None:
        """Break this server on purpose: ``engine_dead`` (the engine dies now, the actor lives on: running
        requests fail, nothing decodes), ``engine_hung`` (the engine stops decoding but its health check
        passes, as vLLM's only reads an error flag; waiting for its requests to drain, e.g. verl's sleep,
        never returns), ``exit_on_abort`` (the actor exits when asked to abort)."""
        if fault not in ("engine_dead", "engine_hung", "exit_on_abort"):
            raise ValueError(f"unknown fault {fault!r}")
        self._fault = fault
        self._wake.set()  # the decode loop sees the fault now
        if fault == "engine_dead":
            for request in self._active + self._waiting:
                if not request.done.done():
                    request.done.set_exception(RuntimeError(f"simulated engine of {self.address} is dead"))
            self._active, self._waiting = [], []
            self._wake.set()

    def _raise_if_engine_dead(self) -> None:
        if self._fault == "engine_dead":
            raise RuntimeError(f"simulated engine of {self.address} is dead")

    def _exit_if(self, fault: str) -> None:
        if self._fault == fault:
            ray.actor.exit_actor()

    async def resume_generation(self) -> None:
        self._paused = False
        self._rejecting = False
        self._resume_event.set()

    async def resume_engine_generation(self) -> None:
        return None

    async def open_submission_gate(self) -> None:
        await self.resume_generation()

    async def wait_for_requests_to_drain(self) -> None:
        if self._fault == "engine_hung":
            await asyncio.Event().wait()
        while self._active or self._waiting:
            await asyncio.sleep(0.005)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    # ---- introspection (tests, dry runs) ------------------------------------------------------
    def get_stats(self) -> dict:
        s = self.stats
        return {"completed": s.completed, "aborted": s.aborted, "tokens": s.tokens, "aborted_tokens": s.aborted_tokens,
                "busy_sim_s": s.busy_sim_s, "steps": s.steps, "max_active": s.max_active,
                "active": len(self._active), "waiting": len(self._waiting), "paused": self._paused}

    # ---- decode loop ---------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._decode_loop())

    async def _decode_loop(self) -> None:
        while self._fault not in ("engine_dead", "engine_hung"):
            while len(self._active) < self.max_num_seqs and self._waiting:  # FIFO admission under max_num_seqs
                self._active.append(self._waiting.pop(0))
            if not self._active:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.stats.max_active = max(self.stats.max_active, len(self._active))
            active = len(self._active)
            mean_ctx = float(np.mean([r.prompt_len + r.generated for r in self._active]))
            horizon = min(r.target - r.generated for r in self._active)  # steps to the next finish
            step_s = np.asarray(self.perf.step_time(np.full(horizon, active), mean_ctx + np.arange(horizon)), dtype=float)
            clock = np.cumsum(step_s)
            self._wake.clear()
            start = time.monotonic()
            self._chunk = (start, clock)
            woken = False
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=float(clock[-1]) * self.sim.time_scale)
                woken = True
            except asyncio.TimeoutError:
                pass
            self._chunk = None
            if not self._active:  # aborted while sleeping
                continue
            steps = horizon
            if woken:  # an arrival or an abort: count only the whole steps that elapsed
                elapsed_sim = (time.monotonic() - start) / self.sim.time_scale
                steps = int(np.searchsorted(clock, elapsed_sim, side="right"))
            if steps == 0:
                continue
            self.stats.steps += steps
            self.stats.busy_sim_s += float(clock[steps - 1])
            still_active = []
            for request in self._active:
                request.generated += steps
                self.stats.tokens += steps
                if request.generated >= request.target:
                    self.stats.completed += 1
                    request.done.set_result((request.target, "completed"))
                else:
                    still_active.append(request)
            self._active = still_active


def _vocab_ids(tokenizer: Any) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(len(tokenizer)) if i not in special]
    if not ids:
        raise ValueError("the tokenizer has no non-special tokens for the simulated backend to emit")
    return ids


_SIM_REPLICA_CLASS = None


def sim_replica_class():
    """verl's RolloutReplica subclass for ``tailsieve_sim`` (built on first use; verl imported lazily)."""
    global _SIM_REPLICA_CLASS
    if _SIM_REPLICA_CLASS is None:
        _SIM_REPLICA_CLASS = _build_sim_replica_class()
    return _SIM_REPLICA_CLASS


def _build_sim_replica_class():
    from verl.workers.rollout.replica import RolloutMode, RolloutReplica

    class SimReplica(RolloutReplica):
        """verl rollout replica whose single server is a CPU :class:`SimServer` actor.

        Works in the standalone and hybrid layouts: it never asks for GPU bundles, but its servers are
        pinned to the nodes verl's layout would give the replica (:meth:`_layout_nodes`), so a
        multi-node Ray cluster holds the simulated replicas where it would hold real ones."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.server_class = ray.remote(SimServer)

        async def init_hybrid(self, worker_group: Any) -> None:
            self.rollout_mode = RolloutMode.HYBRID
            await self.launch_servers()

        async def init_standalone(self) -> None:
            self.rollout_mode = RolloutMode.STANDALONE
            await self.launch_servers()

        async def launch_servers(self) -> None:
            from tailsieve_verl.integration.engine_config import pool_engine, settings_from_rollout_config

            settings = settings_from_rollout_config(self.config)
            pool = pool_engine(self.replica_rank, settings)
            max_num_seqs = pool.max_num_seqs or int(self.config.max_num_seqs)
            max_model_len = int(self.config.max_model_len or (self.config.prompt_length + self.config.response_length))
            node_ip = ray.util.get_node_ip_address()
            address = f"{SIM_ROLLOUT_NAME}-{self.replica_rank}{self.name_suffix}@{node_ip}"
            section = (self.config.custom or {}).get("tailsieve") or {}
            # the server needs verl's TokenOutput type only, not the plugins (keeps its start-up light)
            runtime_env = {"env_vars": {"VERL_USE_EXTERNAL_PLUGINS": "none"}}
            vocab = _vocab_ids(self._tokenizer())
            self.servers = [
                self.server_class.options(
                    max_concurrency=self.max_concurrency, num_cpus=0, runtime_env=runtime_env,
                    scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(self.replica_rank, max_num_seqs, max_model_len, int(self.config.response_length),
                         dict(section), vocab, address)
                for node in self._layout_nodes()]
            self._server_address, _ = await self.servers[0].get_server_address.remote()
            self._server_handle = self.servers[0]

        def _layout_nodes(self) -> list[str]:
            """The Ray nodes verl's layout gives this replica, one server on each as vLLMReplica launches
            them (the first serves): replica r holds GPU slots [r·w, (r+1)·w) of nodes filled in the order
            verl sorts its placement groups (node IP; then node id, where nodes share an IP)."""
            nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
            first = self.replica_rank * self.world_size
            slots = range(first, first + self.world_size)
            indices = dict.fromkeys(slot // self.gpus_per_node % len(nodes) for slot in slots)
            return [nodes[i]["NodeID"] for i in indices]

        def _tokenizer(self) -> Any:
            from omegaconf import DictConfig

            from verl.utils.config import omega_conf_to_dataclass

            model_config = self.model_config
            if isinstance(model_config, DictConfig):
                model_config = omega_conf_to_dataclass(model_config)
            return model_config.tokenizer

        async def sleep(self) -> None:
            await self.servers[0].wait_for_requests_to_drain.remote()

        async def abort_all_requests(self, reject_request: bool = False) -> dict:
            return await self.servers[0].abort_all_requests.remote(reject_request=reject_request)

    return SimReplica
