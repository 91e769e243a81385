"""What a simulation runs: the policy names (default, opt-in, stock, references) and :class:`SimConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..tailsieve.controller import ControllerConfig
from ..engine.engine import EngineConfig, SpeculativeConfig, replica_engines
from ..errors import TailSieveError
from ..engine.replica import Evaluation
from ..data.trace import Group
from .speculation import DEFAULT_SPECULATION, SPEC_DEPTHS


POLICIES = ("verl", "uniform", "tailsieve-fixed", "tailsieve", "clairvoyant-group", "clairvoyant-sample")


# speculation (opt-in): stock verl with speculative decoding on every replica (a fixed depth, the best in
# hindsight; vLLM's batch-size schedule; the best schedule of a small grid in hindsight), and TailSieve with
# speculation per pool or one schedule on every replica (:data:`SPEC_POLICIES`)
STOCK_SPEC_POLICIES = ("verl-spec", "verl-dynsd", "verl-dynsd-best")


LAUNCH_SPEC_POLICIES = STOCK_SPEC_POLICIES + ("tailsieve-spec", "tailsieve-dynsd")  # engines fixed at launch, as


#   a verl run sets them (tailsieve-auto switches engines per step; clairvoyant-split is a reference)
SPEC_POLICIES = LAUNCH_SPEC_POLICIES + ("tailsieve-auto", "clairvoyant-split")


POOL_ENGINE_POLICIES = ("tailsieve", "tailsieve-fixed", "best-static", "tailsieve-spec", "tailsieve-auto")  # read


#   SimConfig.tail_engine / bulk_engine (tailsieve-auto: the tail engine; its bulk runs the stock engine it picks)
STOCK_POLICIES = ("verl",) + STOCK_SPEC_POLICIES  # what a verl 0.9.1 user can run without TailSieve


STOCK_TP = "verl-tp"  # stock verl at every single tensor-parallel width of the run's GPUs, the best in hindsight
#   (SimConfig.stock_widths); a stock configuration too, weighed wherever it ran


# opt-in (``--policies ...,best-static``): one TailSieve run per grid point, ~50 runs at R = 8;
# ``verl-redraw``: the noise floor, stock verl again with an independent set of length draws
# the references: a grid of splits, best per step (engine model only)
REFERENCE_SPLITS = ("clairvoyant-split", "group-oracle-split", "prompt-oracle-split", "history-oracle-split",
                    "record-oracle-split", "record-history-oracle-split")


ALL_POLICIES = POLICIES + ("best-static", "verl-redraw", STOCK_TP) + SPEC_POLICIES + ("group-oracle-split", "prompt-oracle-split",
                                                                          "history-oracle-split", "record-oracle-split",
                                                                          "record-history-oracle-split")


BASELINE = "verl"  # every speedup is measured against stock verl first


# Runs one step's samples (policy name, groups, replica of every sample) and reports when each
# finished. The default is the performance model (:func:`evaluate_samples`); a real engine can take
# its place (``tools.closed_loop``), so the same policies run closed-loop on measured times.
Execute = Callable[[str, Sequence[Group], np.ndarray], Evaluation]


class SimError(TailSieveError):
    """An impossible simulation setting."""


@dataclass(frozen=True)
class SimConfig:
    steps: int = 30
    n_replicas: int = 8
    batch_size: int = 64
    n: int = 8
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    fixed_tail_replicas: int | None = None  # tailsieve-fixed's pinned m; None = n_replicas // 2
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    gantt_step: int | None = None  # step whose per-group timeline is kept (None = the last)
    start_step: int = 0  # the training step the run starts at: every policy's stream has handed out start_step × B
    #   prompts before it, and TailSieve's per-prompt record holds each one measured at the step it was drawn
    #   (a later epoch's state, without simulating the steps before it)
    group_atomic: bool = False  # TailSieve pools keep a group's samples on one replica (the paper's setting)
    oracle_time_limit_s: float = 0.5  # CPU s per step, for each clairvoyant (k, m) search (at 512 x 16 under
    #   verl's defaults 0.5 s is within 0.7 % of 2 s: scripts/results/engine_model/speed_bench_512x16.txt)
    prompt_record: bool = True  # TailSieve keeps a per-prompt length record (core.tailsieve.prompt_record) across epochs
    record_replaces_aborts: bool = False  # TailSieve aborts only for the fresh prompts its record cannot predict
    #   (core.tailsieve.cycle.TailSieveCycle)
    length_prior_sigma: float | None = None  # TailSieve's record starts with a per-prompt length predictor's
    #   estimate of every prompt: its typical length at step 0 × n × exp(σ·z), z standard normal and fixed per
    #   prompt (0 = a perfect per-prompt predictor); None = an empty record, a first epoch with no predictor
    regeneration_draws: int = 0  # TailSieve's regenerated groups take this set of draws (0 = the shared one;
    #   other values give a run that differs only in its regeneration luck)
    best_static_screen: tuple[int, int] = (8, 6)  # best-static: after this many steps keep this many best
    #   grid points (and (0, 0)) running; (0, 0) = run the whole grid every step
    best_static_grid: str = "full"  # best-static's grid: "full" or "coarse" (the plan's; references.static_grid)
    engine: EngineConfig = field(default_factory=EngineConfig)  # every replica's engine (default: no limit)
    tail_engine: EngineConfig | None = None  # TailSieve's tail-pool replicas (None: ``engine``)
    bulk_engine: EngineConfig | None = None  # TailSieve's bulk-pool replicas, and every replica of a step
    #   without a tail pool (None: ``engine``)
    speculation: SpeculativeConfig = DEFAULT_SPECULATION  # acceptance, draft cost and depth (k) of the
    #   speculation policies (:data:`SPEC_POLICIES`); its k scales vLLM's documented schedule
    spec_depths: tuple[int, ...] = SPEC_DEPTHS  # verl-spec's depths (best in hindsight); tailsieve-spec's
    #   tail pool speculates at the deepest
    stock_widths: tuple[EngineConfig, ...] = ()  # verl-tp: stock verl's engine at each other single width, each on
    #   the run's GPUs (n_replicas × engine.width) divided by its width (core.engine.engine.single_widths)

    def validate(self) -> None:
        if self.start_step < 0:
            raise SimError(f"start_step must be >= 0, got {self.start_step}")
        if self.steps < 1 or self.batch_size < 2 or self.n < 1:
            raise SimError(f"need --steps >= 1, --batch >= 2 and --n >= 1, got {self.steps}, {self.batch_size}, {self.n}")
        if self.n_replicas < 2:
            raise SimError(f"TailSieve needs at least 2 replicas (a tail and a bulk pool), got --replicas {self.n_replicas}")
        unknown = [p for p in self.policies if p not in ALL_POLICIES]
        if unknown or not self.policies:
            raise SimError(f"unknown policy {unknown[0] if unknown else '(none)'}; choose from {', '.join(ALL_POLICIES)}")
        if self.best_static_grid not in ("full", "coarse"):
            raise SimError(f"best_static_grid must be 'full' or 'coarse', got {self.best_static_grid!r}")
        if self.length_prior_sigma is not None and not self.length_prior_sigma >= 0:
            raise SimError(f"length_prior_sigma must be >= 0 (or None: no predictor), got {self.length_prior_sigma}")
        if self.length_prior_sigma is not None and not self.prompt_record:
            raise SimError("length_prior_sigma seeds TailSieve's per-prompt record; it needs prompt_record=True")
        if self.regeneration_draws < 0:
            raise SimError(f"regeneration_draws must be >= 0, got {self.regeneration_draws}")
        if not 1 <= self.fixed_m < self.n_replicas:
            raise SimError(f"fixed tail replicas must be in 1..{self.n_replicas - 1}, got {self.fixed_m}")
        for name in ("engine", "tail_engine", "bulk_engine"):
            value = getattr(self, name)
            if not (isinstance(value, EngineConfig) or (value is None and name != "engine")):
                raise SimError(f"{name} must be an EngineConfig, got {value!r}"[:200])
        gpus = self.n_replicas * self.engine.width
        if any(not isinstance(e, EngineConfig) or gpus % e.width for e in self.stock_widths):
            raise SimError(f"every stock width must be an EngineConfig of a width dividing the {gpus} GPUs")
        if STOCK_TP in self.policies and not self.stock_widths:
            raise SimError(f"{STOCK_TP} prices stock verl at other single widths; none is given (stock_widths: a "
                           "bundled model shape's, --engine-defaults)")
        if not isinstance(self.speculation, SpeculativeConfig):
            raise SimError(f"speculation must be a SpeculativeConfig, got {self.speculation!r}"[:200])
        if not self.spec_depths or not all(isinstance(k, int) and 1 <= k <= 64 for k in self.spec_depths):
            raise SimError(f"spec_depths must be integers in 1..64, got {self.spec_depths}")

    @property
    def tail_and_bulk_engines(self) -> tuple[EngineConfig, EngineConfig]:
        """TailSieve's (tail, bulk) pool engines."""
        return self.tail_engine or self.engine, self.bulk_engine or self.engine

    def pool_engines(self, m: int) -> list[EngineConfig]:
        """One engine per replica for a TailSieve step with m tail replicas: [tail]*m + [bulk]*(R−m)
        (m = 0: the bulk engine everywhere)."""
        return replica_engines(*self.tail_and_bulk_engines, m, self.n_replicas)

    @property
    def fixed_m(self) -> int:
        return self.fixed_tail_replicas if self.fixed_tail_replicas is not None else self.n_replicas // 2
