"""Planner: from a logged run, predict what TailSieve would gain over stock verl and where to start it.

The trace's prompts become a prompt pool (each regeneration resamples that prompt's observed
lengths with replacement, so prompt difficulty persists as it did in the log). The closed-loop
simulator runs ``verl`` (stock per-sample routing), ``tailsieve`` and ``prompt-oracle-split`` (the best a
per-prompt length predictor could reach: the reference TailSieve's gain is measured against) side by
side for several seeds;
the predicted speedup is the mean over seeds of the steady-state speedup (steps after the first
third, deferred work charged: :meth:`core.simulation.results.PolicyResult.window_mean_s`), the band its 10th–90th percentile across seeds, and the initial (q, m) the controller's
median final choice. One logged step planned at its own batch size has fewer prompts than a step
draws from (2 × batch): its groups are copied (:func:`prompt_pool`), so the next steps' fresh prompts
are that step's groups again, lengths resampled.

TailSieve runs there without the per-prompt length record, as in a first epoch. A logged run is a
sample of the dataset: in a pool of its prompts each one recurs every few steps (every 4 steps from
a 4-step log), far more often than in training, and the record would exploit recurrences the real
run does not have (on strong tails it made 5 of 6 picks from 4-step logs lose 3.4–12 %).

It also names a fixed split to pin: each seed's best-static split (on the coarse grid of
:func:`static_grid`, 41 of 71 points at a DAPO-sized step on 8 replicas) and one shared pool are scored on every seed
(from best-static's own runs where its screen kept the split running, else pinned) and the one with the best mean
steady-state speedup wins. That speedup is chosen on those seeds, so it flatters
the split; the split is scored again on as many other seeds (``seeds`` .. 2 × ``seeds`` − 1, stock verl and
the pinned split only), the out-of-sample score a recommendation quotes. Where a split pays only a few
per cent the adaptive controller cannot resolve it from 30 noisy steps; a split planned this way
reaches 0.94–1.00 of the best on weak and real tails; on strong tails 4 of 10 picks isolate and
lose 3.4 % against stock verl (``scripts/results/controller_vs_stock_verl/controller_v2_log.md``).

With speculation (``speculation``: the engine's acceptance and draft cost) it also chooses the engines
(:func:`plan_engines`): the same seeds run every stock configuration (:data:`core.simulation.sim.STOCK_POLICIES`)
and TailSieve's speculation policies; the best stock configuration is the stock policy with the least
mean steady-state makespan, and the plan's choice the fastest of TailSieve routing-only,
``tailsieve-spec``, ``tailsieve-dynsd`` and that best stock configuration (the fallback). verl-spec and
verl-dynsd-best pick their k or schedule per seed in hindsight, which flatters the stock bar.

Given stock verl's engine at other single widths of the plan's GPUs (``widths``,
:func:`core.engine.engine.single_widths`), the same seeds also run ``verl-tp`` (:class:`WidthPlan`): the strongest
width is the one with the least mean steady-state makespan over the seeds, and where it is not the plan's own,
TailSieve runs again on it (stock verl and adaptive TailSieve at that width, the same seeds and prompts), so that
its gain is measured on top of the strongest stock width as well as against the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from ..tailsieve.controller import ControllerConfig
from ..engine.engine import EngineConfig, SpeculativeConfig
from ..errors import TailSieveError
from ..engine.perf import PerfModel
from .forked import forked_map
from .sim import (LAUNCH_SPEC_POLICIES, STOCK_POLICIES, STOCK_TP, SimConfig, SimResult, engine_label,
                  simulate_runs, static_split_runner, tailsieve_spec_config)
from .split_planner import prompt_copies, prompt_pool
from ..data.trace import Trace
from ..data.workload import PromptPool


class PlanError(TailSieveError):
    """The trace cannot support the requested plan."""


TAILSIEVE_CANDIDATES = ("tailsieve", "tailsieve-spec", "tailsieve-dynsd")  # routing only, per-pool engines,
#   one schedule on every replica with m free
PLAN_POLICIES = ("verl", "tailsieve", "best-static", "prompt-oracle-split")


@dataclass(frozen=True)
class Configuration:
    """One configuration the plan weighs: a :mod:`core.simulation.sim` policy, its engines, and its predicted speedups
    (mean over seeds; band: 10th–90th percentile across seeds)."""

    name: str  # the core.simulation.sim policy
    label: str  # its pick: verl-spec's ``k=K``, a schedule, tailsieve-spec's ``tail K / bulk SCHEDULE``; "" for none
    engines: dict  # speculation per pool (``tail``, ``bulk``) in ``--spec-schedule`` words: ``off``, ``k=K``, a schedule
    q: int  # the split to start (TailSieve) or pin (tailsieve-spec); 0, 0 for stock verl's one pool
    m: int
    speedup_vs_verl: float
    band_vs_verl: tuple[float, float]
    speedup_vs_best_stock: float
    band_vs_best_stock: tuple[float, float]

    def to_json(self) -> dict:
        return {"name": self.name, "label": self.label, "engines": self.engines, "q": self.q, "m": self.m,
                "speedup_vs_verl": self.speedup_vs_verl, "band_vs_verl": list(self.band_vs_verl),
                "speedup_vs_best_stock": self.speedup_vs_best_stock,
                "band_vs_best_stock": list(self.band_vs_best_stock)}


@dataclass(frozen=True)
class EnginePlan:
    """The engines the plan chooses: the best stock configuration, every TailSieve candidate, and the
    fastest of them all (the best stock configuration itself where no TailSieve candidate beats it)."""

    best_stock: Configuration
    candidates: tuple[Configuration, ...]  # the TailSieve candidates
    choice: Configuration

    @property
    def fallback(self) -> bool:
        return self.choice.name in STOCK_POLICIES

    def to_json(self) -> dict:
        return {"best_stock": self.best_stock.to_json(),
                "speedup_vs_best_stock": {c.name: c.speedup_vs_best_stock for c in self.candidates},
                "choice": self.choice.to_json() | {"fallback": self.fallback}}


@dataclass(frozen=True)
class WidthPlan:
    """Stock verl at every single width of the plan's GPUs, and TailSieve on the strongest one."""

    width: int  # the plan's own replicas' width
    gpus: int
    speedups: dict  # width -> stock verl there, its mean steady-state speedup over stock verl at ``width``
    best: int  # the strongest width: the least mean steady-state makespan over the seeds
    best_max_num_seqs: int | None  # its max_num_seqs (part of switching to it)
    best_per_seed: tuple[float, ...]  # stock verl at ``best`` over stock verl at ``width``, per seed
    tailsieve: tuple[float, ...] = ()  # adaptive TailSieve at ``best`` over stock verl at ``best``, per seed
    #   (empty where ``best`` is the plan's own width, or leaves one replica: no split)
    tailsieve_vs_width: tuple[float, ...] = ()  # adaptive TailSieve at ``best`` over stock verl at ``width``, per seed
    tailsieve_left_stock: bool = False  # TailSieve at ``best`` used a tail pool on some step of some seed

    @property
    def switch(self) -> bool:
        return self.best != self.width

    @property
    def tailsieve_speedup(self) -> float | None:
        return float(np.mean(self.tailsieve)) if self.tailsieve else None

    def to_json(self) -> dict:
        return {"width": self.width, "gpus": self.gpus, "stock_speedup_by_width": {str(t): v for t, v in
                                                                               self.speedups.items()},
                "best_width": self.best, "best_max_num_seqs": self.best_max_num_seqs,
                "best_per_seed": list(self.best_per_seed),
                "tailsieve_at_best_vs_stock_there": self.tailsieve_speedup,
                "tailsieve_at_best_per_seed": list(self.tailsieve),
                "tailsieve_at_best_vs_stock_at_width": (float(np.mean(self.tailsieve_vs_width))
                                                        if self.tailsieve_vs_width else None),
                "tailsieve_at_best_left_stock": self.tailsieve_left_stock}


