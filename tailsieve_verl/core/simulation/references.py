"""References picked in hindsight or with lengths known: the best of a grid of splits per step
(``clairvoyant-split``, ``prompt-oracle-split``), the best fixed (q, m) (``best-static``) and the best
stock speculative configuration (``verl-spec``, ``verl-dynsd-best``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..tailsieve.controller import SplitPlanner, max_q
from ..engine.engine import EngineConfig, replica_engines
from ..engine.perf import PerfModel
from ..routing.policies import least_inflight_assignment
from ..data.trace import Group
from ..data.workload import PromptPool
from .config import Execute, SimConfig
from .results import PolicyResult
from .runners import StaticRunner, TailSieveRunner, _Runner, prompt_of
from .step_split import best_split, split_grid, step_planner_for
from .speculation import engine_label, schedule_text, stock_engines, vllm_doc_schedule, with_speculation


class ClairvoyantSplitRunner(StaticRunner):
    """``clairvoyant-split``: the reference for a tail pool with its own engine. It knows each step's
    lengths and runs the best of a small grid (:meth:`candidates`): the q groups with the most tokens
    on m tail replicas — at the deepest speculation of ``spec_depths`` or on ``engine`` itself — and
    the rest on the other replicas by stock verl's routing on ``engine``. One shared pool with stock
    verl's routing on ``engine`` (the same assignment stock verl draws at this step) is a candidate,
    so no step is slower than stock verl on ``engine``: run it with the best stock configuration's
    engine and it is the ceiling of route-specialised speculation over that configuration (a lower
    bound on the best split, the grid being small). Not deployable: nobody knows lengths in advance."""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "clairvoyant-split"):
        super().__init__(cfg, pool, perf, name)
        self.deep = with_speculation(cfg.engine, cfg.speculation, max(cfg.spec_depths))
        self.split_rng = np.random.default_rng([cfg.seed, 19])
        self.tail_engine = cfg.engine
        self.picks: Counter = Counter()

    def candidates(self) -> list[tuple[int, int, EngineConfig]]:
        """(q, m, tail engine): :func:`split_grid`'s (q, m), each at the deepest speculation and on ``engine``."""
        return [(q, m, tail) for q, m in split_grid(self.cfg.n_replicas, self.cfg.batch_size)
                for tail in (self.deep, self.cfg.engine)]

    def engines(self, m: int) -> list[EngineConfig]:
        return replica_engines(self.tail_engine, self.cfg.engine, m, self.cfg.n_replicas)

    def assign(self, groups: list[Group]) -> tuple[np.ndarray, int]:
        shared = least_inflight_assignment(sum(g.n for g in groups), self.cfg.n_replicas, rng=self.routing_rng)
        _, _, samples, pick = best_split([self.plan_groups(groups)], groups, self.candidates(), self.cfg.n_replicas,
                                         self.perf, self.cfg.engine, self.cfg.group_atomic, self.split_rng, shared,
                                         self.rank(groups))
        if pick is None:
            self.tail_engine = self.cfg.engine
            self.picks["shared"] += 1
            return samples, 0
        q, m, self.tail_engine = pick
        self.picks[f"q={q}, m={m}, tail {engine_label(self.tail_engine)}"] += 1
        return samples, m

    def rank(self, groups: list[Group]) -> Sequence[float] | None:
        """What the grid's splits rank the groups by (None: their true tokens this step)."""
        return None

    def plan_groups(self, groups: list[Group]) -> list[Group]:
        """The groups the grid's makespans are computed on to pick the step's split: this step's own."""
        return groups

    def finish(self) -> PolicyResult:
        result = super().finish()
        label, count = self.picks.most_common(1)[0]
        result.choice = (f"split on {sum(self.picks.values()) - self.picks['shared']} of {sum(self.picks.values())} "
                         f"steps; most often {label} ({count})")
        return result


class GroupOracleSplitRunner(ClairvoyantSplitRunner):
    """``group-oracle-split``: :class:`ClairvoyantSplitRunner`'s grid routing-only (the tail pool on
    ``engine``), the groups ranked by their true tokens this step: the routing ceiling of a tail split,
    what a perfect group-length signal reaches. Not deployable."""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "group-oracle-split"):
        super().__init__(cfg, pool, perf, name)

    def candidates(self) -> list[tuple[int, int, EngineConfig]]:
        return sorted({(q, m, self.cfg.engine) for q, m, _ in super().candidates()}, key=lambda c: c[:2])


