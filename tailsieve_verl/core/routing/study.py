"""Offline routing study (§2.2 and the appendix of the paper "TailSieve: Partial-Rollout-Guided
Tail Routing for LLM Rollouts"): how close do simple policies get to the optimum?

An *instance* is one rollout group in the paper's sense: ``trajectories`` responses (default 100)
routed across ``replicas`` replicas, in atomic prompt groups of ``group_size`` responses
(default 1: every trajectory is routed on its own, the paper's "per-group best-k" over 100
trajectories). Each instance draws ``trajectories / group_size`` prompts (from a workload preset or
an observed trace) at its own checkpoint step, and is routed by

* ``best-k`` — topk-balanced with the best k and m for the instance,
* ``fixed-10%`` — topk-balanced isolating 10 % of the groups on one tail replica,
* ``verl`` — stock verl 0.9.1: every sample to the least-loaded replica (with ``group_size`` > 1
  it splits groups, so it can beat the group-level optimum),
* ``random-uniform`` — equal group counts per replica in a random order,
* ``uniform-oracle`` — balanced known work, no isolation,

and compared against the best-known optimum: the exact branch-and-bound search, anytime within
``time_limit_s`` per instance, seeded with best-k. Each instance records whether the optimum was
proven and the proven lower bound. A policy's true optimality gap lies between its gap to the
best-known optimum (``gap``) and its gap to the proven lower bound (``gap_to_bound``); both are
reported, and they coincide on instances whose optimum was proven.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from ..errors import TailSieveError
from ..engine.perf import DEFAULT_PERF_MODEL, PerfModel, parse_perf_model
from .policies import route
from ..engine.engine import EngineConfig
from ..engine.replica import evaluate_assignment
from ..data.trace import Group, read_trace
from ..data.workload import PRESETS, PromptPool, cap_trace, get_preset

STUDY_POLICIES = ("best-k", "fixed-10%", "verl", "random-uniform", "uniform-oracle")
PAPER_RESULT = {"best-k worst gap": 0.04, "best-k share within 1%": 0.72}  # the paper's §2.2 figures


class StudyError(TailSieveError):
    """A study setting that cannot be run (sizes, workload source)."""


@dataclass(frozen=True)
class StudyConfig:
    instances: int = 100
    trajectories: int = 100
    group_size: int = 1
    replicas: int = 4
    perf_model: str = DEFAULT_PERF_MODEL
    workload: str = "real"
    seed: int = 0
    time_limit_s: float = 0.8
    isolation_fraction: float = 0.1
    engine: EngineConfig = field(default_factory=EngineConfig)  # every replica's engine (default: no limit)
    max_response_length: int | None = None  # verl's caps (core.data.workload.cap_trace; a preset's prompts are
    max_prompt_length: int | None = None  # max_prompt_length long); None: the preset's or the trace's own

    def validate(self) -> None:
        if self.instances < 1:
            raise StudyError(f"--instances must be >= 1, got {self.instances}")
        if self.group_size < 1 or self.trajectories < self.group_size:
            raise StudyError(f"need 1 <= --group-size <= --trajectories, got group size {self.group_size} "
                             f"and {self.trajectories} trajectories")
        if self.trajectories % self.group_size:
            raise StudyError(f"--trajectories ({self.trajectories}) must be a multiple of --group-size "
                             f"({self.group_size}): groups are atomic")
        if self.replicas < 2:
            raise StudyError(f"the study compares tail isolation, which needs --replicas >= 2, got {self.replicas}")
        if self.time_limit_s <= 0:
            raise StudyError(f"--time-limit must be > 0 seconds, got {self.time_limit_s}")
        if not 0 < self.isolation_fraction < 1:
            raise StudyError(f"isolation fraction must lie in (0, 1), got {self.isolation_fraction}")

    @property
    def groups_per_instance(self) -> int:
        return self.trajectories // self.group_size


@dataclass(frozen=True)
class InstanceResult:
    index: int
    optimum_s: float  # best known (proven when ``optimal``)
    lower_bound_s: float
    optimal: bool
    makespan_s: dict[str, float]
    best_k: int
    best_m: int

    def gap(self, policy: str) -> float:
        """Gap to the best-known optimum: a lower estimate of the true optimality gap."""
        return self.makespan_s[policy] / self.optimum_s - 1.0 if self.optimum_s > 0 else 0.0

    def gap_to_bound(self, policy: str) -> float:
        """Gap to the proven lower bound: an upper bound on the true optimality gap."""
        return self.makespan_s[policy] / self.lower_bound_s - 1.0 if self.lower_bound_s > 0 else 0.0


@dataclass
class StudyResult:
    config: StudyConfig
    instances: list[InstanceResult] = field(default_factory=list)
    elapsed_s: float = 0.0

    def gaps(self, policy: str, to_bound: bool = False) -> np.ndarray:
        return np.array([r.gap_to_bound(policy) if to_bound else r.gap(policy) for r in self.instances])

    def summary(self) -> dict:
        policies = {}
        for p in STUDY_POLICIES:
            policies[p] = _gap_stats(self.gaps(p))
            policies[p]["to_lower_bound"] = _gap_stats(self.gaps(p, to_bound=True))
        bound_gap = np.array([1.0 - r.lower_bound_s / r.optimum_s if r.optimum_s > 0 else 0.0 for r in self.instances])
        return {
            "policies": policies,
            "oracle": {"proven_optimal": int(sum(r.optimal for r in self.instances)),
                       "instances": len(self.instances),
                       "worst_optimum_to_bound_gap": float(bound_gap.max()),
                       "median_optimum_to_bound_gap": float(np.median(bound_gap))},
            "best_k_choices": {"k_median": float(np.median([r.best_k for r in self.instances])),
                               "m_counts": {str(m): int(sum(r.best_m == m for r in self.instances))
                                            for m in sorted({r.best_m for r in self.instances})}},
            "paper_reference": PAPER_RESULT,
            "elapsed_s": self.elapsed_s,
        }

    def to_json(self) -> dict:
        return {"config": asdict(self.config), "summary": self.summary(),
                "instances": [asdict(r) for r in self.instances]}


def _gap_stats(g: np.ndarray) -> dict:
    return {"median_gap": float(np.median(g)), "p90_gap": float(np.percentile(g, 90)),
            "worst_gap": float(g.max()), "share_within_1pct": float(np.mean(g <= 0.01))}


def _instance_source(config: StudyConfig) -> Callable[[int, np.random.Generator], list[Group]]:
    """Groups of instance i: fresh prompts at checkpoint step i (preset) or resampled trace prompts."""
    g = config.groups_per_instance
    if config.workload in PRESETS:
        spec = get_preset(config.workload, max_response_length=config.max_response_length,
                          prompt_len=config.max_prompt_length)
        pool = PromptPool(spec, config.instances * g, seed=config.seed)
        return lambda i, rng: pool.sample_groups(pool.prompt_ids[i * g:(i + 1) * g], config.group_size, i, rng)
    if not os.path.exists(config.workload):
        raise StudyError(f"--workload {config.workload!r} is neither a preset ({', '.join(PRESETS)}) "
                         "nor an existing trace file")
    trace = cap_trace(read_trace(config.workload), config.max_response_length, config.max_prompt_length)
    if len(trace) < g:
        raise StudyError(f"trace {config.workload} has {len(trace)} prompts; an instance needs {g} "
                         f"(--trajectories / --group-size); lower --trajectories or raise --group-size")
    pool = PromptPool.from_trace(trace, seed=config.seed)

    def draw(i: int, rng: np.random.Generator) -> list[Group]:
        picks = rng.choice(len(pool), size=g, replace=False)
        return pool.sample_groups([pool.prompt_ids[j] for j in sorted(picks)], config.group_size, 0, rng)
    return draw


def run_instance(index: int, groups: list[Group], config: StudyConfig, perf: PerfModel,
                 rng: np.random.Generator) -> InstanceResult:
    """Route one instance with every study policy and the exact search."""
    R = config.replicas
    n = len(groups)
    engine = config.engine
    best_k = route("best-k", groups, R, perf, engine=engine)
    fixed_k = max(1, int(round(config.isolation_fraction * n)))
    fixed = route("topk-balanced", groups, R, perf, k=fixed_k, tail_replicas=1, engine=engine)
    order = rng.permutation(n)
    random_assignment = np.empty(n, dtype=np.int64)
    random_assignment[order] = np.arange(n) % R
    random_uniform = evaluate_assignment(groups, random_assignment, R, perf, engine).makespan_s
    balanced = route("uniform-oracle", groups, R, perf, engine=engine).makespan_s
    exact = route("exact", groups, R, perf, time_limit_s=config.time_limit_s, engine=engine)
    makespans = {"best-k": best_k.makespan_s, "fixed-10%": fixed.makespan_s,
                 "verl": route("verl", groups, R, perf, engine=engine).makespan_s, "random-uniform": random_uniform,
                 "uniform-oracle": balanced}
    optimum = min([exact.makespan_s] + list(makespans.values()))
    return InstanceResult(index, optimum, min(exact.lower_bound_s, optimum), exact.optimal, makespans,
                          best_k.k, best_k.tail_replicas)


def run_study(config: StudyConfig, progress: Callable[[int, int], None] | None = None) -> StudyResult:
    """Run every instance; ``progress(done, total)`` is called after each."""
    config.validate()
    perf = parse_perf_model(config.perf_model)
    draw = _instance_source(config)
    result = StudyResult(config)
    start = time.perf_counter()
    for i in range(config.instances):
        rng = np.random.default_rng([config.seed, i])
        result.instances.append(run_instance(i, draw(i, rng), config, perf, rng))
        if progress is not None:
            progress(i + 1, config.instances)
    result.elapsed_s = time.perf_counter() - start
    return result