@dataclass(frozen=True)
class Plan:
    speedup: float  # mean steady-state speedup of tailsieve over uniform across seeds
    band: tuple[float, float]  # 10th–90th percentile across seeds
    per_seed: tuple[float, ...]
    initial_q: int
    initial_m: int
    fixed_q: int  # the fixed split to pin; (0, 0) is one shared pool, stock verl's routing
    fixed_m: int
    fixed_speedup: float  # its mean steady-state speedup over stock verl across the seeds it was chosen on
    batch_size: int
    n: int
    n_replicas: int
    steps: int
    prompts: int
    engines: EnginePlan | None = None  # with speculation: the engines chosen (see :func:`plan_engines`)
    prompt_copies: int = 1  # copies of each logged group the steps draw their prompts from (:func:`prompt_pool`)
    prompt_oracle_speedup: float | None = None  # prompt-oracle-split's mean steady-state speedup over stock verl:
    #   the best a per-prompt length predictor could reach on this workload (a reference, not deployable)
    fixed_out_of_sample: tuple[float, ...] = ()  # the fixed split's speedup on each seed it was not chosen on
    adaptive_left_stock: bool = True  # the adaptive controller used a tail pool on some step of some seed
    widths: WidthPlan | None = None  # stock verl at every single width (given ``widths``: :func:`plan_from_trace`)

    @property
    def fixed_out_of_sample_speedup(self) -> float | None:
        """The fixed split's mean speedup over stock verl on the seeds it was not chosen on."""
        return float(np.mean(self.fixed_out_of_sample)) if self.fixed_out_of_sample else None

    @property
    def above_prompt_oracle(self) -> bool:
        """TailSieve predicted a gain beyond the best per-prompt length predictor's (or a gain where that
        predictor has none): an artefact (of too few steps, most often) until shown otherwise, not a headline."""
        return self.prompt_oracle_speedup is not None and self.speedup > max(1.0, self.prompt_oracle_speedup)

    @property
    def seeds_chosen_on(self) -> int:
        """Seeds 0 .. this − 1 ran every policy and chose the fixed split; as many after them scored it."""
        return len(self.per_seed)

    @property
    def share_of_prompt_oracle_gain(self) -> float | None:
        """TailSieve's gain over stock verl as a share of prompt-oracle-split's (None where that gain is
        under 1 %: there is nothing for a per-prompt signal to win)."""
        if self.prompt_oracle_speedup is None or self.prompt_oracle_speedup < 1.01:
            return None
        return (self.speedup - 1) / (self.prompt_oracle_speedup - 1)

    def to_json(self) -> dict:
        return {"predicted_speedup": self.speedup, "band": list(self.band), "per_seed": list(self.per_seed),
                "initial_q": self.initial_q, "initial_m": self.initial_m, "fixed_q": self.fixed_q,
                "fixed_m": self.fixed_m, "fixed_speedup": self.fixed_speedup, "batch": self.batch_size, "n": self.n,
                "replicas": self.n_replicas, "steps": self.steps, "prompts": self.prompts,
                "prompt_copies": self.prompt_copies, "prompt_oracle_speedup": self.prompt_oracle_speedup,
                "share_of_prompt_oracle_gain": self.share_of_prompt_oracle_gain,
                "fixed_out_of_sample": list(self.fixed_out_of_sample),
                "fixed_speedup_out_of_sample": self.fixed_out_of_sample_speedup,
                "scored_on_seeds": [self.seeds_chosen_on, 2 * self.seeds_chosen_on - 1],
                "adaptive_left_stock": self.adaptive_left_stock,
                "above_prompt_oracle": self.above_prompt_oracle} | (
                    self.engines.to_json() if self.engines else {}) | (
                    {"single_widths": self.widths.to_json()} if self.widths else {})


