"""Carried-identity queue: the partial-rollout tail filter of TailSieve.

Each step consumes exactly ``batch_size`` (B) prompt groups:

* the **tail pool** regenerates, from scratch and under the current policy, every group carried
  from the previous step (``T`` of them);
* the **bulk pool** runs ``n_fresh = B − T + q`` fresh prompts; once ``B − T`` of them have
  finished (the *cutoff*), the ``q`` still running are aborted and only their prompt identities are
  carried to the next step. Their partial responses are never consumed.

So a step consumes ``T + (B − T) = B`` groups. When ``q`` shrinks, the groups already carried are
still all regenerated next step (drained, never dropped); when it grows, the next step carries the
new count (one-step transition). Groups are atomic and every consumed group is tagged with the
policy version that generated it.

How the verl layer calls it, once per training step ``t`` (policy version ``v``)::

    plan = selector.plan_step(q)            # q from the controller's last Decision
    # send plan.tail_ids to the tail pool, pull plan.n_fresh new prompts for the bulk pool,
    # abort the bulk pool once plan.bulk_quota of its groups have finished
    outcome = selector.finish_step(plan, fresh_ids, finished_ids, policy_version=v)
    # train on outcome.consumed; outcome.carried_ids are the next step's tail groups

``state_dict()`` / ``load_state_dict()`` are JSON-serialisable so the carried queue survives a
verl checkpoint/resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import TailSieveError


class SelectorError(TailSieveError):
    """The rollout layer reported a step that breaks the exactly-once contract."""


TAIL = "tail"
BULK = "bulk"


@dataclass(frozen=True)
class StepPlan:
    """What the rollout layer must do this step."""

    step: int
    tail_ids: tuple[str, ...]  # carried groups, regenerated from scratch in the tail pool
    n_fresh: int  # fresh prompts to pull for the bulk pool
    bulk_quota: int  # bulk groups to finish before the cutoff (= B − len(tail_ids))
    n_abort: int  # bulk groups aborted at the cutoff and carried (= q)


@dataclass(frozen=True)
class ConsumedGroup:
    prompt_id: str
    route: str  # TAIL or BULK
    policy_version: int


@dataclass(frozen=True)
class StepOutcome:
    step: int
    consumed: tuple[ConsumedGroup, ...]  # exactly B groups, tail first
    carried_ids: tuple[str, ...]  # aborted at the cutoff; the next step's tail groups
    policy_version: int

    @property
    def consumed_ids(self) -> tuple[str, ...]:
        return tuple(c.prompt_id for c in self.consumed)


class TailSelector:
    """Holds the carried prompt identities between steps and checks the exactly-once contract."""

    def __init__(self, batch_size: int):
        if batch_size < 1:
            raise SelectorError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.step = 0
        self.carried: list[str] = []
        self._open_plan: StepPlan | None = None

    def plan_step(self, q: int) -> StepPlan:
        """Plan the next step: regenerate every carried group, abort ``q`` bulk groups at the cutoff."""
        if self._open_plan is not None:
            raise SelectorError(f"step {self._open_plan.step} was planned but not finished; call finish_step first")
        if not 0 <= q < self.batch_size:
            raise SelectorError(f"q (groups to carry) must be in 0..{self.batch_size - 1} for batch_size "
                                f"{self.batch_size}, got {q}")
        tail = tuple(self.carried)
        quota = self.batch_size - len(tail)
        plan = StepPlan(step=self.step, tail_ids=tail, n_fresh=quota + q, bulk_quota=quota, n_abort=q)
        self._open_plan = plan
        return plan

    def finish_step(self, plan: StepPlan, fresh_ids: Sequence[str], finished_ids: Sequence[str],
                    policy_version: int) -> StepOutcome:
        """Record a finished step: ``fresh_ids`` were pulled, ``finished_ids`` finished before the cutoff."""
        if plan is not self._open_plan:
            raise SelectorError("finish_step got a plan that is not the open one; plan_step and finish_step "
                                "must alternate")
        fresh = [str(p) for p in fresh_ids]
        finished = [str(p) for p in finished_ids]
        if len(fresh) != plan.n_fresh:
            raise SelectorError(f"step {plan.step}: plan asked for {plan.n_fresh} fresh prompts, got {len(fresh)}")
        if len(set(fresh)) != len(fresh):
            raise SelectorError(f"step {plan.step}: duplicate prompt ids among the fresh prompts")
        overlap = set(fresh) & set(plan.tail_ids)
        if overlap:
            raise SelectorError(f"step {plan.step}: fresh prompts {sorted(overlap)[:3]} are also carried tail "
                                "groups; a prompt may be in flight only once")
        if len(finished) != plan.bulk_quota or len(set(finished)) != len(finished):
            raise SelectorError(f"step {plan.step}: the bulk pool must finish exactly {plan.bulk_quota} distinct "
                                f"groups before the cutoff, got {len(finished)}")
        unknown = set(finished) - set(fresh)
        if unknown:
            raise SelectorError(f"step {plan.step}: finished groups {sorted(unknown)[:3]} were not among the fresh "
                                "prompts of this step")
        done = set(finished)
        carried = tuple(p for p in fresh if p not in done)
        consumed = tuple(ConsumedGroup(p, TAIL, policy_version) for p in plan.tail_ids) + tuple(
            ConsumedGroup(p, BULK, policy_version) for p in finished)
        assert len(consumed) == self.batch_size and len(carried) == plan.n_abort
        self.carried = list(carried)
        self.step += 1
        self._open_plan = None
        return StepOutcome(plan.step, consumed, carried, policy_version)

    def state_dict(self) -> dict:
        if self._open_plan is not None:
            raise SelectorError(f"cannot checkpoint in the middle of step {self._open_plan.step}")
        return {"batch_size": self.batch_size, "step": self.step, "carried": list(self.carried)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("batch_size") != self.batch_size:
            raise SelectorError(f"checkpoint has batch_size {state.get('batch_size')}, this run {self.batch_size}; "
                                "resume with the same data.train_batch_size")
        carried = [str(p) for p in state["carried"]]
        if len(carried) >= self.batch_size or len(set(carried)) != len(carried):
            raise SelectorError("checkpoint's carried queue is malformed (duplicates or >= batch_size entries)")
        self.step = int(state["step"])
        self.carried = carried
        self._open_plan = None
