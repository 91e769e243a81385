"""Carried-candidate queue: the partial-rollout tail filter of TailSieve.

Each step consumes exactly ``batch_size`` (B) prompt groups:

* the **tail pool** regenerates, from scratch and under the current policy, the ``T = min(q, C)``
  carried candidates with the highest *abort score* (C = candidates carried from the last step);
* the **bulk pool** runs the other ``C − T`` candidates (regenerated from scratch: the drain) plus
  new prompts, ``B − T + a`` groups in all; once ``B − T`` of them have finished (the *cutoff*),
  the ``a`` still running are aborted and only their prompt identities and abort scores are carried
  to the next step as candidates. Their partial responses are never consumed.

``a = min(B − 1, ceil(candidate_factor · q))``: with ``candidate_factor`` > 1 the partial rollout
over-collects candidates and the abort score picks the tail among them — unfinished status is a
high-recall, low-precision signal. The abort score is the number of response tokens the group had
generated when it was aborted (finished samples count their full length); a count, never the tokens.
Tail groups are listed heaviest first, so round-robin over the tail replicas spreads the heavy ones.

So a step consumes ``T + (B − T) = B`` groups. When ``q`` shrinks, the candidates beyond it are
drained through the bulk pool (never dropped); when it grows, the next step carries the new count
(one-step transition). Groups are atomic and every consumed group is tagged with the policy version
that generated it.

How the verl layer calls it, once per training step ``t`` (policy version ``v``)::

    plan = selector.plan_step(q)            # q from the controller's last Decision
    # send plan.tail_ids to the tail pool; plan.requeued_ids and plan.n_fresh new prompts to the
    # bulk pool; abort the bulk pool once plan.bulk_quota of its groups have finished
    outcome = selector.finish_step(plan, fresh_ids, finished_ids, policy_version=v, scores=tokens_at_abort)
    # train on outcome.consumed; outcome.carried_ids are the next step's candidates

``state_dict()`` / ``load_state_dict()`` are JSON-serialisable so the carried queue survives a
verl checkpoint/resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .errors import TailSieveError
from .kinds import Pool


class SelectorError(TailSieveError):
    """The rollout layer reported a step that breaks the exactly-once contract."""



@dataclass(frozen=True)
class StepPlan:
    """What the rollout layer must do this step."""

    step: int
    q: int  # the isolation target this plan was made for
    tail_ids: tuple[str, ...]  # top-q carried candidates, heaviest first: regenerated in the tail pool
    requeued_ids: tuple[str, ...]  # the other candidates: regenerated from scratch in the bulk pool
    n_fresh: int  # new prompts to pull for the bulk pool
    bulk_quota: int  # bulk groups to finish before the cutoff (= B − len(tail_ids))
    n_abort: int  # bulk groups aborted at the cutoff and carried as candidates
    fresh_tail_ids: tuple[str, ...] = ()  # fresh prompts sent straight to the tail pool (per-prompt record)
    bulk_fresh_ids: tuple[str, ...] = ()  # with pre-pulled fresh prompts: the ones for the bulk pool

    @property
    def n_bulk(self) -> int:
        return len(self.requeued_ids) + self.n_fresh


@dataclass(frozen=True)
class ConsumedGroup:
    prompt_id: str
    route: Pool  # TAIL or BULK
    policy_version: int


@dataclass(frozen=True)
class StepOutcome:
    step: int
    consumed: tuple[ConsumedGroup, ...]  # exactly B groups, tail first
    carried_ids: tuple[str, ...]  # aborted at the cutoff, highest abort score first: the next candidates
    policy_version: int

    @property
    def consumed_ids(self) -> tuple[str, ...]:
        return tuple(c.prompt_id for c in self.consumed)


class TailSelector:
    """Holds the carried candidates between steps and checks the exactly-once contract."""

    def __init__(self, batch_size: int, candidate_factor: float = 1.0):
        if batch_size < 1:
            raise SelectorError(f"batch_size must be >= 1, got {batch_size}")
        if not candidate_factor >= 1.0:
            raise SelectorError(f"candidate_factor must be >= 1 (abort at least the q groups to isolate), "
                                f"got {candidate_factor}")
        self.batch_size = batch_size
        self.candidate_factor = candidate_factor
        self.step = 0
        self.carried: list[str] = []  # highest abort score first
        self.scores: dict[str, float] = {}
        self._open_plan: StepPlan | None = None

    def n_abort(self, q: int) -> int:
        """Bulk groups aborted at the cutoff when the tail pool isolates ``q``."""
        return min(self.batch_size - 1, math.ceil(self.candidate_factor * q - 1e-9))

    def n_fresh_needed(self, q: int) -> int:
        """Fresh prompts a step at ``q`` pulls in all (tail and bulk): B + aborted − carried."""
        return self.batch_size + self.n_abort(q) - len(self.carried)

    def plan_step(self, q: int, fresh_ids: Sequence[str] | None = None,
                  predicted_work: Mapping[str, float] | None = None) -> StepPlan:
        """Plan the next step: the top-q candidates to the tail pool, the rest drained through the bulk.

        With the per-prompt record: ``fresh_ids`` are the step's pre-pulled fresh prompts
        (:meth:`n_fresh_needed`) and ``predicted_work`` the record's predicted group work of the
        prompts it has seen. The tail pool then takes the q heaviest of the carried candidates
        (ranked by the larger of abort score and prediction) and the fresh prompts with a
        prediction; the plan's ``bulk_fresh_ids`` are the fresh prompts left for the bulk pool."""
        if self._open_plan is not None:
            raise SelectorError(f"step {self._open_plan.step} was planned but not finished; call finish_step first")
        if not 0 <= q < self.batch_size:
            raise SelectorError(f"q (groups to isolate) must be in 0..{self.batch_size - 1} for batch_size "
                                f"{self.batch_size}, got {q}")
        n_abort = self.n_abort(q)
        if fresh_ids is None:
            tail, requeued = tuple(self.carried[:q]), tuple(self.carried[q:])
            fresh_tail, bulk_fresh = (), ()
        else:
            fresh = [str(p) for p in fresh_ids]
            if len(fresh) != self.n_fresh_needed(q) or len(set(fresh)) != len(fresh) or set(fresh) & set(self.carried):
                raise SelectorError(f"plan_step needs {self.n_fresh_needed(q)} distinct fresh prompts not carried, "
                                    f"got {len(fresh)}")
            predicted = predicted_work or {}
            carried_key = {p: max(self.scores.get(p, 0.0), predicted.get(p, 0.0)) for p in self.carried}
            ranked = sorted([(-k, 0, i, p) for i, (p, k) in enumerate(carried_key.items())]
                            + [(-predicted[p], 1, i, p) for i, p in enumerate(fresh) if p in predicted])
            chosen = [p for *_, p in ranked[:q]]
            chosen_set = set(chosen)
            tail = tuple(chosen)  # heaviest first
            requeued = tuple(p for p in self.carried if p not in chosen_set)
            fresh_tail = tuple(p for p in chosen if p not in carried_key)
            bulk_fresh = tuple(p for p in fresh if p not in chosen_set)
        quota = self.batch_size - len(tail)
        plan = StepPlan(step=self.step, q=q, tail_ids=tail, requeued_ids=requeued,
                        n_fresh=quota + n_abort - len(requeued), bulk_quota=quota, n_abort=n_abort,
                        fresh_tail_ids=fresh_tail, bulk_fresh_ids=bulk_fresh)
        assert fresh_ids is None or len(bulk_fresh) == plan.n_fresh
        self._open_plan = plan
        return plan

    def finish_step(self, plan: StepPlan, fresh_ids: Sequence[str], finished_ids: Sequence[str],
                    policy_version: int, scores: Mapping[str, float] | None = None) -> StepOutcome:
        """Record a finished step: ``fresh_ids`` were pulled, ``finished_ids`` (bulk groups) finished
        before the cutoff; ``scores`` = abort score of each aborted group (missing: 0)."""
        if plan is not self._open_plan:
            raise SelectorError("finish_step got a plan that is not the open one; plan_step and finish_step "
                                "must alternate")
        fresh = [str(p) for p in fresh_ids]
        finished = [str(p) for p in finished_ids]
        if len(fresh) != plan.n_fresh:
            raise SelectorError(f"step {plan.step}: plan asked for {plan.n_fresh} fresh prompts, got {len(fresh)}")
        if len(set(fresh)) != len(fresh):
            raise SelectorError(f"step {plan.step}: duplicate prompt ids among the fresh prompts")
        overlap = set(fresh) & (set(plan.tail_ids) | set(plan.requeued_ids))
        if overlap:
            raise SelectorError(f"step {plan.step}: fresh prompts {sorted(overlap)[:3]} are also carried "
                                "candidates; a prompt may be in flight only once")
        if len(finished) != plan.bulk_quota or len(set(finished)) != len(finished):
            raise SelectorError(f"step {plan.step}: the bulk pool must finish exactly {plan.bulk_quota} distinct "
                                f"groups before the cutoff, got {len(finished)}")
        bulk = list(plan.requeued_ids) + fresh
        unknown = set(finished) - set(bulk)
        if unknown:
            raise SelectorError(f"step {plan.step}: finished groups {sorted(unknown)[:3]} were not among the bulk "
                                "groups of this step")
        done = set(finished)
        scores = scores or {}
        aborted = [p for p in bulk if p not in done]
        carried = tuple(sorted(aborted, key=lambda p: -float(scores.get(p, 0.0))))  # stable: ties keep bulk order
        consumed = tuple(ConsumedGroup(p, Pool.TAIL, policy_version) for p in plan.tail_ids) + tuple(
            ConsumedGroup(p, Pool.BULK, policy_version) for p in finished)
        assert len(consumed) == self.batch_size and len(carried) == plan.n_abort
        self.carried = list(carried)
        self.scores = {p: float(scores.get(p, 0.0)) for p in carried}
        self.step += 1
        self._open_plan = None
        return StepOutcome(plan.step, consumed, carried, policy_version)

    def state_dict(self) -> dict:
        if self._open_plan is not None:
            raise SelectorError(f"cannot checkpoint in the middle of step {self._open_plan.step}")
        return {"batch_size": self.batch_size, "step": self.step, "carried": list(self.carried),
                "scores": [self.scores.get(p, 0.0) for p in self.carried]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("batch_size") != self.batch_size:
            raise SelectorError(f"checkpoint has batch_size {state.get('batch_size')}, this run {self.batch_size}; "
                                "resume with the same data.train_batch_size")
        carried = [str(p) for p in state["carried"]]
        scores = [float(x) for x in state.get("scores", [0.0] * len(carried))]
        if len(carried) >= self.batch_size or len(set(carried)) != len(carried) or len(scores) != len(carried):
            raise SelectorError("checkpoint's carried queue is malformed (duplicates, >= batch_size entries or "
                                "a score per entry missing)")
        self.step = int(state["step"])
        self.carried = carried
        self.scores = dict(zip(carried, scores))
        self._open_plan = None