class PromptOracleSplitRunner(GroupOracleSplitRunner):
    """``prompt-oracle-split``: :class:`GroupOracleSplitRunner` knowing each prompt's length distribution
    under this step's policy and nothing of this step's samples: what an ideal per-prompt predictor knows.
    It ranks the groups by their prompt's typical length and picks the step's split by the makespans of
    :meth:`PromptPool.typical_group` (each group at its distribution's quantiles), then runs it on the
    step's samples. Picking on the samples themselves would use their luck: 2–9 points above this on the
    DAPO-sized cells (docs/results.md). Not deployable."""

    history_only = False  # what the oracle knows of a prompt (PromptPool.typical_group)

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "prompt-oracle-split"):
        super().__init__(cfg, pool, perf, name)
        self.step_index = 0

    def step(self, t: int, keep: bool) -> None:
        self.step_index = t
        super().step(t, keep)

    def rank(self, groups: list[Group]) -> Sequence[float]:
        return [self.pool.typical_length(g.prompt_id, self.step_index, self.history_only) * g.n for g in groups]

    def plan_groups(self, groups: list[Group]) -> list[Group]:
        return [self.pool.typical_group(g.prompt_id, g.n, self.step_index, self.history_only) for g in groups]


class HistoryOracleSplitRunner(PromptOracleSplitRunner):
    """``history-oracle-split``: :class:`PromptOracleSplitRunner` knowing each prompt only as far as its
    earlier steps can tell, however many were recorded (``PromptPool.typical_group(..., history_only=True)``):
    difficulty, checkpoint and trend exact, this step's prompt × checkpoint interaction unknown. Its gain
    over stock verl is the most any per-prompt record can plan; its gap to ``prompt-oracle-split`` is what
    only a predictor of the prompt under the current policy could add. Not deployable."""

    history_only = True

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "history-oracle-split"):
        super().__init__(cfg, pool, perf, name)


class RecordOracleSplitRunner(TailSieveRunner):
    """``record-oracle-split``: adaptive TailSieve whose per-prompt record is the truth — each prompt's length
    distribution under this step's policy (:meth:`PromptPool.typical_group`) — so every step from the first is
    planned by its step planner on it. The same mechanism as TailSieve's later epochs with a perfect record:
    TailSieve's gap to it is the record's error. Not deployable."""

    history_only = False  # what the record is fed of each prompt (PromptPool.typical_group)

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "record-oracle-split",
                 planner: SplitPlanner | None = None):
        """``planner``: the controller's split planner, for the steps after the guard stops the planning."""
        adaptive = replace(cfg.controller, fixed_tail_replicas=None, record_plan=True)
        super().__init__(replace(cfg, prompt_record=True), pool, perf, adaptive, name, planner=planner,
                         step_planner=step_planner_for(adaptive, cfg, perf))
        self.step_index = 0
        self.cycle.predictor = lambda identity: pool.typical_group(prompt_of(identity), cfg.n, self.step_index,
                                                                   self.history_only).lengths
        self.cycle.planning = True

    def step(self, t: int, keep: bool) -> None:
        self.step_index = t
        super().step(t, keep)


class RecordHistoryOracleSplitRunner(RecordOracleSplitRunner):
    """``record-history-oracle-split``: :class:`RecordOracleSplitRunner` fed each prompt only as far as its earlier
    steps can tell (``history-oracle-split``'s knowledge): TailSieve's planned steps with the best record any number
    of visits could hold. TailSieve's gap to it is what its record's visits have not yet told; its own gap to
    ``prompt-oracle-split``, what no record can know. Not deployable."""

    history_only = True

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "record-history-oracle-split",
                 planner: SplitPlanner | None = None):
        super().__init__(cfg, pool, perf, name, planner)


