"""Hierarchical controller on (q, m): q = groups isolated per step (aborted, carried and regenerated
in the tail pool), m = replicas of the tail pool. One shared pool, (0, 0), is stock verl's routing
and the controller's safe fallback.

The controller sees only what the rollout layer measures — pool times, the finished groups'
response lengths and finish times, abort counts — never future lengths.

* **Inner loop** (every step, m fixed): move q toward equal tail-pool time and bulk cutoff. The
  measured gap decides the direction; a rate model (smoothed seconds per tail group against the
  smoothed bulk finish curve) sizes the step, damped (``q_gain``) and bounded (``max_q_step``),
  keeping ``q >= m`` so that no tail replica idles.
* **Outer loop** (after ``settle_steps`` steps at a split): chooses m from a *measured surface*.
  Every step's makespan is divided by the **yardstick** — the perf model's predicted stock-verl
  time of that step's own consumed batch — which removes most step-to-step workload noise; the
  **relative makespan** is averaged per m over its last ``split_window`` visits or so (one step's
  measurement is too noisy to judge a split on). A split not measured yet is estimated by the perf
  model's fluid prediction (the *prior*, :class:`FluidModel` on the recent consumed batches),
  scaled by the learned measured/prior ratio; measurements outweigh the prior as they accumulate
  (``prior_weight``). Unmeasured neighbours get an exploration bonus that shrinks with visits.
  A replica moves (``max_replica_step``) only when a feasible neighbour's score beats the current
  split by ``switch_threshold``; (0, 0) is always a candidate, reached in one move and with no margin:
  a split stays only while it measures better than one shared pool, so a run that finds no split
  better returns to stock verl's routing. The controller starts at (0, 0) to measure that fallback,
  then probes the split the prior ranks best among m = 1..R/2, with the prior's q there, and searches
  from there; it probes only when the prior predicts that split beating one shared pool by
  ``switch_threshold``, the margin of every other move (a probe that does not pay costs its aborted
  work and a step of regenerated tails). Both rules together took the DAPO-sized and 64 × 8 cells
  below 0.99× stock verl from 7 of 27 to none (``scripts/experiments/probe_margin.py``).

**The planned probe and the judge of a split** (the default wherever the rollout layer passes a split planner,
as the simulator's and the trainer's TailSieve do). The fluid prior ranks splits well but picks their q badly (it assumes a
perfect tail signal), and the inner loop's balance rule then wanders q on a makespan that rises steeply
above the best q. So after measuring one shared pool the controller asks the planner
(:class:`core.simulation.split_planner.OnlineSplitPlanner`: pinned splits simulated on the groups just
measured) for a split, probes it where the plan predicts ``plan_margin`` over one shared pool, holds its q
(no inner loop) and leaves it only for one shared pool, when one shared pool measures better than the
split's record weighed against the plan's prediction (``plan_weight``), or as soon as the split's makespans over
stock verl's price of what its steps pulled (:meth:`HierarchicalController.stock_price_s`, the aborted groups'
lengths drawn past the abort) resolve a loss; it probes only a plan whose gain clears the plan's own standard
error ``probe_z`` times (``leave_z`` for the loss). It plans once per run. On the four
weak DAPO-sized cells this reaches 95-119 % of the per-prompt oracle's gain, against 50-100 % for the
prior and both loops (``scripts/experiments/probe_margin.py``; docs/results.md).

Why measured and not modelled: the fluid model assumes perfect tail precision and a noiseless step;
the rollout layer's tail signal is a low-precision filter and steps are noisy, so the prior ranks
splits but misjudges their gains (``scripts/experiments/controller_v2_eval.py --ablation`` measures both).

How the verl layer calls it, once per step after the selector's ``finish_step``::

    decision = controller.observe(StepObservation(...))   # measured quantities of this step
    plan = selector.plan_step(decision.q)                  # next step: abort q, tail pool = decision.m

When nothing is carried the rollout layer lends the tail replicas to the bulk pool. ``state_dict()``
/ ``load_state_dict()`` are JSON-serialisable for verl checkpoints.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
from scipy import stats

from ..engine.engine import EngineConfig
from ..errors import TailSieveError
from ..kinds import DecisionKind
from ..engine.perf import PerfModel
from .censored import LengthSurvival
from .fluid import NO_LIMITS, Candidates, ConsumedBatch, FluidModel, StepTable


class ControllerError(TailSieveError):
    """An impossible controller setting or an observation that contradicts the configuration."""


@dataclass(frozen=True)
class ControllerConfig:
    """Every knob of the controller; the defaults are the ones the simulations use."""

    q_init: int | None = None
    """Groups isolated per step at the start when m_init > 0; None = batch_size // 8 (at least m)."""
    m_init: int = 0
    """Tail-pool replicas at the start; 0 = one shared pool (stock verl's routing), measured first."""
    probe_tail_replicas: int | None = None
    """The outer loop's first move from a measured shared pool: straight to this m, with the perf model's
    best q there; None = the m in 1..n_replicas // 2 that the perf model ranks best; 0 = climb from
    (0, 0) one neighbour at a time. Capped at R/2 because the model, which assumes a perfect tail
    signal, overrates large tail pools (probing its best m overall lost 3.5 points at 64 × 8)."""
    fixed_tail_replicas: int | None = None
    """Pin m (the fixed-allocation variant, e.g. 2 for 2:2) and run only the inner loop; None = outer loop on."""
    max_q_fraction: float = 0.5
    """q never exceeds this fraction of the batch."""
    balance_tolerance: float = 0.05
    """Inner loop: tail time and bulk cutoff within this relative gap count as balanced (q holds)."""
    q_gain: float = 0.5
    """Inner loop damping: the fraction of the gap to the rate model's balancing q moved per step."""
    max_q_step: int = 0
    """Inner loop bound on |Δq| per step; 0 = max(1, batch_size // 16)."""
    smoothing: float = 0.5
    """Weight of the newest measurement in every smoothed quantity (1 = no smoothing)."""
    switch_threshold: float = 0.1
    """Outer loop: a neighbour's score must beat the current split's relative makespan by this fraction, and
    the prior must predict the first probe beating one shared pool by it (the way back to one shared pool
    needs no margin).
    A split's estimate rests on a few steps whose makespans vary by tens of percent, so a small threshold
    trades good splits for noise: 0.1 beat 0.05 by 0.5 ± 0.2 points of speedup over 96 paired runs
    (``scripts/experiments/controller_v2_eval.py``, 64 × 8, six cells × 16 seeds)."""
    split_window: int = 8
    """Outer loop: a split's relative makespan is the mean of its visits, then a moving average over about
    this many. One step's measurement at a split varies by about ±0.09 against gains of 0.05–0.12
    (``scripts/experiments/split_noise.py``), so a short average sends good splits back to one shared pool
    on a single unlucky step."""
    exploration_bonus: float = 0.02
    """Outer loop optimism: an unmeasured split's score is lowered by this relative amount, / sqrt(1 + visits)."""
    prior_weight: float = 1.0
    """How many measured steps the perf-model prior is worth in a split's estimate."""
    search_radius: int = 1
    """The outer loop's neighbours: splits m ± this (and always m = 0, the shared pool)."""
    max_replica_step: int = 1
    """Bound on |Δm| per decision (except the move back to one shared pool)."""
    settle_steps: int = 2
    """Steps at a split (and after any q change by the outer loop) before the outer loop decides again."""
    history_steps: int = 2
    """Consumed batches kept as the prior's response-work history."""
    survival_steps: int = 4
    """Steps whose samples (finished, and cut by an abort) estimate the length distribution past an abort, which
    prices a split step's aborted groups as stock verl would have run them (:meth:`HierarchicalController.stock_price_s`)."""
    price_draws: int = 16
    """Draws of the aborted groups' lengths past the abort averaged into a split step's stock-verl price."""
    check_feasibility: bool = True
    """Outer loop requires deadline feasibility of a replica move (the enlarged pool absorbs, by the
    current makespan, at least the groups the reduced pool releases)."""
    inner_loop: bool = True
    """Ablation switch: False freezes q (except when m moves)."""
    measured_surface: bool = True
    """Ablation switch: False ranks splits by the bias-corrected prior alone (controller v1's outer loop)."""
    candidate_factor: float = 2.0
    """Bulk groups aborted (tail candidates) per isolated group; see :mod:`core.tailsieve.selector`."""
    plan_probe: bool = True
    """With a split planner (the simulator's and the trainer's TailSieve get one): the first probe is the split
    the planner's pinned-split simulations of the measured shared-pool steps rank best, probed where it
    beats one shared pool by ``plan_margin``; a planned split holds its q (no inner loop) and leaves only for
    one shared pool. False (or no planner): the fluid prior picks the probe and both loops search. On the
    four weak DAPO-sized cells it took TailSieve from 1.057-1.143 to 1.108-1.177 (``probe_margin.py``)."""
    plan_margin: float = 0.03
    """The planned split is probed only where the plan predicts it beating one shared pool by this fraction, beyond
    ``probe_z`` standard errors of the prediction."""
    probe_z: float = 1.0
    """How many standard errors of the plan's prediction (over 3-step blocks of its simulated steps) its gain must
    clear to be probed: a split also changes which draws a run consumes (its regenerations), which moves a run by
    several per cent whatever the routing, so a gain within the plan's noise is not paid for. 2 kept one shared
    pool on weak dense 256 × 16 seeds that gain 6 % (plan 0.90 ± 0.043)."""
    leave_z: float = 1.0
    """A planned split returns to one shared pool once its makespans over stock verl's price of its pulls exceed one
    shared pool's by this many standard errors (Student's t on its steps): quick to leave, slow to enter."""
    plan_weight: float = 2.0
    """How many measured steps the plan's prediction is worth when a planned split is weighed against one
    shared pool (the way back): one step's measurement varies by about ±0.09 (``split_window``)."""
    record_plan: bool = False
    """Opt-in: where the per-prompt record knows a step's prompts (from the second epoch on) and the rollout layer
    passes a step planner, plan each step's split from their recorded lengths before it starts, abort nothing,
    and return to the controller's decisions for good when the planned steps measure worse than the split it
    holds (:mod:`core.tailsieve.cycle`). Off by default: with a record an epoch old its planned steps do not beat
    the controller's and stay far from the per-prompt oracle (``scripts/experiments/record_plan.py``;
    docs/results.md, "Later epochs")."""
    record_plan_coverage: float = 0.9
    """Plan a step from the record only where it has measured at least this share of the step's prompts."""

    def validate(self, n_replicas: int, batch_size: int) -> None:
        if n_replicas < 1 or batch_size < 2:
            raise ControllerError(f"need n_replicas >= 1 and batch_size >= 2, got {n_replicas}, {batch_size}")
        q_max = max_q(self.max_q_fraction, batch_size)
        m = initial_split(self, n_replicas, batch_size)[1]
        if not 0 <= m < n_replicas:
            raise ControllerError(f"tail replicas must be in 0..{n_replicas - 1} (the bulk pool needs one), got {m}")
        if self.fixed_tail_replicas is not None and self.fixed_tail_replicas < 1:
            raise ControllerError("fixed_tail_replicas must be >= 1 (0 is one shared pool: leave it None with m_init=0)")
        if self.q_init is not None and not 0 <= self.q_init <= q_max:
            raise ControllerError(f"q_init must be in 0..{q_max} (max_q_fraction · batch_size), got {self.q_init}")
        for name in ("q_gain", "smoothing"):
            if not 0 < getattr(self, name) <= 1:
                raise ControllerError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not self.candidate_factor >= 1:
            raise ControllerError(f"candidate_factor must be >= 1, got {self.candidate_factor}")
        if not 0 < self.max_q_fraction < 1 or self.balance_tolerance < 0 or self.switch_threshold < 0:
            raise ControllerError("max_q_fraction must be in (0, 1); balance_tolerance and switch_threshold >= 0")
        if (self.exploration_bonus < 0 or self.prior_weight < 0 or self.plan_weight < 0 or not 0 <= self.plan_margin < 1
                or self.probe_z < 0 or self.leave_z < 0):
            raise ControllerError("exploration_bonus, prior_weight, plan_weight, probe_z and leave_z must be >= 0, "
                                  "plan_margin in [0, 1)")
        if not 0 < self.record_plan_coverage <= 1:
            raise ControllerError(f"record_plan_coverage must be in (0, 1], got {self.record_plan_coverage}")
        if self.split_window < 1:
            raise ControllerError(f"split_window must be >= 1, got {self.split_window}")
        if (self.max_replica_step < 1 or self.search_radius < self.max_replica_step or self.settle_steps < 0
                or self.history_steps < 1 or self.max_q_step < 0 or self.survival_steps < 1 or self.price_draws < 1):
            raise ControllerError("need max_replica_step >= 1, search_radius >= max_replica_step, settle_steps >= 0, "
                                  "history_steps, survival_steps and price_draws >= 1, max_q_step >= 0")