def plan_from_trace(trace: Trace, n_replicas: int, perf: PerfModel, *, batch_size: int | None = None,
                    n: int | None = None, steps: int = 30, seeds: int = 5,
                    controller: ControllerConfig | None = None, engine: EngineConfig = EngineConfig(),
                    speculation: SpeculativeConfig | None = None, jobs: int = 1,
                    widths: dict[int, EngineConfig] | None = None) -> Plan:
    """Predict TailSieve's speedup on ``trace``'s workload (see the module docstring); every replica
    runs ``engine`` (default: no limit binds). ``batch_size`` defaults to :func:`trace_batch`'s. With ``speculation`` (acceptance, draft cost, k) the plan
    also chooses the engines (:func:`plan_engines`). ``jobs``: processes that simulate the seeds' policies side
    by side, the costliest first (the same plan: a policy's run depends on no other). ``widths``: stock verl's engine
    at every single width of the plan's GPUs, ``engine`` at its own among them (:class:`WidthPlan`; None or one
    width: not weighed)."""
    if seeds < 1 or steps < 3:
        raise PlanError(f"need --seeds >= 1 and --steps >= 3, got {seeds}, {steps}")
    prompts = len(trace)
    batch = batch_size if batch_size is not None else trace_batch(trace)[0]
    if batch < 2 or batch > prompts:
        raise PlanError(f"the trace has {prompts} prompt groups; a batch of {batch} needs at least {max(batch, 2)} "
                        "groups and a batch at least 2; lower --batch or log more steps")
    group_size = n if n is not None else int(np.median([g.n for g in trace]))
    steady = slice(steps // 3, None)
    if engine.speculative is not None and speculation is not None:
        raise PlanError("the plan chooses the engines' speculation: give the engine without it")
    others = tuple(e for t, e in (widths or {}).items() if t != engine.width)
    policies = PLAN_POLICIES + (LAUNCH_SPEC_POLICIES if speculation else ()) + ((STOCK_TP,) if others else ())
    speedups, finals, runs = [], [], []
    configs = [SimConfig(steps=steps, n_replicas=n_replicas, batch_size=batch, n=group_size, seed=seed,
                         policies=policies, controller=controller or ControllerConfig(), prompt_record=False,
                         engine=engine, best_static_grid="coarse", stock_widths=others,
                         **({"speculation": speculation} if speculation else {}))
               for seed in range(seeds)]
    held = [replace(cfg, seed=cfg.seed + seeds, policies=("verl",)) for cfg in configs]  # the seeds not chosen on
    pools = [prompt_pool(trace, batch, cfg.seed) for cfg in configs + held]
    results = simulate_runs(list(zip(configs + held, pools)), perf, trace.name, jobs=jobs)
    results, held_stock = results[:seeds], results[seeds:]
    for cfg, pool, result in zip(configs, pools, results):
        speedups.append(result.speedup_vs("verl", steady)["tailsieve"])
        last = result.policies["tailsieve"].records[-1]
        finals.append((last.next_q, last.next_m))
        best = result.policies["best-static"]
        runs.append(SeedRun(cfg, pool, result.policies["verl"].window_mean_s(steady),
                            (best.records[-1].next_q, best.records[-1].next_m),
                            {split: grid.window_mean_s(steady) for split, grid in best.alternatives.items()}))
    (fixed_q, fixed_m), fixed_speedup = _best_fixed_split(runs, perf, steady, jobs)
    pinned_s = forked_map(lambda k: _pinned_steady_mean(held[k], pools[seeds + k], perf, (fixed_q, fixed_m), steady),
                          seeds, jobs)
    held_out = tuple(r.policies["verl"].window_mean_s(steady) / s for r, s in zip(held_stock, pinned_s))
    left_stock = any(rec.m or rec.q for r in results for rec in r.policies["tailsieve"].records)
    speedups_arr = np.array(speedups)
    ms = [m for _, m in finals]
    m0 = _most_common(ms)
    q0 = int(np.median([q for q, m in finals if m == m0]))
    oracle = float(np.mean([r.speedup_vs("verl", steady)["prompt-oracle-split"] for r in results]))
    return Plan(float(speedups_arr.mean()), _band(speedups_arr), tuple(float(x) for x in speedups), q0, m0, fixed_q,
                fixed_m, fixed_speedup, batch, group_size, n_replicas, steps, prompts,
                plan_engines(results, steady, (q0, m0)) if speculation else None, prompt_copies(prompts, batch),
                oracle, held_out, left_stock,
                _width_plan(results, configs, pools, perf, trace.name, widths, steady, jobs) if others else None)


def _width_plan(results: list[SimResult], configs: list[SimConfig], pools: list[PromptPool], perf: PerfModel,
                name: str, widths: dict[int, EngineConfig], steady: slice, jobs: int) -> WidthPlan:
    """Stock verl at each width over the seeds (``verl-tp``'s runs); where the strongest is not the plan's own, adaptive
    TailSieve and stock verl at it on the same seeds and prompts."""
    cfg = configs[0]
    width, gpus = cfg.engine.width, cfg.n_replicas * cfg.engine.width
    per_width = {t: np.array([r.policies[STOCK_TP].alternatives[t].window_mean_s(steady) for r in results])
                 for t in sorted(widths)}
    own = per_width[width]
    best = min(per_width, key=lambda t: per_width[t].mean())  # ties: the narrowest
    plan = WidthPlan(width, gpus, {t: float(np.mean(own / s)) for t, s in per_width.items()}, best,
                     widths[best].max_num_seqs, tuple(float(x) for x in own / per_width[best]))
    if best == width or gpus // best < 2:
        return plan
    wide = [replace(c, n_replicas=gpus // best, engine=widths[best], policies=("verl", "tailsieve"), stock_widths=())
            for c in configs]
    ran = simulate_runs(list(zip(wide, pools)), perf, name, jobs=jobs)
    tailsieve = [r.policies["tailsieve"].window_mean_s(steady) for r in ran]
    return replace(plan, tailsieve=tuple(float(r.policies["verl"].window_mean_s(steady) / s)
                                         for r, s in zip(ran, tailsieve)),
                   tailsieve_vs_width=tuple(float(x) for x in own / np.array(tailsieve)),
                   tailsieve_left_stock=any(rec.m or rec.q for r in ran for rec in r.policies["tailsieve"].records))


def holds_one_step(trace: Trace) -> bool:
    """Every group has as many samples: the shape of one logged step (`tailsieve trace --step`, a preset's
    step). A prompt pool over several steps holds each prompt's samples of every step it was drawn in."""
    return len({g.n for g in trace}) == 1


def trace_batch(trace: Trace) -> tuple[int, str]:
    """The batch a plan of ``trace`` assumes, and why: one logged step's own group count, else
    min(64, groups / 2) (a pool of several steps does not say its batch)."""
    if holds_one_step(trace):
        return len(trace), "the trace's groups: it holds one step"
    return min(64, len(trace) // 2), "assumed min(64, groups/2): the trace holds several steps; give --batch"


def _pinned_steady_mean(cfg: SimConfig, pool: PromptPool, perf: PerfModel, split: tuple[int, int], steady: slice) -> float:
    """The steady-state mean makespan of TailSieve pinned at ``split`` on ``cfg``'s stream."""
    pinned = static_split_runner(cfg, pool, perf, split, "fixed")
    for t in range(cfg.steps):
        pinned.step(t, keep=False)
    return pinned.finish().window_mean_s(steady)


def _band(samples) -> tuple[float, float]:
    return float(np.percentile(samples, 10)), float(np.percentile(samples, 90))


def _most_common(values: list):
    return max(dict.fromkeys(values), key=values.count)  # ties: the first seen (seed 0's)


def plan_engines(results: list[SimResult], steady: slice, tailsieve_start: tuple[int, int]) -> EnginePlan:
    """From one simulation per seed with every stock policy and the TailSieve candidates: the best stock
    configuration (least mean steady-state makespan over the seeds), each candidate's speedups over stock
    verl and over that configuration on the same seed, and the configuration with the least mean
    steady-state makespan of all. A hindsight
    pick that differs between seeds is named by its most common value. ``tailsieve_start``: routing-only
    TailSieve's (q, m) to start from (the plan's)."""
    names = dict.fromkeys((*STOCK_POLICIES, *TAILSIEVE_CANDIDATES))
    per_seed = {name: np.array([r.policies[name].window_mean_s(steady) for r in results]) for name in names}

    def configuration(name: str, best_stock: str) -> Configuration:
        finals = [r.policies[name].records[-1] for r in results]
        vs_verl = per_seed["verl"] / per_seed[name]
        vs_best = per_seed[best_stock] / per_seed[name]
        label = _most_common([r.policies[name].choice for r in results])
        if name == "tailsieve":
            q, m = tailsieve_start
        elif name.startswith("tailsieve"):
            q, m = int(np.median([f.next_q for f in finals])), _most_common([f.next_m for f in finals])
        else:
            q = m = 0
        return Configuration(name, label, _engines(results[0].config, name, label), q, m, float(vs_verl.mean()),
                             _band(vs_verl), float(vs_best.mean()), _band(vs_best))

    def over_seeds(name: str) -> float:
        return float(per_seed[name].mean())

    best_stock = min(STOCK_POLICIES, key=over_seeds)
    stock = configuration(best_stock, best_stock)
    candidates = tuple(configuration(name, best_stock) for name in TAILSIEVE_CANDIDATES)
    choice = min((stock, *candidates), key=lambda c: over_seeds(c.name))  # ties: the stock configuration
    return EnginePlan(stock, candidates, choice)


def _engines(cfg: SimConfig, name: str, label: str) -> dict:
    """Each pool's speculation under policy ``name`` (stock policies: ``label``, their pick, on every replica)."""
    if name in STOCK_POLICIES:
        return {"tail": label or "off", "bulk": label or "off"}
    tail, bulk = (tailsieve_spec_config(cfg, name) if name != "tailsieve" else cfg).tail_and_bulk_engines
    return {"tail": engine_label(tail), "bulk": engine_label(bulk)}


class SeedRun(NamedTuple):
    """One seed of a plan, as the fixed-split search needs it."""

    cfg: SimConfig
    pool: PromptPool
    stock_s: float  # stock verl's steady-state mean makespan
    best_split: tuple[int, int]  # best-static's split
    split_s: dict  # the steady-state mean makespan of every split best-static ran to the end (its screen stops the rest)


def _best_fixed_split(runs: list[SeedRun], perf: PerfModel, steady: slice, jobs: int) -> tuple[tuple[int, int], float]:
    """Each seed's best-static split and one shared pool, on every seed: the one with the best mean speedup, and that
    speedup. Best-static ran most (split, seed) pairs to the end already; ``jobs`` processes run the others (those its
    screen stopped) pinned, side by side."""
    splits = sorted({(0, 0)} | {run.best_split for run in runs})
    missing = [(split, seed) for split in splits for seed, run in enumerate(runs) if split not in run.split_s]

    def pinned(index: int) -> float:
        split, seed = missing[index]
        return _pinned_steady_mean(runs[seed].cfg, runs[seed].pool, perf, split, steady)

    ran = forked_map(pinned, len(missing), jobs)
    split_s = {(split, seed): s for seed, run in enumerate(runs) for split, s in run.split_s.items()}
    split_s |= dict(zip(missing, ran))
    mean_speedup = {split: float(np.mean([run.stock_s / split_s[split, seed] for seed, run in enumerate(runs)]))
                    for split in splits}
    best = max(mean_speedup, key=mean_speedup.get)
    return best, mean_speedup[best]
