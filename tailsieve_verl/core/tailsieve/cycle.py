"""One TailSieve step as the rollout layer drives it: plan → run with a cutoff → finish → observe.

The simulator (:mod:`core.simulation.sim`) and the verl trainer (:mod:`integration.trainer`) run the middle part
their own way (simulated replicas, or verl's agent loop with a real abort); everything around it is
here, once: which prompts go to which pool, the exactly-once bookkeeping of the carried queue
(:class:`core.tailsieve.selector.TailSelector`), the per-prompt length record and the controller's
observation. Per step::

    fresh = pull(cycle.n_fresh())                 # new prompts, pulled before planning
    plan, m = cycle.plan(fresh, n_replicas)       # plan.tail_ids on m tail replicas, the rest bulk
    ...run; once plan.fresh_quota fresh bulk groups have finished, abort the fresh ones still running
    (core.tailsieve.selector.bulk_cutoff); the requeued ones run to completion...
    outcome, observation = cycle.finish(plan, consumed_bulk_ids, scores, tail=..., bulk=..., m=m, ...)

Prompt identities name one pull of a prompt (a prompt may be carried while the dataset hands it out
again); ``prompt_key`` maps them to the prompt itself, which the length record is keyed by.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from .controller import (ControllerConfig, Decision, GroupRecord, HierarchicalController, SplitPlanner,
                         StepObservation)
from ..engine.engine import EngineConfig
from ..kinds import DecisionKind
from ..engine.perf import PerfModel
from .prompt_record import PromptLengthRecord
from .selector import SelectorError, StepOutcome, StepPlan, TailSelector

SHARED_POOL = Decision(0, 0, "one shared pool (TailSieve off)", DecisionKind.FIXED)


class TailSieveCycle:
    """Selector, controller and per-prompt record of one TailSieve run, stepped in lockstep."""

    def __init__(self, batch_size: int, n_replicas: int, controller: ControllerConfig, perf: PerfModel, *,
                 per_sample: bool = True, adaptive: bool = True, record: bool = True,
                 prompt_key: Callable[[str], str] = str, engines: tuple[EngineConfig, EngineConfig] | None = None,
                 record_replaces_aborts: bool = False, planner: SplitPlanner | None = None):
        """``adaptive`` False keeps one shared pool (q = m = 0; the trainer's stop-only mode);
        ``record`` False plans from abort scores alone (the partial-rollout signal only); ``engines``:
        the (tail, bulk) pools' engines, for the controller's model (None: no limit).
        ``record_replaces_aborts``: abort only for the share of fresh prompts the record cannot predict
        (that share of the last step's pull): in a later epoch the record names the tail at the step's
        start and the partial rollout's aborted work falls with the share it knows. ``planner``: the
        controller's split planner (:class:`core.simulation.split_planner.OnlineSplitPlanner`)."""
        self.selector = TailSelector(batch_size, controller.candidate_factor)
        self.controller = (HierarchicalController(controller, n_replicas, batch_size, perf, per_sample=per_sample,
                                                  engines=engines, planner=planner)
                           if adaptive else None)
        self.decision = self.controller.decision if self.controller else SHARED_POOL
        self.record = PromptLengthRecord() if record else None
        self.prompt_key = prompt_key
        self.shared_hold = False
        self.record_replaces_aborts = record_replaces_aborts and record
        self.abort_share = 1.0  # of the candidates q asks for, the share found by aborting (see above)

    def hold_shared(self, hold: bool) -> None:
        """Run one shared pool (q = m = 0) while ``hold`` is set, without feeding the controller, and
        resume its last decision after: a fallback to stock routing that keeps the controller's state
        for the split's return. The next held step drains every carried candidate through the shared
        pool (run to completion, consumed) and aborts nothing; the per-prompt record keeps learning."""
        self.shared_hold = hold
        self.decision = SHARED_POOL if hold else (self.controller.decision if self.controller else SHARED_POOL)

    def n_fresh(self) -> int:
        """New prompts the next step needs (tail and bulk together)."""
        return self.selector.n_fresh_needed(self.decision.q, self.abort_share)

    def plan(self, fresh_ids: Sequence[str], n_replicas: int) -> tuple[StepPlan, int]:
        """The step's plan and its tail-pool size m (0 when nothing goes to the tail pool: its
        replicas then join the bulk pool). With the record, fresh prompts predicted heavier than the
        carried candidates go straight to the tail pool."""
        predicted: dict[str, float] = {}
        if self.record is not None:
            keys = {identity: self.prompt_key(identity) for identity in list(self.selector.carried) + list(fresh_ids)}
            known = self.record.predictions(keys.values())
            predicted = {identity: known[key] for identity, key in keys.items() if key in known}
        plan = self.selector.plan_step(self.decision.q, fresh_ids, predicted, self.abort_share)
        if self.record_replaces_aborts and fresh_ids:
            known = sum(identity in predicted for identity in fresh_ids) / len(fresh_ids)
            self.abort_share = 1.0 - known  # for the next step, whose pull is sized before it is seen
        return plan, (min(self.decision.m, n_replicas - 1) if plan.tail_ids else 0)

    def finish(self, plan: StepPlan, finished_bulk_ids: Sequence[str], scores: Mapping[str, float], *,
               tail: Sequence[tuple[str, GroupRecord]], bulk: Sequence[tuple[str, GroupRecord]], m: int,
               cutoff_s: float, prompt_len: float, policy_version: int) -> tuple[StepOutcome, StepObservation]:
        """Close the step: ``finished_bulk_ids`` are the consumed bulk groups (every requeued one and the
        fresh ones finished by the cutoff), ``scores`` is the abort score of every aborted bulk group;
        ``tail`` and ``bulk`` are the consumed groups as measured (identity, record; a group whose
        measurement never came is left out); ``cutoff_s`` is when the bulk pool's last consumed group
        finished. Updates the carried queue, the record and the controller's decision."""
        outcome = self.selector.finish_step(plan, plan.bulk_fresh_ids, finished_bulk_ids,
                                            policy_version=policy_version, scores=scores)
        if self.record is not None:
            for identity, group in list(tail) + list(bulk):
                self.record.observe(self.prompt_key(identity), group.lengths)
            for identity, tokens in scores.items():
                self.record.observe_aborted(self.prompt_key(identity), tokens)
        observation = StepObservation(
            m=m, tail_makespan_s=max((g.finish_s for _, g in tail), default=0.0), bulk_cutoff_s=cutoff_s,
            tail_groups=tuple(g for _, g in tail), bulk_groups=tuple(g for _, g in bulk),
            n_aborted=len(scores), prompt_len=prompt_len)
        if self.controller is not None and not self.shared_hold:
            self.decision = self.controller.observe(observation)
        return outcome, observation

    def state_dict(self) -> dict:
        return {"selector": self.selector.state_dict(),
                "controller": self.controller.state_dict() if self.controller else None,
                "prompt_record": self.record.state_dict() if self.record else None,
                "abort_share": self.abort_share}

    def load_state_dict(self, state: Mapping) -> None:
        self.selector.load_state_dict(state["selector"])
        if self.controller is not None and state.get("controller") is not None:
            self.controller.load_state_dict(state["controller"])
            self.decision = self.controller.decision
        if self.record is not None and state.get("prompt_record") is not None:
            self.record.load_state_dict(state["prompt_record"])
        share = state.get("abort_share", 1.0)  # checkpoints from before it: every candidate aborted
        if not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise SelectorError(f"malformed TailSieve checkpoint: abort_share must be a number in [0, 1], got {share!r}")
        self.abort_share = float(share)
