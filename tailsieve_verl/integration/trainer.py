"""The ``tailsieve`` V1 trainer mode (``trainer.v1.trainer_mode=tailsieve``).

It is verl's synchronous trainer (``PPOTrainerSync``: colocated rollout, weights synced every step)
with TailSieve's rollout step in place of "submit B prompts, wait for B groups":

1. ``prepare_step``: the controller's (q, m) picks the pools; the selector's plan sends every
   carried group (regenerated from scratch, new verl uid) to the tail pool and ``B − T + q`` fresh
   prompts to the bulk pool; the router learns each group's pool.
2. ``replay_buffer.sample`` (:class:`TailSieveReplayBuffer`): as soon as ``B − T`` bulk groups have
   finished, the bulk replicas are aborted; the step waits until every tail group finished and every
   bulk group settled (the engines drained), clears the unselected bulk groups from TransferQueue,
   keeps their prompt rows as the carried queue, and hands exactly B groups to verl's pipeline.
   A group whose replica died is re-dispatched to a live replica of its pool.
3. ``on_step_end``: verl's weight update, then the aborted bulk replicas resume generation.

With ``tailsieve.enable=false`` / ``mode=uniform`` the same path runs with (q, m) = (0, 0): one pool
of all replicas, B fresh groups round-robin, nothing aborted — uniform group routing.

Carried prompt rows and the selector/controller state are saved next to verl's checkpoint
(``global_step_N/tailsieve.pt``) and restored on resume.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
import transfer_queue as tq
from omegaconf import DictConfig
from tensordict import TensorDict

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils as tu
from verl.utils.transferqueue_utils import KVBatchMeta

from tailsieve_verl.core.bias import LengthBiasMonitor
from tailsieve_verl.core.controller import Decision, GroupRecord, HierarchicalController, StepObservation
from tailsieve_verl.core.selector import StepOutcome, StepPlan, TailSelector
from tailsieve_verl.integration.config import TRAINER_MODE, TailSieveConfig, rollout_replica_count, wire_verl_config
from tailsieve_verl.integration.engine_config import has_pool_engine_settings, install_pool_specialised_vllm
from tailsieve_verl.integration.metrics import StepMeasurement, step_metrics
from tailsieve_verl.integration.router import BULK, TAIL

logger = logging.getLogger(__name__)

STATE_FILE = "tailsieve.pt"
PARTITION = "train"
MAX_DISPATCH_ATTEMPTS = 3


class RolloutStepError(RuntimeError):
    """A step cannot complete (a group failed on every attempt, or the drain timed out)."""


@dataclass
class InflightGroup:
    """One dispatch attempt of a prompt group."""

    identity: str  # stable prompt identity (the verl uid of its first fetch)
    uid: str  # verl uid of this attempt (TransferQueue key)
    pool: str
    row: TensorDict  # the prompt row, re-submittable as is
    attempt: int = 1


@dataclass
class ActiveStep:
    plan: StepPlan
    m_used: int
    tail_addresses: list[str]
    bulk_addresses: list[str]
    fresh_ids: list[str]
    groups: dict[str, InflightGroup] = field(default_factory=dict)  # by attempt uid
    started: float = field(default_factory=time.monotonic)
    cutoff_s: float | None = None
    selected_bulk: list[str] = field(default_factory=list)  # attempt uids, in the order seen finished
    redispatched: int = 0


def _row(batch: TensorDict, index: int) -> TensorDict:
    return batch[index : index + 1]


class TailSieveReplayBuffer(ReplayBuffer):
    """verl's sync ReplayBuffer; the training partition is sampled by the TailSieve step."""

    def __init__(self, trainer: "TailSieveTrainer", **kwargs):
        super().__init__(**kwargs)
        self._trainer = trainer

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        if partition_id != PARTITION:
            return super().sample(global_steps, partition_id, batch_size)
        return self._trainer.finish_rollout_step(self, batch_size)

    def selected_batch(self, uids: list[str]) -> KVBatchMeta:
        """The trajectories of ``uids`` as a verl batch (clears their prompt keys like verl does)."""
        self._sync_metadata_from_transfer_queue()
        return self._materialize_batch(PARTITION, uids, dict(self.partitions[PARTITION]))

    def trajectory_keys(self, uids: set[str]) -> list[str]:
        self._sync_metadata_from_transfer_queue()
        return [key for key in self.partitions[PARTITION] if key.split("_")[0] in uids]