def max_q(max_q_fraction: float, batch_size: int) -> int:
    """The largest q: that fraction of the batch, at least 1, and at least one bulk group left."""
    return max(1, min(batch_size - 1, int(max_q_fraction * batch_size)))


def _bounded_q(q: int, m: int, q_max: int) -> int:
    """q within min(m, q_max)..q_max: a tail pool of m replicas needs a group per replica (none idles)."""
    return int(min(max(q, min(m, q_max)), q_max))


def initial_split(config: ControllerConfig, n_replicas: int, batch_size: int) -> tuple[int, int]:
    """(q, m) of the first step: defaults filled in, q >= m (a tail pool needs a group per replica)."""
    m = config.m_init if config.fixed_tail_replicas is None else config.fixed_tail_replicas
    if m == 0:
        return 0, 0
    q = batch_size // 8 if config.q_init is None else config.q_init
    return _bounded_q(q, m, max_q(config.max_q_fraction, batch_size)), m


@dataclass(frozen=True)
class PlannedSplit:
    """A split planner's pick: (q, m), its predicted makespan relative to one shared pool's, and that
    prediction's standard error over the planner's simulated steps (0: not estimated)."""

    q: int
    m: int
    relative: float
    spread: float = 0.0


SplitPlanner = Callable[[Sequence["ConsumedBatch"], float], PlannedSplit]
"""(consumed batches of the measured steps, mean prompt tokens) -> the split to probe
(:class:`core.simulation.split_planner.OnlineSplitPlanner`)."""


