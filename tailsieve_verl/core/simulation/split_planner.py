"""The controller's split planner, and the prompt pool a logged trace becomes for a plan.

:class:`OnlineSplitPlanner` is ``tailsieve plan``'s fixed-split search (:mod:`core.simulation.planner`) run
online: the controller (:mod:`core.tailsieve.controller`) calls it once, after measuring one shared pool,
and probes its pick. It lives apart from the planner so that the simulator's runners can hold one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ..data.trace import Group, Trace
from ..data.workload import PromptPool
from ..engine.perf import PerfModel
from ..errors import TailSieveError
from ..engine.engine import EngineConfig
from ..tailsieve.controller import ControllerConfig, PlannedSplit
from ..tailsieve.fluid import ConsumedBatch
from .config import SimConfig
from .references import static_grid, static_split_runner


def prompt_copies(prompts: int, batch: int) -> int:
    """Copies of each logged group the simulated steps draw from: a prompt is in flight at most once
    and TailSieve carries up to a batch of them into the next step, so a step needs 2 × batch
    prompts to draw fresh ones from."""
    return max(1, -(-2 * batch // prompts))


def prompt_pool(trace: Trace, batch: int, seed: int) -> PromptPool:
    """The trace's prompts as the pool of a plan with steps of ``batch`` groups, each regeneration
    resampling the prompt's observed lengths. A trace of fewer than 2 × batch groups — one logged step
    planned at its own batch size — gives each group :func:`prompt_copies` copies (``PROMPT~c``): the
    next steps' fresh prompts are that step's groups again, their lengths drawn afresh."""
    copies = prompt_copies(len(trace), batch)
    if copies > 1:
        trace = Trace(tuple(Group(f"{g.prompt_id}~{c}", g.lengths, g.prompt_len) for c in range(copies) for g in trace),
                      name=trace.name)
    return PromptPool.from_trace(trace, seed=seed)


class OnlineSplitPlanner:
    """The controller's split planner (:class:`core.tailsieve.controller.SplitPlanner`): ``tailsieve plan``'s
    fixed-split search run online on the consumed groups of the steps just measured. Those groups become a
    prompt pool (each regeneration resamples a group's observed lengths, :func:`prompt_pool`); every split of
    the coarse grid with m <= R/2 (the probe range) runs pinned for ``steps`` steps on ``seeds`` draws of it,
    on ``cfg``'s replicas and engines; the split with the least mean makespan after its first step (which
    aborts without a tail pool) wins, its makespan relative to one shared pool's.

    Cost: 33 splits × 2 seeds × 10 steps at 512 × 16 on 8 replicas, 40-55 CPU-seconds, once per run; it
    grows with R/2 × batch (64 splits and about 100 CPU-seconds on 16 replicas).
    No per-prompt record (a first epoch); the stream seeds are fixed, so a plan is reproducible."""

    def __init__(self, cfg: SimConfig, perf: PerfModel, steps: int = 10, seeds: int = 2):
        if steps < 2 or seeds < 1:
            raise TailSieveError(f"an online plan needs >= 2 steps and >= 1 seed, got {steps}, {seeds}")
        self.cfg = replace(cfg, policies=("verl",), prompt_record=False, record_replaces_aborts=False,
                           length_prior_sigma=None, steps=steps)
        self.perf, self.steps, self.seeds = perf, steps, seeds
        R, B = cfg.n_replicas, cfg.batch_size
        self.grid = [s for s in static_grid(R, B, cfg.controller.max_q_fraction, coarse=True) if s[1] <= R // 2]

    def __call__(self, history: Sequence[ConsumedBatch], prompt_len: float) -> PlannedSplit:
        groups = tuple(Group(f"p{b}_{i}", tuple(int(x) for x in row[:size]), prompt_len)
                       for b, batch in enumerate(history) for i, (row, size) in enumerate(zip(batch.by_group, batch.sizes)))
        trace = Trace(groups, name="online plan")
        makespans = {split: [] for split in self.grid}
        for k in range(self.seeds):
            cfg = replace(self.cfg, seed=1000 + k)
            pool = prompt_pool(trace, cfg.batch_size, cfg.seed)
            for split in self.grid:
                pinned = static_split_runner(cfg, pool, self.perf, split, "fixed")
                for t in range(self.steps):
                    pinned.step(t, keep=False)
                makespans[split].append(np.mean(pinned.result.makespans[1:]))
        mean = {split: float(np.mean(v)) for split, v in makespans.items()}
        (q, m) = min(mean, key=mean.get)
        return PlannedSplit(q, m, mean[q, m] / mean[0, 0])


def planner_for(controller: ControllerConfig, cfg: SimConfig, perf: PerfModel) -> OnlineSplitPlanner | None:
    """The split planner of a TailSieve run on ``cfg``'s replicas and engines: None where the controller
    does not plan (``plan_probe`` off, or the tail pool pinned)."""
    if not controller.plan_probe or controller.fixed_tail_replicas is not None:
        return None
    return OnlineSplitPlanner(replace(cfg, controller=controller), perf)


def run_planner(controller: ControllerConfig, n_replicas: int, batch_size: int, n: int, perf: PerfModel,
                engines: tuple[EngineConfig, EngineConfig], per_sample: bool) -> OnlineSplitPlanner | None:
    """:func:`planner_for` a training run: its replicas, batch, group size and (tail, bulk) pool engines."""
    tail, bulk = engines
    cfg = SimConfig(n_replicas=n_replicas, batch_size=batch_size, n=n, group_atomic=not per_sample, engine=bulk,
                    tail_engine=tail, bulk_engine=bulk)
    return planner_for(controller, cfg, perf)
