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

**Record-planned steps.** Where the per-prompt record has measured at least ``record_plan_coverage`` of a
step's prompts (a later epoch) and the caller gives a step planner, the step's split is planned before it
starts, as the per-prompt oracle plans it with the truth: the planner (``StepPlanner``,
:class:`core.simulation.step_split.StepSplitPlanner`) times one shared pool and a grid of (q, m) on each
prompt's predicted lengths (the record's, through its revisit line, on draws of its error) and picks the
least makespan; a split that does not beat one shared pool by ``plan_margin`` is not taken. The q heaviest
predicted groups go to the tail pool and nothing is aborted (a prompt the record does not know runs in the
bulk pool). The controller waits meanwhile. The cycle weighs the planned steps' measured makespans (over the
controller's yardstick) against the plans' predictions (``plan_weight`` steps' worth) and returns to the
controller's decisions for the rest of the run when the split the controller holds (one shared pool, or the
split it found in the first epoch) measures better. Each step reports the record's Spearman ρ between its
predicted and measured group work.

Prompt identities name one pull of a prompt (a prompt may be carried while the dataset hands it out
again); ``prompt_key`` maps them to the prompt itself, which the length record is keyed by.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
from scipy.stats import spearmanr

from ..data.trace import Group
from .controller import (AbortedGroup, ControllerConfig, Decision, GroupRecord, HierarchicalController, PlannedSplit,
                         SplitPlanner, StepObservation)
from ..engine.engine import EngineConfig
from ..kinds import DecisionKind
from ..engine.perf import PerfModel
from .prompt_record import PromptLengthRecord
from .selector import SelectorError, StepOutcome, StepPlan, TailSelector

SHARED_POOL = Decision(0, 0, "one shared pool (TailSieve off)", DecisionKind.FIXED)

StepPlanner = Callable[[Sequence[Group], float], PlannedSplit]
"""(the step's groups at their predicted lengths, the predictions' log-length error) -> its split
(:class:`core.simulation.step_split.StepSplitPlanner`)."""

Predictor = Callable[[str], "tuple[int, ...] | None"]
"""A prompt identity -> its predicted group lengths, or None where unknown."""