@dataclass(frozen=True)
class GroupRecord:
    """A group as the rollout layer measures it once it has finished."""

    lengths: tuple[int, ...]  # response tokens of its n samples
    finish_s: float  # seconds from the pool's start until its last sample finished


@dataclass(frozen=True)
class AbortedGroup:
    """A group aborted at the cutoff as the rollout layer saw it: each sample's tokens by the abort and whether
    the abort cut it (a cut sample's length is only known to exceed its tokens)."""

    tokens: tuple[int, ...]
    cut: tuple[bool, ...]


@dataclass(frozen=True)
class StepObservation:
    """Measurable outcome of one step."""

    m: int  # tail-pool replicas actually used (0 when the tail groups ran in the shared pool)
    tail_makespan_s: float  # when the last regenerated tail group finished (0 without tail groups)
    bulk_cutoff_s: float  # when the bulk pool reached its quota (the abort moment)
    tail_groups: tuple[GroupRecord, ...]  # regenerated carried groups
    bulk_groups: tuple[GroupRecord, ...]  # bulk groups finished before the cutoff
    aborted_groups: tuple[AbortedGroup, ...] = ()  # bulk groups aborted at the cutoff (the next step's candidates)
    prompt_len: float = 0.0  # mean prompt tokens (context of the decode steps)
    fresh_groups: tuple[GroupRecord, ...] | None = None  # the consumed groups pulled this step (not carried in);
    #   None: every bulk group (a step that carried nothing in)

    @property
    def makespan_s(self) -> float:
        return max(self.tail_makespan_s, self.bulk_cutoff_s)

    @property
    def n_aborted(self) -> int:
        return len(self.aborted_groups)

    @property
    def pulled(self) -> tuple[GroupRecord, ...]:
        """The groups pulled this step that it consumed."""
        return self.bulk_groups if self.fresh_groups is None else self.fresh_groups