@register_trainer(TRAINER_MODE)
class TailSieveTrainer(PPOTrainerSync):
    """verl's synchronous trainer with TailSieve's partial-rollout tail routing."""

    def __init__(self, config: DictConfig):
        self.settings: TailSieveConfig = wire_verl_config(config)  # raises before anything launches
        if has_pool_engine_settings(self.settings) and config.actor_rollout_ref.rollout.name == "vllm":
            install_pool_specialised_vllm()
        super().__init__(config)
        self.batch_size = int(config.data.train_batch_size)
        self.n_replicas = rollout_replica_count(config)
        self.samples_per_group = int(config.actor_rollout_ref.rollout.n)
        self.selector = TailSelector(self.batch_size)
        self.controller: HierarchicalController | None = None
        if self.settings.active:
            self.controller = HierarchicalController(
                self.settings.controller_config(), self.n_replicas, self.batch_size, self.settings.perf())
        self.decision = self.controller.decision if self.controller else Decision(0, 0, "uniform")
        self.carried_rows: dict[str, TensorDict] = {}
        self.step_state: ActiveStep | None = None
        self.paused_addresses: list[str] = []
        self.tailsieve_metrics: dict[str, float] = {}
        self.last_outcome: StepOutcome | None = None  # the last step's consumed/carried identities
        self.bias_monitor = LengthBiasMonitor() if self.settings.log_bias else None  # not checkpointed

    # ---- verl hooks --------------------------------------------------------------------------
    def _build_replay_buffer(self) -> ReplayBuffer:
        sampler = self.config.trainer.v1.sampler
        return TailSieveReplayBuffer(
            self, trainer_mode=self.trainer_mode, trainer_config={},
            max_off_policy_threshold=sampler.max_off_policy_threshold,
            max_off_policy_strategy=sampler.max_off_policy_strategy, sampler_kwargs=sampler.sampler_kwargs,
            poll_interval=self.settings.poll_interval_s, refill_fn=self._add_prompts_to_generate,
            train_batch_size=int(self.config.data.train_batch_size), gen_batch_size=1)

    def get_llm_client(self):
        from tailsieve_verl.integration.agent_loop import GroupTaggedClient  # see _dispatch

        return self.llm_server_manager.get_client(client_cls=GroupTaggedClient)

    def on_train_begin(self):
        """Drop TransferQueue leftovers of a restored checkpoint (the batch trained at that step);
        TailSieve never checkpoints in-flight groups — its carried queue lives in tailsieve.pt."""
        listing = tq.kv_list(PARTITION) or {}
        leftovers = list(listing.get(PARTITION, {}))
        if leftovers:
            tq.kv_clear(keys=leftovers, partition_id=PARTITION)
            logger.info("TailSieve: cleared %d TransferQueue keys restored from the checkpoint", len(leftovers))

    def prepare_step(self) -> dict:
        self.begin_rollout_step()
        return {}

    def on_step_end(self):
        super().on_step_end()  # verl's weight update
        self._resume_paused()

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int):
        batch = super()._step_once(metrics, timing_raw, sample_batch_size)
        metrics.update(self.tailsieve_metrics)
        self.tailsieve_metrics = {}
        return batch

    # ---- the rollout step ----------------------------------------------------------------------
    @property
    def router(self):
        return self.llm_server_manager.global_load_balancer

    def _replicas_by_address(self) -> dict:
        return {replica.server_address: replica for replica in self.llm_server_manager.get_replicas()}

    def begin_rollout_step(self) -> None:
        if self.step_state is not None:
            raise RolloutStepError("a TailSieve step is already in flight")
        plan = self.selector.plan_step(self.decision.q)
        addresses = list(self._replicas_by_address())
        m = min(self.decision.m, len(addresses) - 1) if plan.tail_ids else 0
        tail_addresses, bulk_addresses = addresses[:m], addresses[m:]
        ray.get(self.router.set_pools.remote(tail_addresses))

        fresh = self._next_train_batch(plan.n_fresh) if plan.n_fresh else None
        fresh_ids = [str(uid) for uid in fresh["uid"]] if fresh is not None else []
        state = ActiveStep(plan, m, tail_addresses, bulk_addresses, fresh_ids)
        rows = [(identity, TAIL, self.carried_rows.pop(identity)) for identity in plan.tail_ids]
        rows += [(identity, BULK, _row(fresh, i)) for i, identity in enumerate(fresh_ids)]
        self._dispatch(state, rows)
        self.step_state = state

    def _dispatch(self, state: ActiveStep, rows: list[tuple[str, str, TensorDict]], attempt: int = 1) -> None:
        """Submit prompt rows under fresh verl uids, each declared to the router with its pool."""
        # imported here, not at module level: verl's plugin loader imports this module and agent_loop
        # from inside `import verl`, so neither may need the other fully initialised at import time
        from tailsieve_verl.integration.agent_loop import AGENT_NAME, INNER_AGENT_KEY

        if not rows:
            return
        pools = {}
        for identity, pool, row in rows:
            uid = str(uuid.uuid4())
            state.groups[uid] = InflightGroup(identity, uid, pool, row, attempt)
            pools[uid] = pool
        batch = rows[0][2] if len(rows) == 1 else tu.concat_tensordict([row for _, _, row in rows])
        batch = batch.clone(recurse=False)
        inner = list(batch["agent_name"]) if "agent_name" in batch.keys() else [None] * len(pools)
        tu.assign_non_tensor_stack(batch, INNER_AGENT_KEY, [getattr(x, "data", x) for x in inner])
        tu.assign_non_tensor_stack(batch, "agent_name", [AGENT_NAME] * len(pools))
        tu.assign_non_tensor_stack(batch, "uid", list(pools))
        tu.assign_non_tensor_data(batch, "global_steps", self.global_steps)
        ray.get(self.router.assign_groups.remote(pools))
        self._submit_batch_to_rollout(batch)

    def finish_rollout_step(self, buffer: TailSieveReplayBuffer, batch_size: int) -> tuple[KVBatchMeta, dict]:
        state = self.step_state
        if state is None:
            raise RolloutStepError("replay_buffer.sample called before prepare_step")
        if batch_size != self.batch_size:
            raise RolloutStepError(f"TailSieve samples whole steps of {self.batch_size} groups, asked for {batch_size}")
        plan = state.plan
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while True:
            statuses = self._statuses(state)
            self._redispatch_failed(state, statuses)
            finished_bulk = [uid for uid, g in state.groups.items()
                             if g.pool == BULK and statuses.get(uid) == "finished" and uid not in state.selected_bulk]
            if state.cutoff_s is None:
                state.selected_bulk.extend(finished_bulk[: plan.bulk_quota - len(state.selected_bulk)])
                if len(state.selected_bulk) == plan.bulk_quota:
                    state.cutoff_s = time.monotonic() - state.started
                    self._abort_bulk(state, statuses)
            tail_done = all(statuses.get(uid) == "finished" for uid, g in state.groups.items() if g.pool == TAIL)
            bulk_settled = all(statuses.get(uid) in ("finished", "failure") for uid, g in state.groups.items()
                               if g.pool == BULK)
            if state.cutoff_s is not None and tail_done and bulk_settled:
                break
            if state.cutoff_s is not None and not tail_done and self.paused_addresses:
                self._resume_paused()  # a tail group re-dispatched onto a bulk replica must not stay parked
            if time.monotonic() > deadline:
                raise RolloutStepError(
                    f"step {self.global_steps}: groups still running after tailsieve.drain_timeout_s="
                    f"{self.settings.drain_timeout_s}s: {sum(1 for s in statuses.values() if s not in ('finished', 'failure'))}")
            time.sleep(self.settings.poll_interval_s)
        return self._close_step(buffer, state)

    def _statuses(self, state: ActiveStep) -> dict[str, str]:
        listing = (tq.kv_list(PARTITION) or {}).get(PARTITION, {})
        return {uid: listing[uid].get("status") for uid in state.groups if uid in listing}

    def _redispatch_failed(self, state: ActiveStep, statuses: dict[str, str]) -> None:
        """Groups that failed (e.g. their replica died) before the cutoff run again on a live replica."""
        failed = [state.groups[uid] for uid, s in statuses.items() if s == "failure"
                  and (state.groups[uid].pool == TAIL or state.cutoff_s is None)]
        if not failed:
            return
        self._drop_dead_replicas([g.uid for g in failed])
        for group in failed:
            if group.attempt >= MAX_DISPATCH_ATTEMPTS:
                raise RolloutStepError(f"prompt group {group.identity} failed {group.attempt} times; see the "
                                       f"agent-loop worker logs")
        self._forget(state, [g.uid for g in failed])
        for group in failed:
            self._dispatch(state, [(group.identity, group.pool, group.row)], attempt=group.attempt + 1)
        state.redispatched += len(failed)

    def _drop_dead_replicas(self, uids: list[str]) -> None:
        servers = ray.get(self.router.group_servers.remote(uids))
        replicas = self._replicas_by_address()
        dead = []
        for address in set(servers.values()):
            replica = replicas.get(address)
            if replica is None:
                continue
            try:
                ray.get(replica.server_handle.get_server_address.remote(), timeout=10)
            except Exception:  # RayActorError, GetTimeoutError: the server is gone
                dead.append(replica)
        if not dead:
            return
        addresses = [r.server_address for r in dead]
        logger.warning("TailSieve: rollout replicas %s are down; re-dispatching their groups", addresses)
        ray.get(self.router.remove_servers.remote(addresses))
        self.llm_server_manager.rollout_replicas = [r for r in self.llm_server_manager.rollout_replicas if r not in dead]
        self.checkpoint_manager.remove_replicas(dead)
        self.paused_addresses = [a for a in self.paused_addresses if a not in addresses]
        if self.step_state is not None:
            self.step_state.tail_addresses = [a for a in self.step_state.tail_addresses if a not in addresses]
            self.step_state.bulk_addresses = [a for a in self.step_state.bulk_addresses if a not in addresses]

    def _abort_bulk(self, state: ActiveStep, statuses: dict[str, str]) -> None:
        selected = set(state.selected_bulk)
        running = [uid for uid, g in state.groups.items() if g.pool == BULK and uid not in selected
                   and statuses.get(uid) not in ("finished", "failure")]
        if not running:
            return
        replicas = self._replicas_by_address()
        targets = [replicas[a] for a in state.bulk_addresses if a in replicas]
        # every server of a replica, like verl's RolloutReplica.abort_all_requests (the engine pauses
        # and parks later admissions until resume_generation)
        ray.get([server.abort_all_requests.remote() for replica in targets for server in replica.servers])
        self.paused_addresses = [r.server_address for r in targets]

    def _resume_paused(self) -> None:
        if not self.paused_addresses:
            return
        replicas = self._replicas_by_address()
        for address in self.paused_addresses:
            replica = replicas.get(address)
            if replica is not None:
                ray.get([server.resume_generation.remote() for server in replica.servers])
        self.paused_addresses = []

    def _forget(self, state: ActiveStep, uids: list[str]) -> None:
        """Remove attempts from TransferQueue (prompt key and any trajectory) and from the step."""
        if not uids:
            return
        keys = list(uids) + self.replay_buffer.trajectory_keys(set(uids))
        tq.kv_clear(keys=keys, partition_id=PARTITION)
        ray.get(self.router.forget_groups.remote(list(uids)))
        for uid in uids:
            state.groups.pop(uid, None)

    def _close_step(self, buffer: TailSieveReplayBuffer, state: ActiveStep) -> tuple[KVBatchMeta, dict]:
        plan = state.plan
        tail_uids = [uid for uid, g in state.groups.items() if g.pool == TAIL]
        selected = set(state.selected_bulk)
        dropped = [uid for uid, g in state.groups.items() if g.pool == BULK and uid not in selected]
        reports = self._collect_reports(list(state.groups))
        for uid in tail_uids + state.selected_bulk:
            if reports.get(uid, {}).get("aborted"):
                raise RolloutStepError(f"group {state.groups[uid].identity} was aborted but selected for training")
        identity = {uid: g.identity for uid, g in state.groups.items()}
        outcome = self.selector.finish_step(plan, state.fresh_ids, [identity[u] for u in state.selected_bulk],
                                            policy_version=self.global_steps)
        self.last_outcome = outcome
        rows = {g.identity: g.row for g in state.groups.values()}
        self.carried_rows = {pid: rows[pid] for pid in outcome.carried_ids}
        aborted_tokens = sum(reports.get(uid, {}).get("aborted_tokens", 0) for uid in dropped)
        self._forget(state, dropped)
        batch = buffer.selected_batch(tail_uids + state.selected_bulk)
        ray.get(self.router.forget_groups.remote(tail_uids + state.selected_bulk))

        measurement = StepMeasurement(
            q=plan.n_abort, m=state.m_used, carried=len(plan.tail_ids), aborted=len(dropped),
            aborted_tokens=aborted_tokens, cutoff_s=state.cutoff_s or 0.0,
            tail=[GroupRecord(tuple(reports[u]["tokens"]), reports[u]["duration_s"]) for u in tail_uids if u in reports],
            bulk=[GroupRecord(tuple(reports[u]["tokens"]), reports[u]["duration_s"]) for u in state.selected_bulk if u in reports],
            redispatched=state.redispatched, live_replicas=len(self._replicas_by_address()))
        observation = StepObservation(
            q=plan.n_abort, m=state.m_used,
            tail_makespan_s=max((g.finish_s for g in measurement.tail), default=0.0),
            bulk_cutoff_s=max((g.finish_s for g in measurement.bulk), default=0.0),
            tail_groups=tuple(measurement.tail), bulk_groups=tuple(measurement.bulk), n_aborted=len(dropped),
            prompt_len=self._mean_prompt_len(batch))
        if self.controller is not None:
            self.decision = self.controller.observe(observation)
        self.tailsieve_metrics = step_metrics(measurement, observation, self.decision, self.n_replicas,
                                              self.settings.perf())
        consumed_lengths = [g.lengths for g in measurement.tail + measurement.bulk if g.lengths]
        if self.bias_monitor is not None and consumed_lengths:
            self.bias_monitor.update(consumed_lengths)
            self.tailsieve_metrics.update(self.bias_monitor.metrics())
        self.step_state = None
        return batch, {}

    def _collect_reports(self, uids: list[str], timeout_s: float = 30.0) -> dict[str, dict]:
        """Per-group measurements from the router's ledger (reports follow the TQ status closely)."""
        reports: dict[str, dict] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            pending = [u for u in uids if u not in reports]
            reports.update(ray.get(self.router.take_reports.remote(pending, self.samples_per_group)))
            if len(reports) == len(uids) or time.monotonic() > deadline:
                return reports
            time.sleep(self.settings.poll_interval_s)

    @staticmethod
    def _mean_prompt_len(batch: KVBatchMeta) -> float:
        lens = [tag.get("prompt_len", 0) for tag in batch.tags]
        return float(np.mean(lens)) if lens else 0.0

    # ---- checkpoint / resume -------------------------------------------------------------------
    def tailsieve_state(self) -> dict:
        return {"selector": self.selector.state_dict(),
                "controller": self.controller.state_dict() if self.controller else None,
                "decision": {"q": self.decision.q, "m": self.decision.m},
                "carried_rows": {pid: row for pid, row in self.carried_rows.items()}}

    def load_tailsieve_state(self, state: dict) -> None:
        self.selector.load_state_dict(state["selector"])
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])
            self.decision = self.controller.decision
        self.carried_rows = dict(state["carried_rows"])
        missing = set(self.selector.carried) - set(self.carried_rows)
        if missing:
            raise RolloutStepError(f"checkpoint is missing the prompt rows of carried groups {sorted(missing)[:3]}")

    def _save_checkpoint(self):
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self.tailsieve_state(), os.path.join(folder, STATE_FILE))  # before verl marks it latest
        super()._save_checkpoint()

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if self.global_steps == 0:
            return
        trainer_cfg = self.config.trainer
        folder = (trainer_cfg.resume_from_path if trainer_cfg.resume_mode == "resume_path"
                  else os.path.join(trainer_cfg.default_local_dir, f"global_step_{self.global_steps}"))
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            logger.warning("TailSieve: %s has no %s (not a TailSieve checkpoint); starting with an empty carried "
                           "queue", folder, STATE_FILE)
            return
        self.load_tailsieve_state(torch.load(path, weights_only=False))
        logger.info("TailSieve: restored %d carried groups from %s", len(self.carried_rows), path)
