"""Multi-step closed-loop simulator: routing policies side by side on one prompt stream.

Every policy consumes ``batch_size`` (B) groups × ``n`` responses per step on ``n_replicas`` (R)
replicas; lengths are drawn fresh at every (re)generation from a :class:`core.workload.PromptPool`
(persistent prompt difficulty), and every pool is timed by the one evaluator,
:func:`core.replica.evaluate_samples`, with the given performance model and engine
(``SimConfig.engine`` on every replica; a TailSieve step puts ``tail_engine`` on its m tail replicas
and ``bulk_engine`` on the rest, :meth:`SimConfig.pool_engines`).

Policies:

* ``verl`` — stock verl 0.9.1: B fresh groups, every sample to the least-in-flight replica (a group
  spreads over all replicas). The baseline: speedups are reported against it first.
* ``verl-redraw`` — stock verl on the same prompt stream with its own, independent length draws:
  how far two runs of one policy differ by sampling alone, the noise floor of every speedup
  (opt-in). All other policies share their draws (see ``_Runner.draw_key``).
* ``uniform`` — B fresh groups round-robin over all replicas, groups atomic (the paper's baseline).
* ``tailsieve-fixed`` — TailSieve with the tail pool pinned (``fixed_tail_replicas``, default R/2)
  and only the inner q loop.
* ``tailsieve`` — TailSieve with both loops, starting from one shared pool (0, 0).
* ``best-static`` — hindsight reference for the controller: the TailSieve mechanism with every fixed
  (q, m) of :func:`static_grid` (inner loop off, (0, 0) = one shared pool included) on the same
  prompt stream; reports the one with the lowest mean makespan. What a perfect static controller
  reaches. Opt-in: one TailSieve run per grid point; ``best_static_screen`` stops all but the best
  few after the first steps (a screened grid: a lower bound on the full grid's best).
* ``verl-spec`` / ``verl-dynsd`` / ``verl-dynsd-best`` — stock verl's routing with speculative decoding
  on every replica (``SimConfig.speculation``: acceptance, draft cost): each depth of ``spec_depths``, the
  best in hindsight (its k named); vLLM's documented batch-size schedule (:func:`vllm_doc_schedule`); the
  best schedule of :func:`schedule_grid` in hindsight. With ``verl`` these are the stock configurations;
  ``best_stock`` names the fastest, the bar TailSieve must clear (opt-in).
* ``tailsieve-spec`` — TailSieve with route-specialised speculation: the tail pool (pinned at
  ``fixed_tail_replicas``) at the deepest k, the bulk pool on vLLM's schedule; q adapts.
  ``tailsieve-dynsd`` — adaptive TailSieve with vLLM's schedule on every replica, m free (opt-in). The
  controller's prior and yardstick stay on the engine without limits (a known gap).
* ``tailsieve-auto`` — TailSieve that falls back to stock verl with speculation, decided online
  (:mod:`core.fallback`): each step either the split (tail pool pinned at ``fixed_tail_replicas`` at the
  deepest k, the bulk pool on the stock engine) or one shared pool with stock verl's routing and the
  stock engine on every replica. The stock engine is the stock speculative configuration
  (:func:`stock_engines`) with the least replayed makespan on the steps observed so far. The engines
  switch per step for free here; a deployment restarts them (or runs one schedule everywhere).
* ``clairvoyant-split`` — knows this step's lengths: the best of a small grid of splits, the longest
  groups on a tail pool at the deepest speculation (or on ``engine``), the rest by stock verl's
  routing on ``engine``, one shared pool included (:class:`ClairvoyantSplitRunner`; opt-in). On the
  best stock configuration's engine, the ceiling of route-specialised speculation over it.
* ``prompt-oracle-split`` — the same grid, routing-only (the tail pool on ``engine``), with the groups
  ranked by each prompt's true typical length (:meth:`PromptPool.typical_length`: its median under this
  step's policy, nothing of this step's samples) instead of their true tokens: the best any per-prompt
  predictor of lengths can do (:class:`PromptOracleSplitRunner`; opt-in). The gap to
  ``clairvoyant-split`` is what per-sample chance costs; the gap from TailSieve to it, what its signal misses.
* ``clairvoyant-group`` / ``clairvoyant-sample`` — know this step's lengths: the B fresh groups
  (or their single samples) routed ``topk-balanced`` (:mod:`core.policies`) with the best (k, m),
  searched coarse-to-fine within ``oracle_time_limit_s`` per step, on ``SimConfig.engine`` (no per-pool
  engines, no speculation unless the engine has it). References, not policies one
  can deploy. TailSieve shifts a long group by at most one step (``max_deferral_steps``), so it can
  edge past them only by that shift: a larger gap is a bug until shown otherwise (``warnings()``).

A TailSieve step (see :mod:`core.selector`): the tail pool (m replicas) regenerates the T top-scored
carried candidates; the bulk pool (R − m) runs the other candidates and new prompts, ``B − T + a``
groups; within each pool every sample goes to the least-in-flight replica like stock verl does
(``group_atomic``: whole groups round-robin, the paper's setting). The requeued candidates run to
completion; once ``B − C`` fresh groups have finished (the cutoff), the ``a`` fresh ones still running
are aborted, and the tokens each had generated by then are its score as a candidate next step
(:func:`core.selector.bulk_cutoff`). Makespan = max(tail pool done, the bulk pool's last consumed group).
When nothing is carried the tail replicas join the bulk pool; at q = 0 (uniform routing) every
candidate runs in the bulk pool and nothing is aborted. Aborted work before the cutoff is
reported as wasted tokens. A ledger checks every prompt is consumed exactly once, by the policy
version of its step.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from .bias import ks_distance, ks_noise
from .controller import ControllerConfig, GroupRecord, max_q
from .cycle import TailSieveCycle
from .engine import EngineConfig, SpeculativeConfig, replica_engines
from .verify_cost import VerifyTable
from .errors import TailSieveError
from .fallback import Arm, FallbackConfig, StockFallback
from .perf import PerfModel
from .oracle import SetCost
from .policies import (best_k_search, expand_to_samples, least_inflight_assignment, longest_to_tail, pool_assignment,
                       route, singletons)
from .replica import Evaluation, evaluate_samples, tokens_generated_at
from .selector import Cutoff, bulk_cutoff
from .kinds import Pool
from .trace import Group
from .workload import PromptPool

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
# opt-in (``--policies ...,best-static``): one TailSieve run per grid point, ~50 runs at R = 8;
# ``verl-redraw``: the noise floor, stock verl again with an independent set of length draws
REFERENCE_SPLITS = ("clairvoyant-split", "prompt-oracle-split")  # a grid of splits, best per step (engine model only)
ALL_POLICIES = POLICIES + ("best-static", "verl-redraw") + SPEC_POLICIES + ("prompt-oracle-split",)
BASELINE = "verl"  # every speedup is measured against stock verl first
SPEC_DEPTHS = (1, 2, 3, 4, 5, 6)  # verl-spec's depths, the best in hindsight reported

# Speculation assumed when none is given (MTP, from public figures, not measured here): conditional
# acceptance per draft position (DeepSeek-V3's 2nd token 85-90 %, vLLM PR #48892's per-position fall), a
# one-layer drafter at 1/28 of a decode step per draft token (one of a 28-layer model's layers), k = 3.
DEFAULT_SPECULATION = SpeculativeConfig(3, (0.85, 0.8, 0.75), draft_cost=1 / 28)


def _settings_json(settings) -> dict:
    """An engine or speculation config as JSON; a measured verify table by its name (file:model)."""
    return asdict(settings, dict_factory=lambda items: {k: v.name if isinstance(v, VerifyTable) else v
                                                        for k, v in items})


def vllm_doc_schedule(k: int) -> tuple[tuple[int, int, int], ...]:
    """vLLM's dynamic-SD documentation schedule (k = 3 for batch 1-64, 1 for 65-128, 0 above), its depths
    scaled to ``k`` (3 → 3, 1, 0)."""
    return ((1, 64, k), (65, 128, max(1, round(k / 3))), (129, 256, 0))


def schedule_grid(k_max: int) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """``verl-dynsd-best``'s schedules: deep depth d ≤ ``k_max`` up to batch b, depth 1 up to 2b, 0 above
    (vLLM's documented shape at other depths and batch thresholds), named like ``--spec-schedule``."""
    grid = {}
    for d in sorted({min(k_max, x) for x in (2, 3, 4, 6)}):
        for b in (16, 32, 64, 128):
            off = (2 * b + 1, max(2 * b + 1, 256), 0)  # 256: verl's max_num_seqs; above it k stays 0
            schedule = ((1, b, d), (b + 1, 2 * b, 1), off) if d > 1 else ((1, 2 * b, 1), off)
            grid[schedule_text(schedule)] = schedule
    return grid


def schedule_text(schedule: Sequence[Sequence[int]]) -> str:
    """A schedule in ``--spec-schedule`` words, e.g. 1-64:3,65-128:1,129-129:0."""
    return ",".join(f"{lo}-{hi}:{k}" for lo, hi, k in schedule)


def with_speculation(engine: EngineConfig, profile: SpeculativeConfig, k: int,
                     schedule: tuple = ()) -> EngineConfig:
    """``engine`` with ``profile``'s acceptance and draft cost at depth ``k`` (or a schedule whose
    deepest k is the depth)."""
    depth = max([k] + [entry[2] for entry in schedule])
    return replace(engine, speculative=replace(profile, num_speculative_tokens=depth, schedule=tuple(schedule)))

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
    group_atomic: bool = False  # TailSieve pools keep a group's samples on one replica (the paper's setting)
    oracle_time_limit_s: float = 2.0  # per step, for each clairvoyant (k, m) search
    prompt_record: bool = True  # TailSieve keeps a per-prompt length record (core.prompt_record) across epochs
    regeneration_draws: int = 0  # TailSieve's regenerated groups take this set of draws (0 = the shared one;
    #   other values give a run that differs only in its regeneration luck)
    best_static_screen: tuple[int, int] = (8, 6)  # best-static: after this many steps keep this many best
    #   grid points (and (0, 0)) running; (0, 0) = run the whole grid every step
    engine: EngineConfig = field(default_factory=EngineConfig)  # every replica's engine (default: no limit)
    tail_engine: EngineConfig | None = None  # TailSieve's tail-pool replicas (None: ``engine``)
    bulk_engine: EngineConfig | None = None  # TailSieve's bulk-pool replicas, and every replica of a step
    #   without a tail pool (None: ``engine``)
    speculation: SpeculativeConfig = DEFAULT_SPECULATION  # acceptance, draft cost and depth (k) of the
    #   speculation policies (:data:`SPEC_POLICIES`); its k scales vLLM's documented schedule
    spec_depths: tuple[int, ...] = SPEC_DEPTHS  # verl-spec's depths (best in hindsight); tailsieve-spec's
    #   tail pool speculates at the deepest

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 2 or self.n < 1:
            raise SimError(f"need --steps >= 1, --batch >= 2 and --n >= 1, got {self.steps}, {self.batch_size}, {self.n}")
        if self.n_replicas < 2:
            raise SimError(f"TailSieve needs at least 2 replicas (a tail and a bulk pool), got --replicas {self.n_replicas}")
        unknown = [p for p in self.policies if p not in ALL_POLICIES]
        if unknown or not self.policies:
            raise SimError(f"unknown policy {unknown[0] if unknown else '(none)'}; choose from {', '.join(ALL_POLICIES)}")
        if self.regeneration_draws < 0:
            raise SimError(f"regeneration_draws must be >= 0, got {self.regeneration_draws}")
        if not 1 <= self.fixed_m < self.n_replicas:
            raise SimError(f"fixed tail replicas must be in 1..{self.n_replicas - 1}, got {self.fixed_m}")
        for name in ("engine", "tail_engine", "bulk_engine"):
            value = getattr(self, name)
            if not (isinstance(value, EngineConfig) or (value is None and name != "engine")):
                raise SimError(f"{name} must be an EngineConfig, got {value!r}"[:200])
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


@dataclass(frozen=True)
class GroupSpan:
    """One sample's run in the kept step, for the Gantt chart."""

    replica: int
    finish_s: float  # when it finished (or the abort moment)
    route: Pool  # TAIL or BULK
    aborted: bool


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One policy's step (keyword-only: fourteen fields, several of the same type)."""

    step: int
    makespan_s: float
    q: int  # the isolation target of this step (the controller's q)
    m: int  # tail-pool replicas used this step (0 = one shared pool)
    n_tail: int  # carried groups regenerated this step
    tail_s: float  # tail pool done (0 without a tail pool)
    bulk_s: float  # the bulk pool's end (its last consumed group), or the shared pool's end
    wasted_tokens: int  # the aborted groups' work at the abort (core.selector.StepOutcome.aborted_work)
    consumed_tokens: int
    consumed_lengths: tuple[int, ...]  # response lengths of the B consumed groups (bias monitor)
    replica_busy_s: tuple[float, ...]
    next_q: int
    next_m: int
    n_requeued: int = 0  # carried candidates drained through the bulk pool (run to completion)
    spans: tuple[GroupSpan, ...] = ()  # only for the kept step


@dataclass
class PolicyResult:
    name: str
    records: list[StepRecord] = field(default_factory=list)
    lost: int = 0
    duplicated: int = 0
    stale: int = 0  # consumed groups generated under an older policy version
    max_deferral_steps: int = 0  # the most steps a prompt waited between its pull and its consumption
    choice: str = ""  # a best-in-hindsight policy's pick (best-static's split, verl-spec's k, a schedule)

    @property
    def makespans(self) -> np.ndarray:
        return np.array([r.makespan_s for r in self.records])

    @property
    def mean_makespan_s(self) -> float:
        return float(self.makespans.mean())

    @property
    def consumed_lengths(self) -> np.ndarray:
        """Every consumed response length of the run."""
        return np.fromiter((x for r in self.records for x in r.consumed_lengths), dtype=float)

    def length_bias(self, reference: "PolicyResult", batch_size: int) -> tuple[float, float]:
        """KS distance of this run's consumed lengths to ``reference``'s, and that distance's noise for
        two unbiased samples of as many groups (:mod:`core.bias`; groups, not responses, are independent)."""
        return (ks_distance(self.consumed_lengths, reference.consumed_lengths),
                ks_noise(batch_size * len(self.records), batch_size * len(reference.records)))

    @property
    def wasted_fraction(self) -> float:
        wasted = sum(r.wasted_tokens for r in self.records)
        return wasted / max(1, wasted + sum(r.consumed_tokens for r in self.records))


@dataclass
class SimResult:
    config: SimConfig
    workload: str
    perf: str
    policies: dict[str, PolicyResult]

    def speedup_vs(self, baseline: str, window: slice | None = None) -> dict[str, float]:
        """Mean-makespan speedup of every policy over ``baseline`` ({} when it did not run)."""
        if baseline not in self.policies:
            return {}
        base = self.policies[baseline].makespans[window or slice(None)].mean()
        return {name: float(base / r.makespans[window or slice(None)].mean()) for name, r in self.policies.items()}

    @property
    def best_stock(self) -> str | None:
        """The fastest stock configuration that ran (:data:`STOCK_POLICIES`: stock verl with or without
        speculation), the bar TailSieve must clear; None when none ran."""
        stock = [name for name in STOCK_POLICIES if name in self.policies]
        return min(stock, key=lambda name: self.policies[name].mean_makespan_s, default=None)

    def length_bias(self) -> dict[str, tuple[float, float]]:
        """(KS distance, its noise) of every policy's consumed lengths against stock verl's on the same
        stream ({} when stock verl did not run): a routing-induced length bias shows as a KS well above
        its noise."""
        if BASELINE not in self.policies:
            return {}
        base = self.policies[BASELINE]
        return {name: r.length_bias(base, self.config.batch_size) for name, r in self.policies.items()}

    def warnings(self) -> list[str]:
        """What a reader must check before trusting the speedups."""
        out = []
        vs_verl = self.speedup_vs(BASELINE)
        ceiling = vs_verl.get("clairvoyant-sample")
        for name, r in self.policies.items():
            if r.max_deferral_steps > 1:
                out.append(f"{name}: a prompt waited {r.max_deferral_steps} steps between its pull and its "
                           "consumption (more than one step: its consumed batches lose long prompts)")
            if ceiling is not None and name.startswith("tailsieve") and vs_verl[name] > ceiling:
                out.append(f"{name} is {vs_verl[name]:.3f}x stock verl, above the clairvoyant per-sample reference "
                           f"({ceiling:.3f}x): check max_deferral_steps first ({r.max_deferral_steps}: a prompt "
                           "deferred to a later step makes this step look short), then the reference's "
                           "--oracle-time-limit")
        for name, (ks, noise) in self.length_bias().items():
            if ks > 2 * noise:
                out.append(f"{name}: consumed lengths differ from stock verl's (KS {ks:.3f}, noise {noise:.3f}): a "
                           "length bias in what the policy trains on")
        return out

    def to_json(self) -> dict:
        final = {name: r.records[-1] for name, r in self.policies.items()}
        bias = self.length_bias()
        return {
            "workload": self.workload, "perf_model": self.perf,
            "steps": self.config.steps, "replicas": self.config.n_replicas,
            "batch": self.config.batch_size, "n": self.config.n, "seed": self.config.seed,
            "group_atomic": self.config.group_atomic,
            "engine": _settings_json(self.config.engine),
            "tail_engine": _settings_json(self.config.tail_engine) if self.config.tail_engine else None,
            "bulk_engine": _settings_json(self.config.bulk_engine) if self.config.bulk_engine else None,
            "speculation": (_settings_json(self.config.speculation)
                            if any(p in SPEC_POLICIES for p in self.policies) else None),
            "policies": {name: {"mean_makespan_s": r.mean_makespan_s, "choice": r.choice or None,
                                "final_q": final[name].next_q, "final_m": final[name].next_m,
                                "wasted_token_fraction": r.wasted_fraction,
                                "prompts_lost": r.lost, "prompts_duplicated": r.duplicated,
                                "stale_responses": r.stale, "max_deferral_steps": r.max_deferral_steps,
                                "consumed_mean_length": float(r.consumed_lengths.mean()),
                                "length_bias_ks": bias[name][0] if name in bias else None,
                                "length_bias_ks_noise": bias[name][1] if name in bias else None,
                                "makespan_s": [round(x, 4) for x in r.makespans.tolist()],
                                "q": [x.q for x in r.records], "m": [x.m for x in r.records]}
                         for name, r in self.policies.items()},
            "speedup_vs_verl": self.speedup_vs("verl"),
            "speedup_vs_uniform": self.speedup_vs("uniform"),
            "best_stock": self.best_stock,
            "speedup_vs_best_stock": self.speedup_vs(self.best_stock) if self.best_stock else {},
            "warnings": self.warnings(),
        }


class PromptStream:
    """The dataset order every policy reads from: a fresh shuffle per epoch, ids ``prompt#epoch``."""

    def __init__(self, prompt_ids: Sequence[str], seed: int):
        self.prompt_ids = list(prompt_ids)
        self.rng = np.random.default_rng([seed, 7])
        self.epoch = -1
        self.order: list[str] = []

    def take(self, k: int) -> list[str]:
        out: list[str] = []
        while len(out) < k:
            if not self.order:
                self.epoch += 1
                self.order = [f"{self.prompt_ids[i]}#{self.epoch}" for i in self.rng.permutation(len(self.prompt_ids))]
            out.append(self.order.pop())
        return out


def prompt_of(instance_id: str) -> str:
    return instance_id.rpartition("#")[0]


class Ledger:
    """Audits the exactly-once contract: pulled = consumed + in flight, each consumed once, on-policy,
    and how long each prompt waited between its pull and its consumption (its deferral, in steps)."""

    def __init__(self) -> None:
        self.pulled: Counter = Counter()
        self.consumed: Counter = Counter()
        self.stale = 0
        self.pulled_at: dict[str, int] = {}
        self.max_deferral = 0

    def pull(self, ids: Sequence[str], step: int) -> None:
        self.pulled.update(ids)
        self.pulled_at.update(dict.fromkeys(ids, step))

    def consume(self, ids: Sequence[str], generated_version: dict[str, int], current_version: int) -> None:
        """``current_version`` is the step: the policy version of a synchronous step."""
        self.consumed.update(ids)
        self.stale += sum(generated_version[i] != current_version for i in ids)
        self.max_deferral = max([self.max_deferral] + [current_version - self.pulled_at[i] for i in ids])

    def audit(self, in_flight: Sequence[str]) -> tuple[int, int]:
        accounted = self.consumed + Counter(in_flight)
        lost = sum((self.pulled - accounted).values())
        duplicated = sum((accounted - self.pulled).values())  # consumed twice, or consumed and still in flight
        return lost, duplicated

    def deferral(self, in_flight: Sequence[str], steps: int) -> int:
        """The longest deferral of any prompt after ``steps`` steps; one still in flight has waited at
        least until the next step."""
        return max([self.max_deferral] + [steps - self.pulled_at[i] for i in in_flight])


# ---------------------------------------------------------------------------- one step per policy

def _spans(ev: Evaluation, groups: Sequence[Group], routes: Sequence[Pool], aborted: Sequence[bool],
           abort_s: float) -> tuple[GroupSpan, ...]:
    """Per sample, for the Gantt chart (a group may span replicas)."""
    starts = ev.group_starts
    return tuple(GroupSpan(int(ev.sample_replica[starts[i] + j]),
                           float(min(f, abort_s) if aborted[i] else f), routes[i], bool(aborted[i]))
                 for i in range(len(groups)) for j, f in enumerate(ev.response_finish_s[i]))


def step_times(ev: Evaluation, n_tail: int, n_requeued: int, fresh_quota: int) -> tuple[float, Cutoff]:
    """(tail pool done, the bulk pool's cutoff) of a step whose first ``n_tail`` groups ran in the
    tail pool and the next ``n_requeued`` were requeued candidates (consumed whenever they finish);
    the cutoff falls when ``fresh_quota`` fresh bulk groups finished (:func:`core.selector.bulk_cutoff`).
    The makespan is the larger of the tail pool's end and the bulk pool's (``Cutoff.bulk_end_s``)."""
    tail_s = float(ev.group_finish_s[:n_tail].max()) if n_tail else 0.0
    return tail_s, bulk_cutoff(ev.group_finish_s[n_tail:], n_requeued, fresh_quota)


class _Runner:
    name = ""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, execute: Execute | None = None):
        self.cfg, self.pool, self.perf = cfg, pool, perf
        self.execute = execute
        self.stream = PromptStream(pool.prompt_ids, cfg.seed)
        self.draw_stream = 12 if self.name == "verl-redraw" else 11
        self.routing_rng = np.random.default_rng([cfg.seed, 13])  # verl's random tie-breaks, apart from lengths
        self.ledger = Ledger()
        self.result = PolicyResult(self.name)

    def sample(self, ids: Sequence[str], step: int) -> list[Group]:
        """Fresh lengths of each prompt at this step, drawn with :meth:`draw_key`."""
        return [self.pool.sample_group(prompt_of(i), self.cfg.n, step, np.random.default_rng(self.draw_key(i, step)))
                for i in ids]

    def draw_key(self, instance_id: str, step: int) -> list[int]:
        """A draw is keyed by (seed, prompt, step), not by the order of calls, so every policy that
        generates a prompt at a step gets the same lengths (common random numbers): a difference
        between policies is their routing, not their luck."""
        return [self.cfg.seed, self.draw_stream, step, zlib.crc32(prompt_of(instance_id).encode())]

    def in_flight(self) -> list[str]:
        return []

    def engines(self, m: int) -> list[EngineConfig]:
        """Every replica's engine in a step whose tail pool has m replicas."""
        return [self.cfg.engine] * self.cfg.n_replicas

    def run(self, groups: Sequence[Group], samples: np.ndarray, m: int) -> Evaluation:
        """One step's samples on their replicas: the ``execute`` hook, else the engine model."""
        if self.execute is not None:
            return self.execute(self.name, groups, samples)
        return evaluate_samples(groups, samples, self.cfg.n_replicas, self.perf, engine=self.engines(m))

    def finish(self) -> PolicyResult:
        self.result.lost, self.result.duplicated = self.ledger.audit(self.in_flight())
        self.result.stale = self.ledger.stale
        self.result.max_deferral_steps = self.ledger.deferral(self.in_flight(), len(self.result.records))
        return self.result