@dataclass(frozen=True)
class Decision:
    q: int  # groups to abort and carry in the next step
    m: int  # tail-pool replicas for the next step
    reason: str  # what moved (or why nothing did), for logs
    kind: DecisionKind = DecisionKind.FIXED  # the same, structured: what tests and callers read

    @property
    def split(self) -> tuple[int, int]:
        return self.q, self.m


@dataclass
class _Smoothed:
    """Exponential moving average that starts at its first sample: the controller's one smoother.

    Works on scalars and on arrays, where NaN marks an entry not measured (yet): a new NaN keeps
    the old value, an old NaN takes the new one."""

    weight: float
    value: float | np.ndarray | None = None

    def update(self, x):
        if self.value is None:
            self.value = x
        elif np.ndim(x):
            old = np.asarray(self.value, dtype=float)
            x = np.asarray(x, dtype=float)
            if len(old) < len(x):
                old = np.concatenate([old, np.full(len(x) - len(old), np.nan)])
            head = old[: len(x)]
            mixed = np.where(np.isnan(head), x, np.where(np.isnan(x), head, (1 - self.weight) * head + self.weight * x))
            self.value = np.concatenate([mixed, old[len(x):]]) if len(old) > len(x) else mixed
        else:
            self.value = (1 - self.weight) * self.value + self.weight * x
        return self.value

    def to_json(self):
        if self.value is None or not np.ndim(self.value):
            return self.value
        return [None if np.isnan(v) else float(v) for v in self.value]

    @classmethod
    def from_json(cls, weight: float, value) -> "_Smoothed":
        if isinstance(value, list):
            value = np.array([np.nan if v is None else v for v in value], dtype=float)
        return cls(weight, value)


@dataclass
class _Moments:
    """Count, sum and sum of squares of a measurement: its mean and the standard error of that mean."""

    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x
        self.total_sq += x * x

    @property
    def mean(self) -> float:
        return self.total / self.n

    @property
    def error(self) -> float:
        """The standard error of the mean (infinite before two measurements)."""
        if self.n < 2:
            return math.inf
        variance = max(self.total_sq / self.n - self.mean ** 2, 0.0) * self.n / (self.n - 1)
        return math.sqrt(variance / self.n)


@dataclass
class _SplitRecord:
    """What the outer loop has measured at one tail-pool size m."""

    relative_makespan: _Smoothed  # makespan / the price of the consumed batch, averaged over the steps run at this m
    visits: int = 0
    fair: _Moments = field(default_factory=_Moments)  # makespan / stock verl's price of the step's pull

    def add(self, relative: float, fair: float, window: int) -> None:
        """The mean of the visits so far, then a moving average over about ``window`` visits; the fair relative
        makespan's moments over every visit."""
        self.visits += 1
        self.relative_makespan.weight = max(1.0 / self.visits, 1.0 / window)
        self.relative_makespan.update(relative)
        self.fair.add(fair)


@dataclass
class _State:
    q: int
    m: int
    steps: int = 0
    steps_at_split: int = 0  # steps since the outer loop last changed (q, m)
    tail_s_per_group: _Smoothed | None = None  # inner loop: tail-pool seconds per regenerated group
    pool_times: _Smoothed | None = None  # inner loop: [tail, bulk] seconds at the current split
    bulk_finish_curve: _Smoothed | None = None  # inner loop: time of the k-th bulk finish (NaN = unseen)
    splits: dict = field(default_factory=dict)  # m -> _SplitRecord
    prior_bias: _Smoothed | None = None  # measured / prior relative makespan, over the splits run
    history: list = field(default_factory=list)  # last consumed batches (ConsumedBatch)
    survival: list = field(default_factory=list)  # last steps' samples: (finished lengths, cut samples' tokens)
    planned: PlannedSplit | None = None  # the split planner's pick, once it has planned


def _work_arrays(groups: Sequence[GroupRecord]) -> tuple[np.ndarray, np.ndarray]:
    return _flat([g.lengths for g in groups])


