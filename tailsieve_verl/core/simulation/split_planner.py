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
    prompt pool (each regeneration resamples a group's observed lengths, :func:`prompt_pool`); the splits of
    the coarse grid with m <= R/2 (the probe range) run pinned on ``cfg``'s replicas and engines, and the
    split with the least mean makespan after its first step (which aborts without a tail pool) over
    ``steps`` steps on ``seeds`` draws of it wins, its makespan relative to one shared pool's.

    Not every split runs every step: ``screen`` races them (successive halving). Each (step, keep) round runs
    the splits still in the race to that step on every draw and keeps the ``keep`` with the least mean
    makespan of steps 1..step (one shared pool, the yardstick, always stays); the survivors run the rest
    of the ``steps``, so the pick and its predicted makespan are the full search's wherever the full
    search's pick survives the rounds. The first step of every split with the same q is the same engine
    work (no tail pool yet): the race runs the splits in q order, so the engine's run cache serves it once
    per q. The default, after step 1 keep 16, after step 4 keep 6, kept the full search's pick and
    prediction on every recorded history tried (dense weak, dense8b weak, dense8b real at 512 × 16 with a
    32k cap, and dense weak, dense8b weak at 256 × 16, 16k cap, seeds 0 and 1); in the eight whose full
    grid was run the pick ranked at most 3rd of those kept. Keeping 4 after step 4 lost it once (dense weak
    256 × 16 seed 0: (1, 1) at 0.903 for (4, 1) at 0.901); a race on one draw, or to step 2 only, lost it at
    256 × 16 (14th-15th on one draw after step 1, first on both draws only from step 4).

    Cost: at 512 × 16 on 8 replicas, 33 splits, about 280 pinned steps instead of 660 (33 × 2 draws × 10),
    once per run; it grows with R/2 × batch. On the history of ``scripts/bench_speed.py``'s run (Qwen3-8B,
    real tails, 32k cap, where every bulk replica preempts thousands of times) it takes about 21 CPU seconds.
    No per-prompt record (a first epoch); the stream seeds are fixed, so a plan is reproducible."""

    def __init__(self, cfg: SimConfig, perf: PerfModel, steps: int = 10, seeds: int = 2,
                 screen: Sequence[tuple[int, int]] = ((1, 16), (4, 6))):
        if steps < 2 or seeds < 1:
            raise TailSieveError(f"an online plan needs >= 2 steps and >= 1 seed, got {steps}, {seeds}")
        rounds = [t for t, _ in screen]
        if any(not 1 <= t < steps or keep < 1 for t, keep in screen) or rounds != sorted(set(rounds)):
            raise TailSieveError(f"a screen is (step, keep) rounds with 1 <= step < {steps} in increasing order, got {screen}")
        self.cfg = replace(cfg, policies=("verl",), prompt_record=False, record_replaces_aborts=False,
                           length_prior_sigma=None, steps=steps)
        self.perf, self.steps, self.seeds, self.screen = perf, steps, seeds, tuple(screen)
        R, B = cfg.n_replicas, cfg.batch_size
        self.grid = [s for s in static_grid(R, B, cfg.controller.max_q_fraction, coarse=True) if s[1] <= R // 2]

    @property
    def rounds(self) -> tuple[tuple[int, int | None], ...]:
        """The race's (last step, splits kept besides one shared pool) rounds; the last keeps every survivor (None)."""
        return (*self.screen, (self.steps - 1, None))

    @property
    def pinned_steps(self) -> int:
        """The pinned-split steps the race runs (the engine's run cache aside): its cost, in the simulator's unit."""
        total, start, racing = 0, 0, len(self.grid)
        for until, keep in self.rounds:
            total += racing * (until + 1 - start) * self.seeds
            start, racing = until + 1, min(racing, keep + 1) if keep is not None else racing
        return total

    def __call__(self, history: Sequence[ConsumedBatch], prompt_len: float) -> PlannedSplit:
        groups = tuple(Group(f"p{b}_{i}", tuple(int(x) for x in row[:size]), prompt_len)
                       for b, batch in enumerate(history) for i, (row, size) in enumerate(zip(batch.by_group, batch.sizes)))
        trace = Trace(groups, name="online plan")
        cfgs = [replace(self.cfg, seed=1000 + k) for k in range(self.seeds)]
        pools = [prompt_pool(trace, c.batch_size, c.seed) for c in cfgs]

        def score(runs: list) -> float:  # mean makespan after the first step, over the draws
            return float(np.mean([np.mean(r.result.makespans[1:]) for r in runs]))

        # q order: the first steps of splits with the same q run back to back (the engine's run cache)
        racing = {split: [static_split_runner(c, p, self.perf, split, "fixed") for c, p in zip(cfgs, pools)]
                  for split in sorted(self.grid)}
        t = 0
        for until, keep in self.rounds:
            for t in range(t, until + 1):
                for k in range(self.seeds):
                    for runs in racing.values():
                        runs[k].step(t, keep=False)
            t = until + 1
            if keep is not None:
                ranked = sorted((s for s in racing if s != (0, 0)), key=lambda s: score(racing[s]))
                racing = {s: runs for s, runs in racing.items() if s == (0, 0) or s in ranked[:keep]}
        mean = {split: score(racing[split]) for split in self.grid if split in racing}  # grid order: ties as before
        (q, m) = min(mean, key=mean.get)
        return PlannedSplit(q, m, mean[q, m] / mean[0, 0], _spread(racing[q, m], racing[0, 0]))


def _spread(split: list, shared: list, block: int = 3) -> float:
    """The standard error of a split's makespan relative to one shared pool's, from its simulated steps after the
    first: per draw, the split's makespan summed over blocks of ``block`` steps over one shared pool's on the same
    steps. Blocks, not single steps: the carry moves each step's slowest groups into the next step, so a single
    step of the split pairs with a shared-pool step that ran other work, and its ratio is noise."""
    ratios = []
    for a, b in zip(split, shared):
        ms_split, ms_shared = np.asarray(a.result.makespans[1:]), np.asarray(b.result.makespans[1:])
        for start in range(0, len(ms_split) - block + 1, block):
            ratios.append(ms_split[start:start + block].sum() / ms_shared[start:start + block].sum())
    return float(np.std(ratios, ddof=1) / np.sqrt(len(ratios))) if len(ratios) > 1 else 0.0


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