def static_grid(n_replicas: int, batch_size: int, max_q_fraction: float = 0.5,
                coarse: bool = False) -> list[tuple[int, int]]:
    """The (q, m) points ``best-static`` tries: (0, 0), and for every m in 1..R−1 the q of a
    geometric-ish grid of batch fractions with m <= q <= the controller's q bound. ``coarse`` (the
    plan's): m in 1..R/2 (the controller's probe range) and 3R/4, q up to B/4, about 60 % of the points;
    on the four recorded full-grid cells of scripts/results/adaptive_vs_best_static_split/ it keeps the
    best split of each."""
    q_max = max_q(max_q_fraction, batch_size)
    fractions = (1 / 64, 1 / 32, 1 / 16, 3 / 32, 1 / 8, 3 / 16, 1 / 4) + (() if coarse else (3 / 8, 1 / 2))
    ms = (sorted({*range(1, n_replicas // 2 + 1), 3 * n_replicas // 4}) if coarse
          else range(1, n_replicas))
    points = [(0, 0)]
    for m in ms:
        qs = sorted({m} | ({q_max} if not coarse else set()) | {int(round(f * batch_size)) for f in fractions})
        points += [(q, m) for q in qs if m <= q <= q_max]
    return points


def static_split_runner(cfg: SimConfig, pool: PromptPool, perf: PerfModel, split: tuple[int, int], name: str,
                        execute: Execute | None = None) -> TailSieveRunner:
    """TailSieve pinned at (q, m): no inner or outer loop; (0, 0) is one shared pool."""
    q, m = split
    pinned = (replace(cfg.controller, fixed_tail_replicas=m, q_init=q, inner_loop=False) if m else
              replace(cfg.controller, fixed_tail_replicas=None, m_init=0, q_init=0, inner_loop=False,
                      settle_steps=10 ** 9))  # (0, 0): the outer loop never decides
    return TailSieveRunner(cfg, pool, perf, pinned, name, execute)


class HindsightRunner:
    """The best of several runs of one policy on the same stream (same prompt order, length draws and
    routing tie-breaks), picked in hindsight by mean makespan: a reference no deployment can choose in
    advance. ``screen`` = (steps, survivors): after that many steps only the best few keep running
    (a lower bound on the full set's best); (0, 0) runs every one to the end."""

    def __init__(self, name: str, runners: dict, screen: tuple[int, int] = (0, 0), keep=None):
        self.name, self.runners, self.screen, self.keep = name, runners, screen, keep

    def step(self, t: int, keep: bool) -> None:
        screen_steps, survivors = self.screen
        if screen_steps and t == screen_steps:
            ranked = sorted(self.runners, key=lambda key: self.runners[key].result.mean_makespan_s)
            kept = set(ranked[:survivors]) | ({self.keep} if self.keep in self.runners else set())
            self.runners = {key: r for key, r in self.runners.items() if key in kept}
        for runner in self.runners.values():
            runner.step(t, keep)

    def finish(self) -> PolicyResult:
        results = {key: runner.finish() for key, runner in self.runners.items()}
        self.best = min(results, key=lambda key: results[key].mean_makespan_s)
        self.grid = {key: r.mean_makespan_s for key, r in results.items()}
        results[self.best].choice = self.label(self.best)
        results[self.best].alternatives = {key: PolicyResult(r.name, [replace(step, consumed_lengths=(), spans=())
                                                                      for step in r.records])
                                           for key, r in results.items()}
        return results[self.best]

    def label(self, key) -> str:
        return str(key)


class BestStaticRunner(HindsightRunner):
    """``best-static``: one TailSieve run per fixed (q, m) of :func:`static_grid`; the best in hindsight."""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "best-static",
                 execute: Execute | None = None):
        runners = {split: static_split_runner(cfg, pool, perf, split, name, execute)
                   for split in static_grid(cfg.n_replicas, cfg.batch_size, cfg.controller.max_q_fraction,
                                             cfg.best_static_grid == "coarse")}
        super().__init__(name, runners, cfg.best_static_screen, keep=(0, 0))

    @property
    def split(self) -> tuple[int, int]:
        return self.best

    def label(self, key) -> str:
        return f"q={key[0]}, m={key[1]}"


class SingleWidthRunner(HindsightRunner):
    """``verl-tp``: stock verl at every single width of the run's GPUs (``cfg.engine`` on ``cfg.n_replicas``
    replicas, each of ``cfg.stock_widths`` on the GPUs over its width), the fastest in hindsight: a width is fixed
    at launch, so a user picks it once, as this does over the whole run."""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "verl-tp"):
        gpus = cfg.n_replicas * cfg.engine.width
        engines = {e.width: e for e in cfg.stock_widths} | {cfg.engine.width: cfg.engine}
        super().__init__(name, {t: StaticRunner(replace(cfg, n_replicas=gpus // t, engine=engines[t]), pool, perf, name)
                                for t in sorted(engines)})

    def label(self, key) -> str:
        return f"tp={key}"


def stock_spec_runner(cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str) -> _Runner | HindsightRunner:
    """Stock verl's routing with speculation on every replica (``cfg.speculation``'s acceptance and draft
    cost): ``verl-spec`` every depth of ``cfg.spec_depths``, the best in hindsight; ``verl-dynsd`` vLLM's
    documented schedule at ``cfg.speculation``'s k; ``verl-dynsd-best`` the best of :func:`schedule_grid`."""
    if name == "verl-dynsd":
        schedule = vllm_doc_schedule(cfg.speculation.num_speculative_tokens)
        engine = stock_engines(cfg)[schedule_text(schedule)]
        runner = StaticRunner(replace(cfg, engine=engine), pool, perf, name)
        runner.result.choice = schedule_text(schedule)
        return runner
    variants = stock_engines(cfg, "depths" if name == "verl-spec" else "grid")
    return HindsightRunner(name, {label: StaticRunner(replace(cfg, engine=engine), pool, perf, name)
                                  for label, engine in variants.items()})