def _flat(seqs: Sequence[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """(every entry, flat; the entries per sequence)."""
    sizes = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(sizes.sum()))
    return flat, sizes


def _aborted_arrays(aborted: Sequence[AbortedGroup]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(every aborted sample's tokens, flat; the samples per group; whether the abort cut each)."""
    tokens, sizes = _flat([g.tokens for g in aborted])
    cut = np.fromiter(itertools.chain.from_iterable(g.cut for g in aborted), dtype=bool, count=len(tokens))
    return tokens, sizes, cut


def _samples_seen(consumed: ConsumedBatch, aborted: Sequence[AbortedGroup]) -> tuple[np.ndarray, np.ndarray]:
    """A step's samples for the length estimate: (every finished one's length, every cut one's tokens)."""
    tokens, _, cut = _aborted_arrays(aborted)
    return np.concatenate([consumed.lengths, tokens[~cut]]), tokens[cut]


class HierarchicalController:
    """Chooses (q, m) for the next step from measurements of the last steps."""

    def __init__(self, config: ControllerConfig, n_replicas: int, batch_size: int, perf: PerfModel,
                 per_sample: bool = True, engines: tuple[EngineConfig, EngineConfig] | None = None,
                 planner: SplitPlanner | None = None):
        """``per_sample``: the pools route samples by least in flight (else whole groups round-robin).
        ``engines``: the (tail, bulk) pools' engines, for the prior and the yardstick (None: no limit).
        ``planner``: plans the first probe where ``config.plan_probe`` is set."""
        config.validate(n_replicas, batch_size)
        self.planner = planner if config.plan_probe else None
        self.engines = engines or NO_LIMITS
        self.config = config
        self.per_sample = per_sample
        self.n_replicas = n_replicas
        self.batch_size = batch_size
        self.q_max = max_q(config.max_q_fraction, batch_size)
        self.max_q_step = config.max_q_step or max(1, batch_size // 16)
        q0, m0 = initial_split(config, n_replicas, batch_size)
        self.state = _State(q=q0, m=m0)
        self._table = StepTable.shared(perf, batch_size * 16)
        step = max(1, self.q_max // 32)
        self._q_candidates = np.unique(np.concatenate([np.arange(1, self.q_max + 1, step), [self.q_max]]))
        self._candidates = Candidates(self._q_candidates, batch_size, config.candidate_factor)
        self._longest_group = Candidates(np.array([1]), batch_size, config.candidate_factor)  # the yardstick's
        self._every_q = np.arange(1, self.q_max + 1)  # the inner loop's rate model sizes its step over all q
        self._bulk_quota_at_q = self.batch_size - self._every_q.astype(float)  # bulk groups a step needs at each q

    @property
    def decision(self) -> Decision:
        return Decision(self.state.q, self.state.m, "current", DecisionKind.CURRENT)

    def _smoothed(self) -> _Smoothed:
        return _Smoothed(self.config.smoothing)

    # ------------------------------------------------------------------ public
    def observe(self, obs: StepObservation) -> Decision:
        """Fold one step's measurements in and decide (q, m) for the next step."""
        self._check(obs)
        s, cfg = self.state, self.config
        s.steps += 1
        s.steps_at_split += 1
        consumed = ConsumedBatch(*_work_arrays(obs.tail_groups + obs.bulk_groups))
        s.history = (s.history + [consumed])[-cfg.history_steps:]
        s.survival = (s.survival + [_samples_seen(consumed, obs.aborted_groups)])[-cfg.survival_steps:]
        self._measure_pools(obs)
        if cfg.fixed_tail_replicas is None:
            self._measure_split(obs, consumed)
            if s.steps_at_split >= max(1, cfg.settle_steps):
                moved = self._outer(obs)
                if moved is not None:
                    return moved
        if s.m > 0 and cfg.inner_loop and s.planned is None:
            return self._inner(obs)
        return Decision(s.q, s.m, "hold", DecisionKind.HOLD)

    def state_dict(self) -> dict:
        s = self.state
        smoothed = {key: getattr(s, key).to_json() if getattr(s, key) is not None else None
                    for key in ("tail_s_per_group", "pool_times", "bulk_finish_curve", "prior_bias")}
        if isinstance(smoothed["pool_times"], np.ndarray):
            smoothed["pool_times"] = smoothed["pool_times"].tolist()
        state = {"q": s.q, "m": s.m, "steps": s.steps, "steps_at_split": s.steps_at_split, **smoothed,
                 "splits": {str(m): [r.relative_makespan.value, r.visits, r.fair.n, r.fair.total, r.fair.total_sq]
                            for m, r in s.splits.items()},
                 "history": [[batch.lengths.tolist(), batch.sizes.tolist()] for batch in s.history],
                 "survival": [[finished.tolist(), cut.tolist()] for finished, cut in s.survival],
                 "planned": asdict(s.planned) if s.planned else None}
        return {"config": asdict(self.config), "n_replicas": self.n_replicas, "batch_size": self.batch_size,
                "state": state}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("n_replicas") != self.n_replicas or sd.get("batch_size") != self.batch_size:
            raise ControllerError(f"checkpoint controller ran {sd.get('n_replicas')} replicas × batch "
                                  f"{sd.get('batch_size')}, this run {self.n_replicas} × {self.batch_size}; "
                                  "resume with the same batch size and replica count (the learned state is shaped "
                                  "by both)")
        st, w = sd["state"], self.config.smoothing

        def smoothed(key: str) -> _Smoothed | None:
            value = st.get(key)
            if value is None:
                return None
            if key == "pool_times":
                return _Smoothed(w, np.asarray(value, dtype=float))
            return _Smoothed.from_json(w, value)

        self.state = _State(
            q=int(st["q"]), m=int(st["m"]), steps=int(st["steps"]), steps_at_split=int(st["steps_at_split"]),
            tail_s_per_group=smoothed("tail_s_per_group"), pool_times=smoothed("pool_times"),
            bulk_finish_curve=smoothed("bulk_finish_curve"), prior_bias=smoothed("prior_bias"),
            splits={int(m): _SplitRecord(_Smoothed(w, record[0]), int(record[1]),
                                         _Moments(int(record[2]), *map(float, record[3:5])) if len(record) > 2 else _Moments())
                    for m, record in st["splits"].items()},  # the fair moments: absent before the stock price of a pull
            history=[ConsumedBatch(np.asarray(lengths, dtype=np.int64), np.asarray(sizes, dtype=np.int64))
                     for lengths, sizes in st["history"]],
            survival=[(np.asarray(finished, dtype=np.int64), np.asarray(cut, dtype=np.int64))
                      for finished, cut in st.get("survival", [])],  # absent before the split steps' stock price
            planned=PlannedSplit(**st["planned"]) if st.get("planned") else None)  # absent before the planner

    # ------------------------------------------------------------------ measurements
    def _check(self, obs: StepObservation) -> None:
        n_tail, n_bulk = len(obs.tail_groups), len(obs.bulk_groups)
        if n_tail + n_bulk != self.batch_size:
            raise ControllerError(f"observation holds {n_tail} tail + {n_bulk} bulk groups; a step consumes "
                                  f"exactly batch_size = {self.batch_size}")
        if not 0 <= obs.m < self.n_replicas:
            raise ControllerError(f"observation used m = {obs.m} tail replicas of {self.n_replicas}")
        if any(len(g.tokens) != len(g.cut) for g in obs.aborted_groups):
            raise ControllerError("an aborted group's samples need one cut flag each")

    def _measure_pools(self, obs: StepObservation) -> None:
        """The inner loop's rate model: seconds per tail group and the bulk finish curve."""
        s = self.state
        if obs.tail_groups and obs.m > 0 and obs.tail_makespan_s > 0:
            s.tail_s_per_group = s.tail_s_per_group or self._smoothed()
            s.tail_s_per_group.update(obs.tail_makespan_s / len(obs.tail_groups))
        finish = np.sort(np.fromiter((g.finish_s for g in obs.bulk_groups), dtype=float, count=len(obs.bulk_groups)))
        s.bulk_finish_curve = s.bulk_finish_curve or self._smoothed()
        s.bulk_finish_curve.update(finish)

    def yardstick_s(self, consumed: ConsumedBatch, prompt_len: float) -> float:
        """The perf model's predicted time of one shared pool (stock verl) running ``consumed``."""
        model = FluidModel([consumed], self.batch_size, prompt_len, self._table, self._longest_group,
                            self.per_sample, shared_only=True, engines=self.engines)
        return model.bulk_full(self.n_replicas)

    def stock_price_s(self, obs: StepObservation) -> float:
        """The perf model's time of one shared pool (stock verl) running the prompts the step pulled: the pulled
        groups it consumed as measured and the groups it aborted run to their end, each cut sample's length drawn
        past its abort (:class:`core.tailsieve.censored.LengthSurvival` on the last ``survival_steps`` steps'
        samples), the price averaged over ``price_draws`` draws (seeded by the step: the same measurements give
        the same price). A step that aborted nothing is priced on what it consumed. A group's cut samples share
        one quantile of their draw: a prompt's samples run long together, and independent draws would give a
        step many more chances at one very long sample than its few aborted prompts have (a price above stock
        verl's, flattering the split).

        Why the pull: a split step consumes the groups the last step aborted (its slowest, regenerated) beside its
        own fastest, a batch stock verl never runs, so the consumed batch's price cannot see what the carry moved;
        stock verl would have run the step's pull, every group to its end."""
        if not obs.aborted_groups:
            return self.yardstick_s(ConsumedBatch(*_work_arrays(obs.tail_groups + obs.bulk_groups)), obs.prompt_len)
        pulled, pulled_sizes = _work_arrays(obs.pulled)
        tokens, sizes, cut = _aborted_arrays(obs.aborted_groups)
        seen = self.state.survival or [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))]
        survival = LengthSurvival(np.concatenate([f for f, _ in seen]), np.concatenate([c for _, c in seen]))
        group_of_cut = np.repeat(np.arange(len(sizes)), sizes)[cut]
        rng = np.random.default_rng([self.state.steps, 17])
        all_sizes = np.concatenate([pulled_sizes, sizes])
        prices = []
        for _ in range(self.config.price_draws):
            drawn = tokens.copy()
            quantiles = rng.random(len(sizes))[group_of_cut]  # one per group: its samples' lengths go together
            drawn[cut] = np.maximum(survival.beyond(tokens[cut], quantiles), tokens[cut])
            prices.append(self.yardstick_s(ConsumedBatch(np.concatenate([pulled, drawn]), all_sizes), obs.prompt_len))
        return float(np.mean(prices))

    def measured_splits(self) -> tuple[_SplitRecord, _SplitRecord] | None:
        """(the split it holds, one shared pool) once both have been measured, else None."""
        s = self.state
        held, shared = s.splits.get(s.m), s.splits.get(0)
        if held is None or not held.visits or shared is None or not shared.visits:
            return None
        return held, shared

    @property
    def settled(self) -> bool:
        """The outer loop has measured one shared pool and the split it holds, and resolved its planned probe
        (with a split planner): the yardstick record-planned steps are weighed against (core.tailsieve.cycle)."""
        return self.measured_splits() is not None and (self.planner is None or self.state.planned is not None)

    def relative_makespan(self, obs: StepObservation) -> float | None:
        """A step's makespan over stock verl's price of its pull (:meth:`stock_price_s`; None where either is 0)."""
        price = self.stock_price_s(obs)
        return obs.makespan_s / price if price > 0 and obs.makespan_s > 0 else None

    def _measure_split(self, obs: StepObservation, consumed: ConsumedBatch) -> None:
        """The split just run, measured two ways and kept per m: its makespan over the price of the batch it
        consumed (how well it ran what it ran: little noise, blind to what the carry moved between steps) and over
        stock verl's price of what it pulled (:meth:`stock_price_s`: fair, noisier)."""
        s = self.state
        if (obs.m > 0) != bool(obs.tail_groups) or (obs.m == 0 and obs.n_aborted > 0):
            return  # a transition step (aborts without a tail pool yet): it measures no split
        price = self.yardstick_s(consumed, obs.prompt_len)
        fair_price = self.stock_price_s(obs) if obs.aborted_groups else price
        if price <= 0 or fair_price <= 0 or obs.makespan_s <= 0:
            return
        record = s.splits.setdefault(obs.m, _SplitRecord(self._smoothed()))
        record.add(obs.makespan_s / price, obs.makespan_s / fair_price, self.config.split_window)

    def _bulk_finish_at(self, ranks: np.ndarray) -> np.ndarray:
        """Smoothed time of the k-th bulk finish (k = ranks, 1-based); linear extrapolation past the data."""
        curve = self.state.bulk_finish_curve
        known = np.asarray(curve.value if curve is not None else [], dtype=float)
        seen = np.flatnonzero(~np.isnan(known))
        if len(seen) == 0:
            return np.full(len(ranks), np.nan)
        xs, ys = seen + 1.0, np.maximum.accumulate(known[seen])
        tail = max(2, len(xs) // 10)
        slope = (ys[-1] - ys[-tail]) / max(xs[-1] - xs[-tail], 1.0) if len(xs) >= 2 else ys[-1] / xs[-1]
        out = np.interp(ranks, xs, ys)
        beyond = ranks > xs[-1]
        out[beyond] = ys[-1] + slope * (ranks[beyond] - xs[-1])
        return out

    # ------------------------------------------------------------------ inner loop
    def _inner(self, obs: StepObservation) -> Decision:
        s, cfg = self.state, self.config
        if not obs.tail_groups or obs.m == 0 or s.tail_s_per_group is None:
            return Decision(s.q, s.m, "inner: waiting for a tail-pool measurement", DecisionKind.WAITING)
        s.pool_times = s.pool_times or self._smoothed()
        tail_s, bulk_s = s.pool_times.update(np.array([obs.tail_makespan_s, obs.bulk_cutoff_s]))
        gap = (tail_s - bulk_s) / max(tail_s, bulk_s, 1e-12)
        if abs(gap) <= cfg.balance_tolerance:
            return Decision(s.q, s.m, f"inner: balanced (gap {gap:+.1%})", DecisionKind.BALANCED)
        qs = self._every_q
        predicted = np.maximum(qs * s.tail_s_per_group.value, self._bulk_finish_at(self._bulk_quota_at_q))
        best = int(np.argmin(predicted))
        if math.isnan(predicted[best]):  # argmin stops at a NaN; nanargmin skips them (or raises if all are)
            best = int(np.nanargmin(predicted))
        balancing_q = int(qs[best])
        direction = 1 if gap < 0 else -1  # bulk slower: isolate more
        if (balancing_q - s.q) * direction <= 0:
            balancing_q = s.q + direction  # the measurement decides the direction; the model only the size
        step = min(self.max_q_step, max(1, int(round(cfg.q_gain * abs(balancing_q - s.q)))))
        s.q = _bounded_q(s.q + direction * step, s.m, self.q_max)
        return Decision(s.q, s.m, f"inner: tail {tail_s:.1f}s vs bulk {bulk_s:.1f}s -> q {s.q}", DecisionKind.INNER)

    # ------------------------------------------------------------------ outer loop
    def _prior(self, obs: StepObservation, splits: Sequence[int]) -> tuple[FluidModel, dict[int, tuple[float, int]]]:
        """The perf model's relative makespan (to one shared pool) and its best q, per split."""
        model = FluidModel(self.state.history, self.batch_size, obs.prompt_len, self._table, self._candidates,
                            self.per_sample, engines=self.engines)
        tails = [m for m in splits if m > 0]
        model.prepare(tail_sizes=tails, bulk_sizes=[self.n_replicas - m for m in tails])
        shared = model.bulk_full(self.n_replicas)
        prior = {0: (1.0, 0)}
        if tails:  # [split, q' candidate]: the makespan, infinite where q' < m (an idle tail replica)
            span = np.maximum([model.tail_time(m) for m in tails],
                              [model.bulk_cutoff(self.n_replicas - m) for m in tails])
            span[self._q_candidates < np.minimum(tails, self.q_max)[:, None]] = np.inf
            for m, span_m, i in zip(tails, span, np.argmin(span, axis=1)):
                prior[m] = (float(span_m[i]) / shared, int(self._q_candidates[i]))
        return model, prior

    def _probe_range(self) -> range:
        """The tail-pool sizes the outer loop's first move may probe: 1..R/2, or the one configured."""
        m, R = self.config.probe_tail_replicas, self.n_replicas
        if m is None:
            return range(1, R // 2 + 1)
        return range(m, m + 1) if 0 < m < R else range(0)

    def _estimate(self, m: int, prior_relative: float) -> tuple[float, float]:
        """(estimate, score) of a split's relative makespan: the measured value weighed against the
        bias-corrected prior; the score subtracts the exploration bonus of an under-measured split."""
        s, cfg = self.state, self.config
        bias = s.prior_bias.value if s.prior_bias is not None else 1.0
        modelled = prior_relative * bias
        record = s.splits.get(m)
        if record is None or not record.visits or not cfg.measured_surface:
            visits, estimate = (record.visits if record else 0), modelled
        elif m == 0:  # one shared pool: measured directly against its own prediction, no prior needed
            visits, estimate = record.visits, record.relative_makespan.value
        else:
            visits = record.visits
            estimate = (cfg.prior_weight * modelled + visits * record.relative_makespan.value) / (cfg.prior_weight + visits)
        return estimate, estimate * (1 - cfg.exploration_bonus / math.sqrt(1 + visits))

    def _move(self, q: int, m: int, reason: str) -> Decision:
        """Go to (q, m) (q bounded; 0 at one shared pool); the split's settling and pool times restart."""
        s = self.state
        s.m, s.q = m, (_bounded_q(q, m, self.q_max) if m else 0)
        s.steps_at_split = 0
        s.pool_times = None
        return Decision(s.q, s.m, reason.format(split=(s.q, s.m)), DecisionKind.OUTER)

    def _planned_outer(self, obs: StepObservation) -> Decision | None:
        """The outer loop with a split planner: plan once from the measured shared-pool steps and probe the
        pick where it pays the margin; a planned split leaves only for one shared pool, when one shared pool
        measures better than the split's record weighed against the plan's prediction."""
        s, cfg = self.state, self.config
        if s.planned is None:
            s.planned = plan = self.planner(s.history, obs.prompt_len)
            if plan.m > 0 and plan.relative + cfg.probe_z * plan.spread < 1.0 - cfg.plan_margin:
                return self._move(plan.q, plan.m, f"outer: probe the planned split {{split}} (predicted {plan.relative:.3f} "
                                  "of one shared pool)")
            return None
        here, shared = s.splits.get(s.m), s.splits.get(0)
        if s.m == 0 or here is None or not here.visits or shared is None:
            return None
        shared_value = shared.relative_makespan.value
        w = cfg.plan_weight
        estimate = (w * s.planned.relative * shared_value + here.visits * here.relative_makespan.value) / (w + here.visits)
        if shared_value < estimate:
            return self._move(0, 0, f"outer: {(s.q, s.m)} -> {{split}} (measured {estimate / shared_value:.3f} of one shared pool)")
        if self._fair_loss_resolved(here, shared):
            return self._move(0, 0, f"outer: {(s.q, s.m)} -> {{split}} (priced against stock verl's run of its pulls: "
                                    f"{here.fair.mean / shared.fair.mean:.3f} of one shared pool over {here.fair.n} steps)")
        return None

    def _fair_loss_resolved(self, split: _SplitRecord, shared: _SplitRecord) -> bool:
        """Whether the split's makespans over stock verl's price of its pulls exceed one shared pool's by more than
        ``leave_z`` standard errors (Student's t on the split's steps: a few noisy steps resolve nothing)."""
        if split.fair.n < 2 or not shared.fair.n:
            return False
        error = math.hypot(split.fair.error, shared.fair.error if shared.fair.n > 1 else 0.0)
        quantile = stats.t.ppf(stats.norm.cdf(self.config.leave_z), split.fair.n - 1)
        return split.fair.mean - shared.fair.mean > quantile * error

    def _outer(self, obs: StepObservation) -> Decision | None:
        s, cfg, R = self.state, self.config, self.n_replicas
        if self.planner is not None and (s.planned is not None or set(s.splits) == {0}):
            return self._planned_outer(obs)
        lo, hi = max(0, s.m - cfg.search_radius), min(R - 1, s.m + cfg.search_radius)
        neighbours = sorted(set(range(lo, hi + 1)) | {0})
        probe_range = self._probe_range() if s.m == 0 and set(s.splits) == {0} else range(0)  # only (0, 0) measured
        model, prior = self._prior(obs, sorted(set(neighbours) | set(probe_range)))
        current = s.splits.get(s.m)
        if current is not None and current.visits:
            bias = current.relative_makespan.value / max(prior[s.m][0], 1e-9)
            s.prior_bias = s.prior_bias or self._smoothed()
            s.prior_bias.update(bias)
        # Probe the split the perf model ranks best, only where it beats one shared pool by the margin of any
        # move; else search step by step.
        probe = min(probe_range, key=lambda m: prior[m][0], default=None)
        if probe is not None and prior[probe][0] < 1.0 - cfg.switch_threshold:
            return self._move(prior[probe][1], probe, "outer: probe (q, m) = {split} after measuring one shared pool")
        here, _ = self._estimate(s.m, prior[s.m][0])
        scores = {m: self._estimate(m, prior[m][0])[1] for m in neighbours if m != s.m}
        target = min(scores, key=scores.get, default=None)
        if target is not None and scores[target] >= here * (1 - cfg.switch_threshold):
            # no move pays its margin; a split that no longer beats one shared pool still returns to it
            target = 0 if s.m > 0 and scores[0] < here else None
        if target is None:
            return None
        new_m = target if target == 0 else s.m + min(max(target - s.m, -cfg.max_replica_step), cfg.max_replica_step)
        if cfg.check_feasibility and not self._feasible(new_m, obs.makespan_s, model):
            return None
        if new_m == 0:
            new_q = 0
        elif s.m > 0:  # keep the tail load per replica the inner loop found
            new_q = round(s.q * new_m / s.m)
        else:
            new_q = prior[new_m][1]
        return self._move(new_q, new_m, f"outer: (q, m) {(s.q, s.m)} -> {{split}} (score {scores[target]:.3f} vs {here:.3f})")

    def _feasible(self, m: int, deadline: float, model: "FluidModel") -> bool:
        """The enlarged pool absorbs, by the deadline, at least the groups the reduced pool releases."""
        cur, R = self.state.m, self.n_replicas
        if m == 0 or cur == 0:
            return True  # to/from one shared pool; the score decides
        qc = self._q_candidates

        def tail_groups_by(k: int) -> int:  # tail groups k replicas finish by the deadline
            ok = qc[model.tail_time(k) <= deadline]
            return int(ok.max()) if len(ok) else 0

        def bulk_groups_by(k: int) -> int:  # bulk groups k replicas finish by the deadline
            ok = qc[model.bulk_cutoff(k) <= deadline]  # [i]: the time the (B − qc[i])-th group finishes
            return self.batch_size - int(ok.min()) if len(ok) else 0

        if m > cur:  # a bulk replica moves to the tail pool
            released = bulk_groups_by(R - cur) - bulk_groups_by(R - m)
            absorbed = tail_groups_by(m) - tail_groups_by(cur)
        else:
            released = tail_groups_by(cur) - tail_groups_by(m)
            absorbed = bulk_groups_by(R - m) - bulk_groups_by(R - cur)
        return absorbed >= released