@dataclass(frozen=True)
class RecordPlan:
    """What the per-prompt record did in a step, for logs: whether the step was planned from it (and the pick),
    the share of the step's prompts it knew, and its Spearman ρ against the step's measured group work."""

    planned: bool
    coverage: float
    q: int = 0
    m: int = 0
    predicted_relative: float = 1.0  # the plan's makespan over one shared pool's, on the predicted lengths
    plan_cpu_s: float = 0.0
    rho: float | None = None  # None with fewer than 3 predicted groups consumed


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks on ties); None with fewer than 3 pairs or a constant side."""
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(spearmanr(x, y).statistic)


@dataclass
class _PlanGuard:
    """Record-planned steps' relative makespans (over the controller's yardstick), summed, and their plans'
    predictions (relative to one shared pool; 1 where the plan kept one shared pool)."""

    steps: int = 0
    measured_sum: float = 0.0
    predicted_sum: float = 0.0
    off: str = ""  # why record planning stopped ("" while it runs)


class TailSieveCycle:
    """Selector, controller and per-prompt record of one TailSieve run, stepped in lockstep."""

    def __init__(self, batch_size: int, n_replicas: int, controller: ControllerConfig, perf: PerfModel, *,
                 per_sample: bool = True, adaptive: bool = True, record: bool = True,
                 prompt_key: Callable[[str], str] = str, engines: tuple[EngineConfig, EngineConfig] | None = None,
                 record_replaces_aborts: bool = False, planner: SplitPlanner | None = None,
                 step_planner: StepPlanner | None = None, group_size: int | None = None):
        """``adaptive`` False keeps one shared pool (q = m = 0; the trainer's stop-only mode);
        ``record`` False plans from abort scores alone (the partial-rollout signal only); ``engines``:
        the (tail, bulk) pools' engines, for the controller's model (None: no limit).
        ``record_replaces_aborts``: abort only for the share of fresh prompts the record cannot predict
        (that share of the last step's pull): in a later epoch the record names the tail at the step's
        start and the partial rollout's aborted work falls with the share it knows. ``planner``: the
        controller's split planner (:class:`core.simulation.split_planner.OnlineSplitPlanner`). ``step_planner``
        and ``group_size`` (samples per prompt): plan steps from the record (above; with ``controller.record_plan``,
        the adaptive controller and the record)."""
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
        self.step_planner = (step_planner if step_planner is not None and controller.record_plan and record
                             and adaptive and group_size else None)
        self.group_size, self.coverage_needed = group_size, controller.record_plan_coverage
        self.predictor: Predictor | None = None  # replaces the record's predictions (a reference fed the truth)
        self.planning = False  # the next pull is sized for a record-planned step (nothing aborted)
        self.guard = _PlanGuard()
        self.last_record_plan: RecordPlan | None = None
        self._open: tuple[RecordPlan, dict[str, float]] | None = None  # this step's plan and predicted work
        self._prompt_len = 0.0

    def hold_shared(self, hold: bool) -> None:
        """Run one shared pool (q = m = 0) while ``hold`` is set, without feeding the controller, and
        resume its last decision after: a fallback to stock routing that keeps the controller's state
        for the split's return. The next held step drains every carried candidate through the shared
        pool (run to completion, consumed) and aborts nothing; the per-prompt record keeps learning."""
        self.shared_hold = hold
        self.decision = SHARED_POOL if hold else (self.controller.decision if self.controller else SHARED_POOL)

    def n_fresh(self) -> int:
        """New prompts the next step needs (tail and bulk together)."""
        if self.planning and not self.shared_hold:
            return self.selector.batch_size - len(self.selector.carried)
        return self.selector.n_fresh_needed(self.decision.q, self.abort_share)

    def predict_groups(self, identities: Sequence[str]) -> dict[str, tuple[int, ...]]:
        """The predicted lengths of the identities the record (or :attr:`predictor`) knows."""
        if self.predictor is not None:
            found = {identity: self.predictor(identity) for identity in identities}
        elif self.record is not None and self.group_size:
            found = {identity: self.record.typical_group(self.prompt_key(identity), self.group_size)
                     for identity in identities if self.record.known(self.prompt_key(identity))}
        else:
            return {}
        return {identity: lengths for identity, lengths in found.items() if lengths is not None}

    def _plan_from_record(self, ids: Sequence[str], typical: dict[str, tuple[int, ...]]) -> PlannedSplit:
        """The step planner's pick on the step's groups; a prompt the record does not know counts as the
        median known one."""
        known = sorted(typical.values(), key=sum)
        filler = known[len(known) // 2] if known else (1,) * self.group_size
        groups = [Group(identity, typical.get(identity, filler), int(self._prompt_len)) for identity in ids]
        return self.step_planner(groups, self.record.spread if self.predictor is None and self.record else 0.0)

    def plan(self, fresh_ids: Sequence[str], n_replicas: int) -> tuple[StepPlan, int]:
        """The step's plan and its tail-pool size m (0 when nothing goes to the tail pool: its
        replicas then join the bulk pool). With the record, fresh prompts predicted heavier than the
        carried candidates go straight to the tail pool."""
        ids = list(self.selector.carried) + list(fresh_ids)
        typical = self.predict_groups(ids) if self.step_planner is not None else {}
        coverage = len(typical) / len(ids) if ids else 0.0
        sized = len(fresh_ids) == self.selector.batch_size - len(self.selector.carried)  # a pull that aborts nothing
        if (self.step_planner is not None and not self.shared_hold and not self.guard.off and self._weighable()
                and (self.planning or (sized and coverage >= self.coverage_needed))):
            start = time.process_time()
            split = self._plan_from_record(ids, typical)
            pays = split.m > 0 and split.relative < 1.0 - self.controller.config.plan_margin
            split = split if pays else PlannedSplit(0, 0, split.relative)
            q = split.q
            predicted = {identity: float(sum(lengths)) for identity, lengths in typical.items()}
            plan = self.selector.plan_step(q, fresh_ids, predicted, abort_share=0.0)
            m = min(split.m, n_replicas - 1) if plan.tail_ids else 0
            self._open = (RecordPlan(True, coverage, q, m, split.relative, time.process_time() - start), predicted)
        else:
            predicted = {}
            if self.record is not None:
                keys = {identity: self.prompt_key(identity) for identity in ids}
                known = self.record.predictions(keys.values())
                predicted = {identity: known[key] for identity, key in keys.items() if key in known}
            plan = self.selector.plan_step(self.decision.q, fresh_ids, predicted, self.abort_share)
            if self.record_replaces_aborts and fresh_ids:
                known = sum(identity in predicted for identity in fresh_ids) / len(fresh_ids)
                self.abort_share = 1.0 - known  # for the next step, whose pull is sized before it is seen
            m = min(self.decision.m, n_replicas - 1) if plan.tail_ids else 0
            self._open = (RecordPlan(False, coverage), predicted)
        self.planning = (self.step_planner is not None and not self.guard.off and coverage >= self.coverage_needed
                         and self._weighable())
        return plan, m

    def _weighable(self) -> bool:
        """A record's plans wait until the controller has settled (:attr:`HierarchicalController.settled`): the
        guard weighs them against its measured split, and a run whose record predates its controller (a later
        epoch at start, a seeded record) would otherwise keep the controller waiting at one shared pool for good.
        A reference fed the truth (:attr:`predictor`) plans from its first step."""
        return self.predictor is not None or self.controller.settled

    def finish(self, plan: StepPlan, finished_bulk_ids: Sequence[str], scores: Mapping[str, float], *,
               tail: Sequence[tuple[str, GroupRecord]], bulk: Sequence[tuple[str, GroupRecord]], m: int,
               cutoff_s: float, prompt_len: float, policy_version: int,
               aborted: Mapping[str, AbortedGroup] | None = None) -> tuple[StepOutcome, StepObservation]:
        """Close the step: ``finished_bulk_ids`` are the consumed bulk groups (every requeued one and the
        fresh ones finished by the cutoff), ``scores`` is the abort score of every aborted bulk group and
        ``aborted`` each one's samples as the abort left them (the controller prices the step's pull from them);
        ``tail`` and ``bulk`` are the consumed groups as measured (identity, record; a group whose
        measurement never came is left out); ``cutoff_s`` is when the bulk pool's last consumed group
        finished. Updates the carried queue, the record and the controller's decision."""
        aborted = aborted or {}
        if set(aborted) != set(scores):
            raise SelectorError(f"the aborted groups' samples ({len(aborted)}) must be those of the aborted groups' "
                                f"scores ({len(scores)})")
        outcome = self.selector.finish_step(plan, plan.bulk_fresh_ids, finished_bulk_ids,
                                            policy_version=policy_version, scores=scores)
        if self.record is not None:
            for identity, group in list(tail) + list(bulk):
                self.record.observe(self.prompt_key(identity), group.lengths)
            for identity, tokens in scores.items():
                self.record.observe_aborted(self.prompt_key(identity), tokens)
        fresh = set(plan.bulk_fresh_ids) | set(plan.fresh_tail_ids)
        observation = StepObservation(
            m=m, tail_makespan_s=max((g.finish_s for _, g in tail), default=0.0), bulk_cutoff_s=cutoff_s,
            tail_groups=tuple(g for _, g in tail), bulk_groups=tuple(g for _, g in bulk),
            aborted_groups=tuple(aborted[identity] for identity in scores), prompt_len=prompt_len,
            fresh_groups=tuple(g for identity, g in list(tail) + list(bulk) if identity in fresh))
        self._prompt_len = prompt_len
        record_plan, predicted = self._open or (RecordPlan(False, 0.0), {})
        self._open = None
        measured = [(predicted[identity], sum(group.lengths)) for identity, group in list(tail) + list(bulk)
                    if identity in predicted]
        rho = spearman(*zip(*measured)) if len(measured) >= 3 else None
        self.last_record_plan = RecordPlan(record_plan.planned, record_plan.coverage, record_plan.q, record_plan.m,
                                           record_plan.predicted_relative, record_plan.plan_cpu_s, rho)
        if record_plan.planned:
            self._guard(observation, record_plan)
        elif self.controller is not None and not self.shared_hold:
            self.decision = self.controller.observe(observation)
        if self.record is not None:
            self.record.advance()
        return outcome, observation

    def _guard(self, obs: StepObservation, plan: RecordPlan) -> None:
        """Fold a record-planned step into the guard; stop planning when the controller's own measured split
        (one shared pool, or the split it holds) measures better than the planned steps, their measurements
        weighed against the plans' predictions (``plan_weight`` steps' worth)."""
        g, controller = self.guard, self.controller
        relative = controller.relative_makespan(obs)
        if relative is None or (plan.m == 0 and controller.state.m == 0):
            return  # nothing measured, or the plan kept the controller's own split: nothing to weigh
        g.steps += 1
        g.measured_sum += relative
        g.predicted_sum += plan.predicted_relative if plan.m else 1.0
        measured = controller.measured_splits()
        if measured is None:
            return  # nothing measured to weigh the plans against: plan on
        held, shared = measured
        w = controller.config.plan_weight
        estimate = (w * (g.predicted_sum / g.steps) * shared.relative_makespan.value + g.measured_sum) / (w + g.steps)
        if held.relative_makespan.value < estimate:
            g.off = (f"record-planned steps measured {estimate / held.relative_makespan.value:.3f} of the controller's "
                     f"split {controller.decision.split} over {g.steps} steps")
            self.planning = False

    def state_dict(self) -> dict:
        return {"selector": self.selector.state_dict(),
                "controller": self.controller.state_dict() if self.controller else None,
                "prompt_record": self.record.state_dict() if self.record else None,
                "abort_share": self.abort_share,
                "record_plan": {"planning": self.planning, "prompt_len": self._prompt_len, **vars(self.guard)}}

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
        planned = state.get("record_plan") or {}  # absent before record planning: nothing planned yet
        try:
            self.planning = bool(planned.get("planning", False)) and self.step_planner is not None
            self._prompt_len = float(planned.get("prompt_len", 0.0))
            self.guard = _PlanGuard(**{k: v for k, v in planned.items() if k not in ("planning", "prompt_len")})
        except TypeError as exc:
            raise SelectorError(f"malformed TailSieve checkpoint: record_plan {planned!r}: {exc}") from exc
