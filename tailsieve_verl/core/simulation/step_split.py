"""The per-step split planner: one step's split from its groups' lengths, known or predicted, before it runs.

One search serves everything that plans a step from lengths in hand: TailSieve's record-planned steps
(:class:`StepSplitPlanner`, given to :class:`core.tailsieve.cycle.TailSieveCycle` by the simulator and the
trainer alike), ``record-oracle-split`` (the same planner fed each prompt's true length distribution) and
the grid references of :mod:`core.simulation.references` (``prompt-oracle-split``, ``group-oracle-split``,
``clairvoyant-split``). The search: one shared pool under stock verl's routing, and every split of a small
grid — the q heaviest groups on m tail replicas, the rest on the others, each pool routed as stock verl
routes — timed by the engine model on the planned groups; the least makespan wins. Losers stop early
(:func:`core.engine.replica.makespan_below`); a step of 512 × 16 plans in a few CPU-seconds on three draws
(``scripts/experiments/record_plan.py --cost``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..data.trace import Group
from ..engine.engine import EngineConfig, replica_engines
from ..engine.perf import PerfModel
from ..engine.replica import evaluate_samples, makespan_below
from ..routing.policies import least_inflight_assignment, longest_to_tail
from ..tailsieve.controller import ControllerConfig, PlannedSplit
from .config import SimConfig


def split_grid(n_replicas: int, batch_size: int) -> list[tuple[int, int]]:
    """(q, m): m of 1, 2, R/4, R/2; q of B/32, B/16, B/8, B/4, at least m."""
    ms = sorted({m for m in (1, 2, n_replicas // 4, n_replicas // 2) if 1 <= m < n_replicas})
    qs = sorted({max(1, batch_size // d) for d in (32, 16, 8, 4)})
    return [(max(q, m), m) for m in ms for q in qs]


def best_split(planned: Sequence[Sequence[Group]], groups: Sequence[Group],
               candidates: Sequence[tuple[int, int, EngineConfig]], n_replicas: int, perf: PerfModel, bulk: EngineConfig,
               group_atomic: bool, split_rng: np.random.Generator, shared: np.ndarray, rank: Sequence[float] | None = None,
               ) -> tuple[float, float, np.ndarray, tuple[int, int, EngineConfig] | None]:
    """The search: ``shared`` (every sample's replica under stock verl's routing) and every (q, m, tail
    engine) of ``candidates`` (the q top-ranked groups on m tail replicas on that engine, the rest on ``bulk``),
    each timed on every draw of ``planned`` (lengths the step may have) and summed; the assignments are of
    ``groups`` (the same groups as run, in the same order). ``rank``: what the groups are ranked by (None:
    their tokens). Returns (best total makespan, one shared pool's, the winner's assignment, the winning
    candidate or None)."""
    R = n_replicas
    shared_s = best = sum(evaluate_samples(draw, shared, R, perf, engine=bulk).makespan_s for draw in planned)
    samples, pick = shared, None
    for q, m, tail in candidates:
        engines, total = replica_engines(tail, bulk, m, R), 0.0  # fewer replicas where the tail's are wider
        split = longest_to_tail(groups, q, m, len(engines), group_atomic, split_rng, rank)
        for draw in planned:
            total += makespan_below(draw, split, len(engines), perf, engines, stop_above=best - total)
            if total >= best:
                break
        if total < best:
            best, samples, pick = total, split, (q, m, tail)
    return best, shared_s, samples, pick


class StepSplitPlanner:
    """Plans a step from its groups' predicted lengths (:data:`core.tailsieve.cycle.StepPlanner`): the best of
    :func:`split_grid` and one shared pool on the (tail, bulk) pools' engines, the tail the heaviest
    predicted groups. Each split is timed on ``draws`` sets of groups the step may bring: every group's
    samples drawn afresh from its predicted distribution (a group's longest sample is luck, which a typical
    group has none of), all of them scaled by exp(spread · z), z standard normal per group (``spread``: the
    standard deviation of a group's log length about its prediction). A split that pays only where the
    predicted tail is the true one, sample by sample, is not taken."""

    def __init__(self, n_replicas: int, batch_size: int, perf: PerfModel, engines: tuple[EngineConfig, EngineConfig],
                 group_atomic: bool = False, seed: int = 0, draws: int = 3):
        self.n_replicas, self.perf, self.group_atomic, self.draws = n_replicas, perf, group_atomic, draws
        self.tail, self.bulk = engines
        self.candidates = [(q, m, self.tail) for q, m in split_grid(n_replicas, batch_size)]
        self.rng = np.random.default_rng([seed, 23])

    def __call__(self, groups: Sequence[Group], spread: float = 0.0) -> PlannedSplit:
        shared = least_inflight_assignment(sum(g.n for g in groups), self.n_replicas, rng=self.rng)
        planned = [self._drawn(groups, spread) for _ in range(self.draws)]
        ranked_by = [float(sum(g.lengths)) for g in groups]
        best, shared_s, _, pick = best_split(planned, groups, self.candidates, self.n_replicas, self.perf, self.bulk,
                                             self.group_atomic, self.rng, shared, ranked_by)
        if pick is None:
            return PlannedSplit(0, 0, 1.0)
        q, m, _ = pick
        return PlannedSplit(q, m, best / shared_s)

    def _drawn(self, groups: Sequence[Group], spread: float) -> list[Group]:
        """One set of groups the step may bring: each sample at a random quantile of its group's predicted lengths,
        the group scaled by exp(spread · z); capped at the longest predicted length."""
        cap = max(max(g.lengths) for g in groups)
        factors = np.exp(spread * self.rng.standard_normal(len(groups)))
        drawn = []
        for g, f in zip(groups, factors):
            typical = np.sort(np.asarray(g.lengths, dtype=float))
            levels = (np.arange(g.n) + 0.5) / g.n
            lengths = np.interp(self.rng.random(g.n), levels, typical) * f
            drawn.append(Group(g.prompt_id, tuple(int(x) for x in np.clip(np.rint(lengths), 1, cap)), g.prompt_len))
        return drawn


def step_planner_for(controller: ControllerConfig, cfg: SimConfig, perf: PerfModel) -> StepSplitPlanner | None:
    """The step planner of a TailSieve run on ``cfg``'s replicas, batch and pool engines: None where the
    controller does not plan steps from the record (``record_plan`` off, or the tail pool pinned)."""
    if not controller.record_plan or controller.fixed_tail_replicas is not None:
        return None
    return StepSplitPlanner(cfg.n_replicas, cfg.batch_size, perf, cfg.tail_and_bulk_engines, cfg.group_atomic,
                            cfg.seed)


def run_step_planner(controller: ControllerConfig, n_replicas: int, batch_size: int, perf: PerfModel,
                     engines: tuple[EngineConfig, EngineConfig], per_sample: bool) -> StepSplitPlanner | None:
    """:func:`step_planner_for` a training run: its replicas, batch and (tail, bulk) pool engines, whole groups
    where the pools route whole groups (not ``per_sample``)."""
    tail, bulk = engines
    cfg = SimConfig(n_replicas=n_replicas, batch_size=batch_size, group_atomic=not per_sample, engine=bulk,
                    tail_engine=tail, bulk_engine=bulk)
    return step_planner_for(controller, cfg, perf)