class StaticRunner(_Runner):
    """One-step policies of :data:`core.policies.POLICIES`: B fresh groups per step, all consumed.

    ``clairvoyant-*`` know this step's lengths (references, not deployable)."""

    NAMES = ("verl", "verl-redraw", "uniform", "clairvoyant-group", "clairvoyant-sample")
    STOCK_ROUTING = ("verl", "verl-redraw") + STOCK_SPEC_POLICIES  # verl's per-sample least-in-flight

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str, execute: Execute | None = None):
        self.name = name
        super().__init__(cfg, pool, perf, execute)

    def step(self, t: int, keep: bool) -> None:
        cfg = self.cfg
        ids = self.stream.take(cfg.batch_size)
        self.ledger.pull(ids, t)
        groups = self.sample(ids, t)
        samples, m = self.assign(groups)
        ev = self.run(groups, samples, m)
        self.ledger.consume(ids, dict.fromkeys(ids, t), t)
        lengths = tuple(x for g in groups for x in g.lengths)
        starts = ev.group_starts
        routes = [Pool.TAIL if samples[starts[i]] < m else Pool.BULK for i in range(len(groups))]
        spans = _spans(ev, groups, routes, [False] * len(groups), ev.makespan_s) if keep else ()
        tail_s = max((ev.replica_times_s[r] for r in range(m)), default=0.0)
        bulk_s = max(ev.replica_times_s[m:])
        self.result.records.append(StepRecord(
            step=t, makespan_s=ev.makespan_s, q=0, m=m, n_tail=sum(r == Pool.TAIL for r in routes), tail_s=tail_s,
            bulk_s=bulk_s, wasted_tokens=0, consumed_tokens=sum(lengths), consumed_lengths=lengths,
            replica_busy_s=tuple(ev.replica_times_s), next_q=0, next_m=m, spans=spans))

    def assign(self, groups: list[Group]) -> tuple[np.ndarray, int]:
        """Replica of every sample and the tail pool's size (replicas 0..m-1; 0 = one pool)."""
        R = self.cfg.n_replicas
        if self.name in self.STOCK_ROUTING:
            return least_inflight_assignment(sum(g.n for g in groups), R, rng=self.routing_rng), 0
        if self.name == "uniform":
            return route("uniform", groups, R, self.perf).sample_assignment, 0
        # Clairvoyant: the (k, m) search coarse-to-fine under a per-step time limit.
        units = groups if self.name == "clairvoyant-group" else singletons(groups)
        found = best_k_search(units, R, SetCost(units, self.perf), None, exhaustive=False,
                              time_limit_s=self.cfg.oracle_time_limit_s)
        samples = expand_to_samples(groups, found.assignment) if units is groups else found.assignment
        return samples, found.m


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
        """(q, m, tail engine): m of 1, 2, R/4, R/2; q of B/32, B/16, B/8, B/4 (at least m)."""
        R, B = self.cfg.n_replicas, self.cfg.batch_size
        ms = sorted({m for m in (1, 2, R // 4, R // 2) if 1 <= m < R})
        qs = sorted({max(1, B // d) for d in (32, 16, 8, 4)})
        return [(max(q, m), m, tail) for m in ms for q in qs for tail in (self.deep, self.cfg.engine)]

    def engines(self, m: int) -> list[EngineConfig]:
        return replica_engines(self.tail_engine, self.cfg.engine, m, self.cfg.n_replicas)

    def assign(self, groups: list[Group]) -> tuple[np.ndarray, int]:
        R = self.cfg.n_replicas
        samples = least_inflight_assignment(sum(g.n for g in groups), R, rng=self.routing_rng)
        best = evaluate_samples(groups, samples, R, self.perf, engine=self.cfg.engine).makespan_s
        pick, self.tail_engine = ("shared", 0), self.cfg.engine
        for q, m, tail in self.candidates():
            split = longest_to_tail(groups, q, m, R, self.cfg.group_atomic, self.split_rng, self.rank(groups))
            makespan = evaluate_samples(groups, split, R, self.perf,
                                        engine=replica_engines(tail, self.cfg.engine, m, R)).makespan_s
            if makespan < best:
                best, samples, self.tail_engine = makespan, split, tail
                pick = (f"q={q}, m={m}, tail {engine_label(tail)}", m)
        self.picks[pick[0]] += 1
        return samples, pick[1]

    def rank(self, groups: list[Group]) -> Sequence[float] | None:
        """What the grid's splits rank the groups by (None: their true tokens this step)."""
        return None

    def finish(self) -> PolicyResult:
        result = super().finish()
        label, count = self.picks.most_common(1)[0]
        result.choice = (f"split on {sum(self.picks.values()) - self.picks['shared']} of {sum(self.picks.values())} "
                         f"steps; most often {label} ({count})")
        return result


class PromptOracleSplitRunner(ClairvoyantSplitRunner):
    """``prompt-oracle-split``: :class:`ClairvoyantSplitRunner`'s grid, routing-only, the groups ranked by
    each prompt's true typical length under this step's policy (times its samples): what an ideal
    per-prompt predictor knows, nothing per sample. The grid point is still the step's best in hindsight,
    so it bounds what a per-prompt signal can reach with any (q, m) rule. Not deployable."""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "prompt-oracle-split"):
        super().__init__(cfg, pool, perf, name)
        self.step_index = 0

    def candidates(self) -> list[tuple[int, int, EngineConfig]]:
        return sorted({(q, m, self.cfg.engine) for q, m, _ in super().candidates()}, key=lambda c: c[:2])

    def step(self, t: int, keep: bool) -> None:
        self.step_index = t
        super().step(t, keep)

    def rank(self, groups: list[Group]) -> Sequence[float]:
        return [self.pool.typical_length(g.prompt_id, self.step_index) * g.n for g in groups]


class TailSieveRunner(_Runner):
    """Selector + controller in closed loop; the controller sees only measurable quantities."""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, controller_cfg: ControllerConfig,
                 name: str, execute: Execute | None = None):
        self.name = name
        super().__init__(cfg, pool, perf, execute)
        self.cycle = TailSieveCycle(cfg.batch_size, cfg.n_replicas, controller_cfg, perf,
                                    per_sample=not cfg.group_atomic, record=cfg.prompt_record, prompt_key=prompt_of,
                                    engines=cfg.tail_and_bulk_engines)
        self.generated: dict[str, int] = {}

    def in_flight(self) -> list[str]:
        return list(self.cycle.selector.carried)

    def engines(self, m: int) -> list[EngineConfig]:
        return self.cfg.pool_engines(m)

    def draw_key(self, instance_id: str, step: int) -> list[int]:
        key = super().draw_key(instance_id, step)
        if self.cfg.regeneration_draws and instance_id in self.generated:  # generated before: a regeneration
            key.append(self.cfg.regeneration_draws)
        return key

    def step(self, t: int, keep: bool) -> None:
        cfg, R = self.cfg, self.cfg.n_replicas
        pulled = self.stream.take(self.cycle.n_fresh())
        self.ledger.pull(pulled, t)
        plan, m = self.cycle.plan(pulled, R)
        bulk_ids = list(plan.requeued_ids) + list(plan.bulk_fresh_ids)
        tail = self.sample(plan.tail_ids, t)  # regenerated from scratch under policy version t
        bulk = self.sample(bulk_ids, t)
        self.generated.update(dict.fromkeys(list(plan.tail_ids) + bulk_ids, t))
        groups = tail + bulk
        samples = np.concatenate([pool_assignment(tail, m, 0, cfg.group_atomic, self.routing_rng),
                                  pool_assignment(bulk, R - m, m, cfg.group_atomic, self.routing_rng)])
        ev = self.run(groups, samples, m)
        tail_finish = ev.group_finish_s[:len(tail)]
        bulk_finish = ev.group_finish_s[len(tail):]
        # requeued groups run to completion; the fresh ones still running at the cutoff are aborted. After
        # the cutoff the requeued ones are timed as if the aborted ones kept decoding beside them (the
        # evaluator runs every sample to its end): an upper bound on the bulk pool's end.
        tail_s, cut = step_times(ev, len(tail), len(plan.requeued_ids), plan.fresh_quota)
        makespan = max(tail_s, cut.bulk_end_s)
        at_abort = tokens_generated_at(groups, ev, cut.cutoff_s)[len(tail):]
        scores = {bulk_ids[i]: int(at_abort[i]) for i in cut.aborted}
        done = list(cut.consumed)
        outcome, _ = self.cycle.finish(
            plan, [bulk_ids[i] for i in done], scores,
            tail=[(pid, GroupRecord(g.lengths, float(f))) for pid, g, f in zip(plan.tail_ids, tail, tail_finish)],
            bulk=[(bulk_ids[i], GroupRecord(bulk[i].lengths, float(bulk_finish[i]))) for i in done],
            m=m, cutoff_s=cut.bulk_end_s, prompt_len=float(np.mean([g.prompt_len for g in groups])), policy_version=t)
        self.ledger.consume(outcome.consumed_ids, self.generated, t)
        for pid in outcome.consumed_ids:
            del self.generated[pid]
        consumed = tail + [bulk[i] for i in done]
        self.last_consumed = consumed
        lengths = tuple(x for g in consumed for x in g.lengths)
        busy = [min(x, cut.bulk_end_s) if r >= m else x for r, x in enumerate(ev.replica_times_s)]
        spans = ()
        if keep:
            aborted = np.zeros(len(bulk), dtype=bool)
            aborted[list(cut.aborted)] = True
            routes = [Pool.TAIL] * len(tail) + [Pool.BULK] * len(bulk)
            spans = _spans(ev, groups, routes, [False] * len(tail) + aborted.tolist(), cut.cutoff_s)
        self.result.records.append(StepRecord(
            step=t, makespan_s=makespan, q=plan.q, m=m, n_tail=len(tail), n_requeued=len(plan.requeued_ids),
            tail_s=tail_s, bulk_s=cut.bulk_end_s, wasted_tokens=outcome.aborted_work,
            consumed_tokens=sum(lengths), consumed_lengths=lengths, replica_busy_s=tuple(busy),
            next_q=self.cycle.decision.q, next_m=self.cycle.decision.m, spans=spans))


def static_grid(n_replicas: int, batch_size: int, max_q_fraction: float = 0.5) -> list[tuple[int, int]]:
    """The (q, m) points ``best-static`` tries: (0, 0), and for every m in 1..R−1 the q of a
    geometric-ish grid of batch fractions with m <= q <= the controller's q bound."""
    q_max = max_q(max_q_fraction, batch_size)
    fractions = (1 / 64, 1 / 32, 1 / 16, 3 / 32, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2)
    points = [(0, 0)]
    for m in range(1, n_replicas):
        qs = sorted({m, q_max} | {int(round(f * batch_size)) for f in fractions})
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
        return results[self.best]

    def label(self, key) -> str:
        return str(key)


class BestStaticRunner(HindsightRunner):
    """``best-static``: one TailSieve run per fixed (q, m) of :func:`static_grid`; the best in hindsight."""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "best-static",
                 execute: Execute | None = None):
        runners = {split: static_split_runner(cfg, pool, perf, split, name, execute)
                   for split in static_grid(cfg.n_replicas, cfg.batch_size, cfg.controller.max_q_fraction)}
        super().__init__(name, runners, cfg.best_static_screen, keep=(0, 0))

    @property
    def split(self) -> tuple[int, int]:
        return self.best

    def label(self, key) -> str:
        return f"q={key[0]}, m={key[1]}"


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


def stock_engines(cfg: SimConfig, kind: str = "all") -> dict[str, EngineConfig]:
    """Stock speculative engines by name: ``k=K`` for each depth of ``cfg.spec_depths`` (``depths``:
    verl-spec's), every schedule of :func:`schedule_grid` (``grid``: verl-dynsd-best's), or those and
    vLLM's documented schedule (``all``: what ``tailsieve-auto`` falls back to)."""
    profile = cfg.speculation
    engines: dict[str, EngineConfig] = {}
    if kind in ("depths", "all"):
        engines.update({f"k={k}": with_speculation(cfg.engine, profile, k) for k in cfg.spec_depths})
    schedules = dict(schedule_grid(max(cfg.spec_depths))) if kind in ("grid", "all") else {}
    if kind == "all":
        doc = vllm_doc_schedule(profile.num_speculative_tokens)
        schedules[schedule_text(doc)] = doc
    engines.update({label: with_speculation(cfg.engine, profile, 0, schedule) for label, schedule in schedules.items()})
    return engines


class FallbackRunner(TailSieveRunner):
    """``tailsieve-auto``: TailSieve's split or stock verl with speculation, each step chosen online by
    :class:`core.fallback.StockFallback` from the steps already run.

    After every step the engine model replays stock verl's routing of the step's consumed groups with
    every stock engine of :func:`stock_engines`; the one with the least replayed makespan so far is the
    stock engine of the next steps (after ``SCREEN_STEPS`` only the best ``SCREEN_KEEP`` are replayed),
    and the replay with the engine in use is the yardstick the step is judged by. A second replay puts
    the step's q longest groups in the tail pool (q of the controller, half and twice it): the split's
    ceiling on that work; a probe waits while the ceiling's total does not beat the stock replay's."""

    SCREEN_STEPS, SCREEN_KEEP = 3, 4

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str = "tailsieve-auto",
                 fallback: FallbackConfig = FallbackConfig()):
        pinned = replace(cfg.controller, fixed_tail_replicas=cfg.fixed_m,
                         q_init=max(1, cfg.controller.q_init or cfg.batch_size // 16))
        super().__init__(cfg, pool, perf, pinned, name)
        self.switch = StockFallback(fallback)
        self.tail_engine = cfg.tail_engine or with_speculation(cfg.engine, cfg.speculation, max(cfg.spec_depths))
        self.stock = stock_engines(cfg)
        self.replayed = dict.fromkeys(self.stock, 0.0)
        self.stock_pick = f"k={max(cfg.spec_depths)}"  # before any step: the deepest fixed k
        self.replay_rng = np.random.default_rng([cfg.seed, 17])
        self.arms: list[Arm] = []
        self.ceiling_s = self.stock_s = 0.0  # the split's ceiling and the stock replay, summed over the steps
        self.cycle.hold_shared(True)

    def split_ceiling_s(self, groups: list[Group]) -> float:
        """The split's best case on ``groups``, lengths known: the q longest (by work) in the tail pool, the
        rest in the bulk pool, for q of the controller, half and twice it; the least makespan."""
        cfg, R = self.cfg, self.cfg.n_replicas
        decision = self.cycle.controller.decision
        m = max(1, decision.m)
        order = sorted(groups, key=lambda g: -sum(g.lengths))
        best = float("inf")
        for q in sorted({max(m, decision.q // 2), max(m, decision.q), min(len(groups) - 1, 2 * max(m, decision.q))}):
            samples = longest_to_tail(order, q, m, R, cfg.group_atomic, self.replay_rng)
            best = min(best, evaluate_samples(order, samples, R, self.perf, engine=self.engines(m)).makespan_s)
        return best

    def engines(self, m: int) -> list[EngineConfig]:
        stock = self.stock[self.stock_pick]
        return [self.tail_engine] * m + [stock] * (self.cfg.n_replicas - m)

    def step(self, t: int, keep: bool) -> None:
        arm = self.switch.arm
        super().step(t, keep)
        self.arms.append(arm)
        groups, R = self.last_consumed, self.cfg.n_replicas
        samples = least_inflight_assignment(sum(g.n for g in groups), R, rng=self.replay_rng)
        replay = {label: evaluate_samples(groups, samples, R, self.perf, engine=self.stock[label]).makespan_s
                  for label in self.replayed}
        record = self.result.records[-1]
        self.ceiling_s += self.split_ceiling_s(groups)
        self.stock_s += replay[self.stock_pick]
        may_win = self.ceiling_s < self.stock_s * (1 - self.switch.config.margin)
        next_arm = self.switch.observe(t, record.makespan_s / replay[self.stock_pick], had_tail=record.m > 0,
                                       split_may_win=may_win)
        for label, makespan in replay.items():
            self.replayed[label] += makespan
        if t + 1 == self.SCREEN_STEPS:
            kept = sorted(self.replayed, key=self.replayed.get)[:self.SCREEN_KEEP]
            self.replayed = {label: self.replayed[label] for label in kept}
        self.stock_pick = min(self.replayed, key=self.replayed.get)
        if next_arm is not arm:
            self.cycle.hold_shared(next_arm is Arm.STOCK)

    def finish(self) -> PolicyResult:
        result = super().finish()
        split = sum(a is Arm.SPLIT for a in self.arms)
        result.choice = (f"stock {self.stock_pick}; split (tail {engine_label(self.tail_engine)}) "
                         f"on {split} of {len(self.arms)} steps, {self.switch.probes} probes, "
                         f"{self.switch.gated} held by the ceiling")
        return result


def tailsieve_spec_config(cfg: SimConfig, name: str) -> SimConfig:
    """The engines of TailSieve with speculation: ``tailsieve-spec`` speculates at the deepest of
    ``cfg.spec_depths`` in the tail pool (pinned at ``cfg.fixed_m`` replicas, as a deployment sets engines
    at launch) and runs vLLM's documented schedule in the bulk pool, or the pool engines ``cfg`` gives
    (``--tail-*`` / ``--bulk-*`` flags); ``tailsieve-dynsd`` runs that schedule on every replica, so the
    tail pool's small batch picks the deep k by itself and the split stays free."""
    profile = cfg.speculation
    scheduled = with_speculation(cfg.engine, profile, 0, vllm_doc_schedule(profile.num_speculative_tokens))
    if name == "tailsieve-dynsd":
        return replace(cfg, engine=scheduled, tail_engine=None, bulk_engine=None)
    return replace(cfg, tail_engine=cfg.tail_engine or with_speculation(cfg.engine, profile, max(cfg.spec_depths)),
                   bulk_engine=cfg.bulk_engine or scheduled)


def engine_label(engine: EngineConfig) -> str:
    """An engine's speculation in ``--spec-schedule`` words: ``off``, ``k=K`` or a schedule."""
    spec = engine.speculative
    if spec is None:
        return "off"
    return schedule_text(spec.schedule) if spec.schedule else f"k={spec.num_speculative_tokens}"


def spec_label(cfg: SimConfig) -> str:
    """What a TailSieve speculation run's engines do: ``tail K_OR_SCHEDULE / bulk K_OR_SCHEDULE`` or one
    schedule."""
    if cfg.tail_engine is None:
        return schedule_text(cfg.engine.speculative.schedule)
    return f"tail {engine_label(cfg.tail_engine)} / bulk {engine_label(cfg.bulk_engine)}"


def build_runners(cfg: SimConfig, pool: PromptPool, perf: PerfModel,
                  execute: Execute | None = None) -> list[_Runner | HindsightRunner]:
    runners: list[_Runner | HindsightRunner] = []
    for name in cfg.policies:
        if (name in SPEC_POLICIES or name in REFERENCE_SPLITS) and execute is not None:
            raise SimError(f"{name} runs on the engine model; a real engine (execute) is configured per launch")
        if name in StaticRunner.NAMES:
            runners.append(StaticRunner(cfg, pool, perf, name, execute))
        elif name in STOCK_SPEC_POLICIES:
            runners.append(stock_spec_runner(cfg, pool, perf, name))
        elif name == "tailsieve-auto":
            runners.append(FallbackRunner(cfg, pool, perf, name))
        elif name == "clairvoyant-split":
            runners.append(ClairvoyantSplitRunner(cfg, pool, perf, name))
        elif name == "prompt-oracle-split":
            runners.append(PromptOracleSplitRunner(cfg, pool, perf, name))
        elif name == "best-static":
            runners.append(BestStaticRunner(cfg, pool, perf, name, execute))
        elif name in ("tailsieve", "tailsieve-dynsd"):
            run_cfg = cfg if name == "tailsieve" else tailsieve_spec_config(cfg, name)
            runners.append(TailSieveRunner(run_cfg, pool, perf, replace(cfg.controller, fixed_tail_replicas=None),
                                           name, execute))
            runners[-1].result.choice = "" if name == "tailsieve" else spec_label(run_cfg)
        else:  # tailsieve-fixed, and tailsieve-spec: per-pool engines are set at launch, so the split is pinned
            fixed = replace(cfg.controller, fixed_tail_replicas=cfg.fixed_m,
                            q_init=max(1, cfg.controller.q_init or cfg.batch_size // 16))
            run_cfg = tailsieve_spec_config(cfg, name) if name == "tailsieve-spec" else cfg
            runners.append(TailSieveRunner(run_cfg, pool, perf, fixed, name, execute))
            runners[-1].result.choice = spec_label(run_cfg) if name == "tailsieve-spec" else ""
    return runners


def simulate(cfg: SimConfig, pool: PromptPool, perf: PerfModel, workload_name: str = "",
             progress: Callable[[int, int], None] | None = None, execute: Execute | None = None,
             jobs: int = 1) -> SimResult:
    """Run every policy of ``cfg`` for ``cfg.steps`` steps; ``progress(done, total)`` after each step
    (with ``jobs`` > 1, after each policy's last). ``execute`` runs each step's samples (default: the
    performance model; see :data:`Execute`). ``jobs``: processes that run the policies side by side
    (the same results: a policy's run depends on nothing another does)."""
    cfg.validate()
    if len(pool) < 2 * cfg.batch_size:
        raise SimError(f"the prompt pool has {len(pool)} prompts; the simulation needs at least 2 × batch = "
                       f"{2 * cfg.batch_size} (a prompt is in flight at most once)")
    runners = build_runners(cfg, pool, perf, execute)
    keep = cfg.steps - 1 if cfg.gantt_step is None else cfg.gantt_step
    total = cfg.steps * len(runners)
    if jobs > 1 and execute is None and len(runners) > 1:
        results = _run_side_by_side(runners, cfg.steps, keep, jobs, progress)
    else:
        for t in range(cfg.steps):
            for j, runner in enumerate(runners):
                runner.step(t, keep=t == keep)
                if progress is not None:
                    progress(t * len(runners) + j + 1, total)
        results = [r.finish() for r in runners]
    return SimResult(cfg, workload_name or pool.spec.name, getattr(perf, "name", str(perf)),
                     {r.name: result for r, result in zip(runners, results)})


_FORKED_RUNNERS: list = []  # the runners a forked worker of :func:`_run_side_by_side` steps (inherited, not pickled)


def _run_to_end(index: int, steps: int, keep: int) -> PolicyResult:
    runner = _FORKED_RUNNERS[index]
    for t in range(steps):
        runner.step(t, keep=t == keep)
    return runner.finish()


def _run_side_by_side(runners: list, steps: int, keep: int, jobs: int,
                      progress: Callable[[int, int], None] | None) -> list[PolicyResult]:
    """Each runner's whole run in a forked worker process, ``jobs`` at a time; the results in runner order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    _FORKED_RUNNERS[:] = runners
    try:
        with ProcessPoolExecutor(min(jobs, len(runners)), mp_context=multiprocessing.get_context("fork")) as workers:
            futures = {workers.submit(_run_to_end, i, steps, keep): i for i in range(len(runners))}
            results: dict[int, PolicyResult] = {}
            for done, future in enumerate(as_completed(futures), start=1):
                results[futures[future]] = future.result()
                if progress is not None:
                    progress(done * steps, len(runners) * steps)
    finally:
        _FORKED_RUNNERS.clear()
    return [results[i] for i in range(len(runners))]
