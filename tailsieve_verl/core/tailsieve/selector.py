"""Carried-candidate queue: the partial-rollout tail filter of TailSieve.

Each step consumes exactly ``batch_size`` (B) prompt groups:

* the **tail pool** regenerates, from scratch and under the current policy, the ``T = min(q, C)``
  carried candidates with the highest *abort score* (C = candidates carried from the last step);
* the **bulk pool** runs the other ``C − T`` candidates (regenerated from scratch: the *drain*) plus
  new prompts, ``B − T + a`` groups in all. The drained candidates are **committed**: they run to
  completion and are consumed this step, never aborted again. Once ``B − C`` of the *fresh* bulk
  groups have finished (the *cutoff*, :attr:`StepPlan.fresh_quota`), the ``a`` fresh groups still
  running are aborted and only their prompt identities and abort scores are carried to the next step
  as candidates. Their partial responses are never consumed.

So a prompt is aborted at most once: aborted at step t, it is regenerated from scratch at step t + 1
in the tail pool or the drain and consumed there — no prompt waits more than one step, whatever q,
m, the scores or the pool do (a prompt carried again and again would vanish from the consumed
batches: a length bias). :attr:`StepOutcome.max_deferral_steps` measures it.

``a = min(B − 1, ceil(candidate_factor · q))``: with ``candidate_factor`` > 1 the partial rollout
over-collects candidates and the abort score picks the tail among them — unfinished status is a
high-recall, low-precision signal. The abort score is the group's work when it was aborted
(:func:`group_work`: the tokens the model had generated, finished samples whole); a count, never the
tokens. Summed over the aborted groups it is the step's wasted work (:attr:`StepOutcome.aborted_work`).
Tail groups are listed heaviest first, so round-robin over the tail replicas spreads the heavy ones.

So a step consumes ``T + (C − T) + (B − C) = B`` groups. When ``q`` shrinks, the candidates beyond
it are drained through the bulk pool (never dropped); when it grows, the next step carries the new
count (one-step transition). Groups are atomic and every consumed group is tagged with the policy version
that generated it.

How the verl layer calls it, once per training step ``t`` (policy version ``v``)::

    plan = selector.plan_step(q)            # q from the controller's last Decision
    # send plan.tail_ids to the tail pool; plan.requeued_ids and plan.n_fresh new prompts to the
    # bulk pool; once plan.fresh_quota fresh groups have finished, abort the fresh ones still running
    # (the requeued ones run on to completion)
    outcome = selector.finish_step(plan, fresh_ids, requeued_ids + finished_fresh_ids, policy_version=v,
                                   scores=tokens_at_abort)
    # train on outcome.consumed; outcome.carried_ids are the next step's candidates

``state_dict()`` / ``load_state_dict()`` are JSON-serialisable so the carried queue survives a
verl checkpoint/resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..errors import TailSieveError
from ..kinds import Pool


class SelectorError(TailSieveError):
    """The rollout layer reported a step that breaks the exactly-once contract."""



@dataclass(frozen=True)
class StepPlan:
    """What the rollout layer must do this step."""

    step: int
    q: int  # the isolation target this plan was made for
    tail_ids: tuple[str, ...]  # top-q carried candidates, heaviest first: regenerated in the tail pool
    requeued_ids: tuple[str, ...]  # the other candidates: regenerated from scratch in the bulk pool, never aborted
    n_fresh: int  # new prompts to pull for the bulk pool
    bulk_quota: int  # bulk groups consumed this step (= B − len(tail_ids)): the requeued ones and fresh_quota fresh
    n_abort: int  # fresh bulk groups aborted at the cutoff and carried as candidates
    fresh_tail_ids: tuple[str, ...] = ()  # fresh prompts sent straight to the tail pool (per-prompt record)
    bulk_fresh_ids: tuple[str, ...] = ()  # with pre-pulled fresh prompts: the ones for the bulk pool

    @property
    def n_bulk(self) -> int:
        return len(self.requeued_ids) + self.n_fresh

    @property
    def fresh_quota(self) -> int:
        """Fresh bulk groups to finish before the cutoff (>= 1): the requeued ones are consumed anyway."""
        return self.bulk_quota - len(self.requeued_ids)


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
    max_deferral_steps: int = 0  # the most steps a consumed prompt waited since it was first pulled (<= 1)
    aborted_work: int = 0  # the work the cutoff threw away: the aborted groups' abort scores, summed

    @property
    def consumed_ids(self) -> tuple[str, ...]:
        return tuple(c.prompt_id for c in self.consumed)


def group_work(sample_tokens: Sequence[int]) -> int:
    """A group's work: the tokens the model generated for its samples, each over all its turns (an
    aborted turn's partial tokens included; tool output and other tokens the response mask leaves out,
    never). For an aborted group, its finished samples whole and the others up to the abort: its abort
    score, and what the abort wasted. The simulator, the trainer and the length record all count so."""
    return int(sum(int(x) for x in sample_tokens))


def fresh_cutoff(consumed: Sequence, finished: Sequence, fresh_quota: int) -> tuple[list, bool]:
    """The cutoff rule, one finish at a time: fresh bulk groups are consumed in the order they finish
    until ``fresh_quota`` are; the cutoff falls when the last of those finishes, and every other fresh
    group still running is aborted then. ``consumed``: those taken so far; ``finished``: fresh groups
    seen finished since, in order. Returns (the consumed ones now, whether the cutoff has fallen)."""
    taken = list(consumed) + list(finished)[: max(0, fresh_quota - len(consumed))]
    return taken, len(taken) >= fresh_quota


@dataclass(frozen=True)
class Cutoff:
    """Where a step's bulk pool stops taking fresh groups, from each bulk group's finish time."""

    cutoff_s: float  # the fresh_quota-th fresh group finished: the other fresh ones are aborted
    bulk_end_s: float  # the bulk pool's last consumed group finished (the cutoff or a requeued group)
    consumed: tuple[int, ...]  # indices into the plan's bulk order: every requeued group, then fresh ones by finish
    aborted: tuple[int, ...]  # fresh groups still running at the cutoff


def bulk_cutoff(bulk_finish_s: Sequence[float], n_requeued: int, fresh_quota: int) -> Cutoff:
    """The cutoff rule on finish times in a plan's bulk order (its ``n_requeued`` requeued groups
    first, then the fresh ones): the requeued groups are consumed whenever they finish; the first
    ``fresh_quota`` fresh groups to finish are consumed and the others aborted when the last of those
    finished (:attr:`StepPlan.fresh_quota`)."""
    finish = np.asarray(bulk_finish_s, dtype=float)
    if not 0 <= n_requeued <= len(finish) or not 0 <= fresh_quota <= len(finish) - n_requeued:
        raise SelectorError(f"a cutoff needs 0 <= fresh_quota ({fresh_quota}) <= fresh groups "
                            f"({len(finish) - n_requeued})")
    fresh = [int(i) for i in n_requeued + np.argsort(finish[n_requeued:], kind="stable")]
    done, _ = fresh_cutoff([], fresh, fresh_quota)
    aborted = fresh[len(done):]
    consumed = list(range(n_requeued)) + done
    return Cutoff(float(finish[done[-1]]) if done else 0.0,
                  float(finish[consumed].max()) if consumed else 0.0,
                  tuple(consumed), tuple(sorted(aborted)))


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
        self.pulled_at: dict[str, int] = {}  # step each carried prompt was first pulled (its deferral's start)
        self._open_plan: StepPlan | None = None

    def n_abort(self, q: int, abort_share: float = 1.0) -> int:
        """Bulk groups aborted at the cutoff when the tail pool isolates ``q``; ``abort_share`` < 1 when
        the per-prompt record already names that share of the tail at the step's start (no abort needed)."""
        return min(self.batch_size - 1, math.ceil(self.candidate_factor * q * abort_share - 1e-9))

    def n_fresh_needed(self, q: int, abort_share: float = 1.0) -> int:
        """Fresh prompts a step at ``q`` pulls in all (tail and bulk): B + aborted − carried."""
        return self.batch_size + self.n_abort(q, abort_share) - len(self.carried)

    def plan_step(self, q: int, fresh_ids: Sequence[str] | None = None,
                  predicted_work: Mapping[str, float] | None = None, abort_share: float = 1.0) -> StepPlan:
        """Plan the next step: the top-q candidates to the tail pool, the rest drained through the bulk.

        With the per-prompt record: ``fresh_ids`` are the step's pre-pulled fresh prompts
        (:meth:`n_fresh_needed`) and ``predicted_work`` the record's predicted group work of the
        prompts it has seen. The tail pool then takes the q heaviest of the carried candidates
        (ranked by the larger of abort score and prediction) and the fresh prompts with a
        prediction; the plan's ``bulk_fresh_ids`` are the fresh prompts left for the bulk pool.
        ``abort_share``: as in :meth:`n_abort`, the same value the fresh prompts were pulled for."""
        if self._open_plan is not None:
            raise SelectorError(f"step {self._open_plan.step} was planned but not finished; call finish_step first")
        if not 0 <= q < self.batch_size:
            raise SelectorError(f"q (groups to isolate) must be in 0..{self.batch_size - 1} for batch_size "
                                f"{self.batch_size}, got {q}")
        if not 0.0 <= abort_share <= 1.0:
            raise SelectorError(f"abort_share must be in [0, 1], got {abort_share}")
        n_abort = self.n_abort(q, abort_share)
        if fresh_ids is None:
            tail, requeued = tuple(self.carried[:q]), tuple(self.carried[q:])
            fresh_tail, bulk_fresh = (), ()
        else:
            fresh = [str(p) for p in fresh_ids]
            needed = self.n_fresh_needed(q, abort_share)
            if len(fresh) != needed or len(set(fresh)) != len(fresh) or set(fresh) & set(self.carried):
                raise SelectorError(f"plan_step needs {needed} distinct fresh prompts not carried, "
                                    f"got {len(fresh)}")
            predicted = predicted_work or {}
            carried_key = {p: max(self.scores.get(p, 0.0), predicted.get(p, 0.0)) for p in self.carried}
            ranked = sorted([(-k, 0, i, p) for i, (p, k) in enumerate(carried_key.items())]
                            + [(-predicted[p], 1, i, p) for i, p in enumerate(fresh) if p in predicted])
            # every carried candidate is consumed this step (tail or drain), so the fresh prompts the
            # tail pool takes leave the fresh bulk groups fewer slots: keep at least one (fresh_quota >= 1)
            fresh_room = self.batch_size - len(self.carried) - 1
            chosen = []
            for _, is_fresh, _, p in ranked:
                if len(chosen) == q:
                    break
                if is_fresh:
                    if fresh_room == 0:
                        continue
                    fresh_room -= 1
                chosen.append(p)
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
        assert plan.fresh_quota >= 1
        self._open_plan = plan
        return plan

    def finish_step(self, plan: StepPlan, fresh_ids: Sequence[str], finished_ids: Sequence[str],
                    policy_version: int, scores: Mapping[str, float] | None = None) -> StepOutcome:
        """Record a finished step: ``fresh_ids`` were pulled, ``finished_ids`` are the consumed bulk
        groups (every requeued one, and the fresh ones finished by the cutoff); ``scores`` = abort
        score of each aborted group (missing: 0)."""
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
        unfinished_requeued = [p for p in plan.requeued_ids if p not in done]
        if unfinished_requeued:
            raise SelectorError(f"step {plan.step}: requeued groups {unfinished_requeued[:3]} were not consumed; a "
                                "carried prompt runs to completion in the step after its abort and is never aborted "
                                "again (abort only the fresh bulk groups at the cutoff)")
        scores = scores or {}
        aborted = [p for p in bulk if p not in done]
        carried = tuple(sorted(aborted, key=lambda p: -float(scores.get(p, 0.0))))  # stable: ties keep bulk order
        consumed = tuple(ConsumedGroup(p, Pool.TAIL, policy_version) for p in plan.tail_ids) + tuple(
            ConsumedGroup(p, Pool.BULK, policy_version) for p in finished)
        assert len(consumed) == self.batch_size and len(carried) == plan.n_abort
        deferral = max((plan.step - self.pulled_at.get(c.prompt_id, plan.step) for c in consumed), default=0)
        self.carried = list(carried)
        self.scores = {p: float(scores.get(p, 0.0)) for p in carried}
        self.pulled_at = {p: self.pulled_at.get(p, plan.step) for p in carried}
        self.step += 1
        self._open_plan = None
        return StepOutcome(plan.step, consumed, carried, policy_version, deferral,
                           int(sum(self.scores[p] for p in carried)))

    def state_dict(self) -> dict:
        if self._open_plan is not None:
            raise SelectorError(f"cannot checkpoint in the middle of step {self._open_plan.step}")
        return {"batch_size": self.batch_size, "step": self.step, "carried": list(self.carried),
                "scores": [self.scores.get(p, 0.0) for p in self.carried]}  # carried: pulled at step - 1

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
        self.pulled_at = dict.fromkeys(carried, self.step - 1)
        self._open_plan = None
