"""Planner: from a logged run, predict what TailSieve would gain over stock verl and where to start it.

The trace's prompts become a prompt pool (each regeneration resamples that prompt's observed
lengths with replacement, so prompt difficulty persists as it did in the log). The closed-loop
simulator runs ``verl`` (stock per-sample routing) and ``tailsieve`` side by side for several seeds;
the predicted speedup is the mean over seeds of the steady-state speedup (steps after the first
third), the band its 10th–90th percentile across seeds, and the initial (q, m) the controller's
median final choice.

TailSieve runs there without the per-prompt length record, as in a first epoch. A logged run is a
sample of the dataset: in a pool of its prompts each one recurs every few steps (every 4 steps from
a 4-step log), far more often than in training, and the record would exploit recurrences the real
run does not have (on strong tails it made 5 of 6 picks from 4-step logs lose 3.4–12 %).

It also names a fixed split to pin: each seed's best-static split (and one shared pool) is run on
every seed and the one with the best mean steady-state speedup wins. Where a split pays only a few
per cent the adaptive controller cannot resolve it from 30 noisy steps; a split planned this way
reaches 0.94–1.00 of the best on weak and real tails; on strong tails 4 of 10 picks isolate and
lose 3.4 % against stock verl (``scripts/results/controller_vs_stock_verl/controller_v2_log.md``, sessions 8 and 9).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .controller import ControllerConfig
from .engine import EngineConfig
from .errors import TailSieveError
from .perf import PerfModel
from .sim import SimConfig, simulate, static_split_runner
from .trace import Trace
from .workload import PromptPool


class PlanError(TailSieveError):
    """The trace cannot support the requested plan."""


@dataclass(frozen=True)
class Plan:
    speedup: float  # mean steady-state speedup of tailsieve over uniform across seeds
    band: tuple[float, float]  # 10th–90th percentile across seeds
    per_seed: tuple[float, ...]
    initial_q: int
    initial_m: int
    fixed_q: int  # the fixed split to pin; (0, 0) is one shared pool, stock verl's routing
    fixed_m: int
    fixed_speedup: float  # its mean steady-state speedup over stock verl across the seeds
    batch_size: int
    n: int
    n_replicas: int
    steps: int
    prompts: int

    def to_json(self) -> dict:
        return {"predicted_speedup": self.speedup, "band": list(self.band), "per_seed": list(self.per_seed),
                "initial_q": self.initial_q, "initial_m": self.initial_m, "fixed_q": self.fixed_q,
                "fixed_m": self.fixed_m, "fixed_speedup": self.fixed_speedup, "batch": self.batch_size, "n": self.n,
                "replicas": self.n_replicas, "steps": self.steps, "prompts": self.prompts}


def plan_from_trace(trace: Trace, n_replicas: int, perf: PerfModel, *, batch_size: int | None = None,
                    n: int | None = None, steps: int = 30, seeds: int = 5,
                    controller: ControllerConfig | None = None, engine: EngineConfig = EngineConfig()) -> Plan:
    """Predict TailSieve's speedup on ``trace``'s workload (see the module docstring); every replica
    runs ``engine`` (default: no limit binds)."""
    if seeds < 1 or steps < 3:
        raise PlanError(f"need --seeds >= 1 and --steps >= 3, got {seeds}, {steps}")
    prompts = len(trace)
    batch = batch_size if batch_size is not None else min(64, prompts // 2)
    if batch < 2 or 2 * batch > prompts:
        raise PlanError(f"the trace has {prompts} prompt groups; a batch of {batch} needs at least {2 * batch} "
                        "(a prompt is in flight at most once); lower --batch or log more steps")
    group_size = n if n is not None else int(np.median([g.n for g in trace]))
    steady = slice(steps // 3, None)
    speedups, finals, runs = [], [], []
    for seed in range(seeds):
        pool = PromptPool.from_trace(trace, seed=seed)
        cfg = SimConfig(steps=steps, n_replicas=n_replicas, batch_size=batch, n=group_size, seed=seed,
                        policies=("verl", "tailsieve", "best-static"), controller=controller or ControllerConfig(),
                        prompt_record=False, engine=engine)
        result = simulate(cfg, pool, perf, workload_name=trace.name)
        speedups.append(result.speedup_vs("verl", steady)["tailsieve"])
        last = result.policies["tailsieve"].records[-1]
        finals.append((last.next_q, last.next_m))
        best = result.policies["best-static"].records[-1]
        runs.append((cfg, pool, float(result.policies["verl"].makespans[steady].mean()), (best.next_q, best.next_m)))
    (fixed_q, fixed_m), fixed_speedup = _best_fixed_split(runs, perf, steady)
    speedups_arr = np.array(speedups)
    ms = [m for _, m in finals]
    m0 = max(set(ms), key=ms.count)
    q0 = int(np.median([q for q, m in finals if m == m0]))
    return Plan(float(speedups_arr.mean()), (float(np.percentile(speedups_arr, 10)), float(np.percentile(speedups_arr, 90))),
                tuple(float(x) for x in speedups), q0, m0, fixed_q, fixed_m, fixed_speedup, batch, group_size,
                n_replicas, steps, prompts)


def _best_fixed_split(runs: list, perf: PerfModel, steady: slice) -> tuple[tuple[int, int], float]:
    """Each seed's best-static split and one shared pool, run on every seed: the one with the best mean
    speedup, and that speedup. ``runs``: per seed (config, pool, stock verl's steady-state mean makespan,
    its best-static split)."""
    mean_speedup = {}
    for split in sorted({(0, 0)} | {split for *_, split in runs}):
        per_seed = []
        for cfg, pool, stock_s, _ in runs:
            pinned = static_split_runner(cfg, pool, perf, split, "fixed")
            for t in range(cfg.steps):
                pinned.step(t, keep=False)
            per_seed.append(stock_s / pinned.finish().makespans[steady].mean())
        mean_speedup[split] = float(np.mean(per_seed))
    best = max(mean_speedup, key=mean_speedup.get)
    return best, mean_speedup[best]

