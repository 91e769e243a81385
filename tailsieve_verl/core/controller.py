"""Hierarchical controller on (q, m): q = groups isolated (aborted and carried each step), m =
replicas of the tail pool. Uniform routing is the boundary (0, 0).

* **Inner loop** (every step, m fixed): move q toward equal tail- and bulk-pool makespans. The tail
  pool's smoothed rate (seconds per regenerated group) predicts its time for q' groups; the bulk
  pool's smoothed finish-time curve (time of its k-th finished group) predicts its cutoff for
  q' (the (B − q')-th finish). The move is damped (``q_gain``) and bounded (``max_q_step``); q
  stays >= m, since round-robin would leave a tail replica with fewer groups idle.
* **Outer loop** (after ``settle_steps`` quiet steps): with the response-work history of the last
  ``history_steps`` consumed batches and the concurrency–throughput model, a fluid model predicts
  each nearby split's best makespan; a replica moves only when the smoothed predicted gain beats
  ``switch_threshold`` and the switch is feasible (the enlarged pool absorbs at least as many groups
  by the current deadline as the reduced pool releases). Model bias is corrected by the ratio of
  measured to predicted pool times at the current split.

The controller sees only what the rollout layer can measure (pool times, finished groups' token
counts and finish times, abort counts) — never future lengths.

How the verl layer calls it, once per step after the selector's ``finish_step``::

    decision = controller.observe(StepObservation(...))   # measured quantities of this step
    plan = selector.plan_step(decision.q)                  # next step: abort q, tail pool = decision.m

``Decision.m`` replicas serve the tail pool next step; when nothing is carried the rollout layer
lends them to the bulk pool (a tail pool with no work is uniform routing). ``state_dict()`` /
``load_state_dict()`` are JSON-serialisable for verl checkpoints.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from .errors import TailSieveError
from .perf import PerfModel


class ControllerError(TailSieveError):
    """An impossible controller setting or an observation that contradicts the configuration."""


@dataclass(frozen=True)
class ControllerConfig:
    """Every knob of the controller; the defaults are the ones the simulations use."""

    q_init: int = 0  # start: groups isolated per step (0 with m_init 0 = uniform routing)
    m_init: int = 0  # start: tail-pool replicas
    fixed_tail_replicas: int | None = None  # pin m (fixed-allocation variant, e.g. 2 for 2:2); None = outer loop on
    max_q_fraction: float = 0.5  # q never exceeds this fraction of the batch
    balance_tolerance: float = 0.05  # pools within this relative gap count as balanced: hold q
    q_gain: float = 0.5  # damping: fraction of the gap to the balancing q moved per step
    max_q_step: int = 0  # bound on |Δq| per step; 0 = max(1, batch_size // 16)
    rate_smoothing: float = 0.5  # weight of the newest measurement in the rate EMAs (1 = no smoothing)
    switch_threshold: float = 0.06  # smoothed predicted relative makespan gain needed to move replicas
    gain_smoothing: float = 0.3  # weight of the newest predicted gain (damping of the outer loop)
    search_radius: int = 2  # the outer loop evaluates splits m ± this (objective need not be unimodal)
    max_replica_step: int = 1  # bound on |Δm| per decision (a move toward a farther best split is clipped)
    settle_steps: int = 2  # quiet steps after any change before the outer loop decides again
    history_steps: int = 1  # consumed batches kept as response-work history
    check_feasibility: bool = True  # outer loop requires deadline feasibility of a switch
    inner_loop: bool = True  # ablation switch: False freezes q (except when m moves)
    candidate_factor: float = 2.0  # bulk groups aborted (tail candidates) per isolated group; see core.selector

    def validate(self, n_replicas: int, batch_size: int) -> None:
        if n_replicas < 1 or batch_size < 2:
            raise ControllerError(f"need n_replicas >= 1 and batch_size >= 2, got {n_replicas}, {batch_size}")
        q_max = max_q(self, batch_size)
        m = self.m_init if self.fixed_tail_replicas is None else self.fixed_tail_replicas
        if not 0 <= m < n_replicas:
            raise ControllerError(f"tail replicas must be in 0..{n_replicas - 1} (the bulk pool needs one), got {m}")
        if self.fixed_tail_replicas is not None and self.fixed_tail_replicas < 1:
            raise ControllerError("fixed_tail_replicas must be >= 1 (0 is uniform routing: use the uniform policy)")
        if not 0 <= self.q_init <= q_max:
            raise ControllerError(f"q_init must be in 0..{q_max} (max_q_fraction · batch_size), got {self.q_init}")
        for name in ("q_gain", "rate_smoothing", "gain_smoothing"):
            if not 0 < getattr(self, name) <= 1:
                raise ControllerError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not self.candidate_factor >= 1:
            raise ControllerError(f"candidate_factor must be >= 1, got {self.candidate_factor}")
        if not 0 < self.max_q_fraction < 1 or self.balance_tolerance < 0 or self.switch_threshold < 0:
            raise ControllerError("max_q_fraction must be in (0, 1); balance_tolerance and switch_threshold >= 0")
        if (self.max_replica_step < 1 or self.search_radius < self.max_replica_step or self.settle_steps < 0
                or self.history_steps < 1 or self.max_q_step < 0):
            raise ControllerError("need max_replica_step >= 1, search_radius >= max_replica_step, settle_steps >= 0, "
                                  "history_steps >= 1, max_q_step >= 0")


def max_q(config: ControllerConfig, batch_size: int) -> int:
    return max(1, min(batch_size - 1, int(config.max_q_fraction * batch_size)))


@dataclass(frozen=True)
class GroupRecord:
    """A group as the rollout layer measures it once it has finished."""

    lengths: tuple[int, ...]  # response tokens of its n samples
    finish_s: float  # seconds from the pool's start until its last sample finished


@dataclass(frozen=True)
class StepObservation:
    """Measurable outcome of one step."""

    q: int  # groups aborted at the cutoff (carried to the next step)
    m: int  # tail-pool replicas actually used (0 when the tail groups ran in the shared pool)
    tail_makespan_s: float  # when the last regenerated tail group finished (0 without tail groups)
    bulk_cutoff_s: float  # when the bulk pool reached its quota (the abort moment)
    tail_groups: tuple[GroupRecord, ...]  # regenerated carried groups
    bulk_groups: tuple[GroupRecord, ...]  # bulk groups finished before the cutoff
    n_aborted: int = 0
    prompt_len: float = 0.0  # mean prompt tokens (context of the decode steps)

    @property
    def makespan_s(self) -> float:
        return max(self.tail_makespan_s, self.bulk_cutoff_s)


@dataclass(frozen=True)
class Decision:
    q: int  # groups to abort and carry in the next step
    m: int  # tail-pool replicas for the next step
    reason: str  # what moved (or why nothing did), for logs

    @property
    def split(self) -> tuple[int, int]:
        return self.q, self.m


class _StepTable:
    """The perf model tabulated on (active, context) so that a decision never calls it."""

    CONTEXTS = np.concatenate([[0.0], np.geomspace(64, 262144, 40)])

    def __init__(self, perf: PerfModel, max_active: int):
        self.perf = perf
        self._build(max(64, max_active))

    def _build(self, max_active: int) -> None:
        active = np.arange(max_active + 2, dtype=float)
        a, c = np.meshgrid(active, self.CONTEXTS, indexing="ij")
        self.table = np.asarray(self.perf.step_time(a.ravel(), c.ravel()), dtype=float).reshape(a.shape)
        self.max_active = max_active

    def context_index(self, context: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(self.CONTEXTS, context, side="right") - 1, 0, len(self.CONTEXTS) - 1)

    def flat(self, max_active: float) -> np.ndarray:
        """The table raveled row-major (row = integer active, column = context level), covering
        ``max_active``: a fluid model gathers from it by ``active · len(CONTEXTS) + context``."""
        if max_active + 1 > self.max_active:
            self._build(int(2 ** math.ceil(math.log2(max_active + 2))))
        return self.table.ravel()


_UNIT_GRID = np.linspace(0.0, 1.0, 16)  # the fluid model's step grid, scaled per history


class _FluidModel:
    """Predicted pool times for a response-work population (the last ``H`` consumed batches).

    Responses of a pool start together and are spread evenly over its replicas; between grid points
    the number of active responses is taken as constant, so a pool's clock is a sum of segment
    lengths times the tabulated step time at the per-replica concurrency. A group finishes at its
    longest sample; the tail pool holds the q' groups with the longest samples; the bulk pool holds
    B − q' + candidate_factor · q' groups (the history's load scaled) and is cut when B − q' finish.
    """

    def __init__(self, history: Sequence[tuple[np.ndarray, np.ndarray]], batch_size: int, prompt_len: float,
                 table: _StepTable, q_candidates: np.ndarray, candidate_factor: float, per_sample: bool):
        self.h = len(history)
        self.per_sample = per_sample
        self.batch_size = batch_size
        self.q_candidates = q_candidates
        lengths = np.concatenate([lengths for lengths, _ in history]).astype(float)
        sizes = np.concatenate([sizes for _, sizes in history])
        if sizes.min() == sizes.max():  # the usual case: every group has n samples
            gmax = lengths.reshape(len(sizes), -1).max(axis=1)
        else:
            gmax = np.maximum.reduceat(lengths, np.concatenate([[0], np.cumsum(sizes)[:-1]]))
        s_max = float(lengths.max())
        grid = np.unique(np.concatenate([s_max * _UNIT_GRID, 16.0 * (max(s_max, 17.0) / 16.0) ** _UNIT_GRID]))
        self.grid = grid[grid <= s_max] if s_max > 0 else np.array([0.0, 1.0])
        self.mid = 0.5 * (self.grid[:-1] + self.grid[1:])
        self.seg = np.diff(self.grid)
        self._table = table.flat(len(lengths) / self.h)
        self._ctx = table.context_index(self.mid + prompt_len)
        self._memo: dict[tuple[str, int], np.ndarray | float] = {}
        n_seg = len(self.mid)
        # segment index from which a response is no longer active: it is active on segments with mid < length
        seg_end = np.searchsorted(self.mid, lengths, side="left")
        ends = np.bincount(seg_end, minlength=n_seg + 1)
        self.bulk_active = np.cumsum(ends[::-1])[::-1][1:] / self.h  # responses with length > mid_i
        order = np.argsort(-gmax, kind="stable")  # longest group first
        # the bulk pool runs B − q' + a' groups (a' = candidate_factor · q' aborted): a load B'/B times
        # the history's, cut when B − q' of them have finished (that quantile of the history's groups)
        held = batch_size + (candidate_factor - 1.0) * q_candidates
        self.bulk_scale = held / batch_size
        ranks = np.clip((len(gmax) * (batch_size - q_candidates) / held).astype(np.int64) - 1, 0, len(gmax) - 1)
        self.cut_step = gmax[order[::-1][ranks]]  # step at which the (B − q')-th bulk group finishes
        # Tail: the q' groups with the longest samples; responses counted per (candidate, segment).
        rows = q_candidates * self.h
        rank_of_group = np.empty(len(gmax), dtype=np.int64)
        rank_of_group[order] = np.arange(len(gmax))
        group_row = np.repeat(np.searchsorted(rows, rank_of_group, side="right"), sizes)  # first candidate holding it
        keep = group_row < len(rows)
        flat = group_row[keep] * (n_seg + 1) + seg_end[keep]
        counts = np.bincount(flat, minlength=(len(rows) + 1) * (n_seg + 1)).reshape(len(rows) + 1, n_seg + 1)
        counts = np.cumsum(counts, axis=0)[: len(rows)]
        self.tail_active = np.cumsum(counts[:, ::-1], axis=1)[:, ::-1][:, 1:] / self.h

    def _step_time(self, active: np.ndarray) -> np.ndarray:
        """Seconds per decode step on each segment (last axis) at fractional ``active`` per replica,
        linear between integers; 0 where nothing runs."""
        busy = np.maximum(active, 1.0)  # a busy replica runs >= 1 request
        lo = busy.astype(np.int64)
        at = lo * len(_StepTable.CONTEXTS) + self._ctx
        below = self._table[at]
        return np.where(active > 0, below + (busy - lo) * (self._table[at + len(_StepTable.CONTEXTS)] - below), 0.0)

    def _clock(self, active: np.ndarray, replicas) -> np.ndarray:
        """Clock at each grid point; ``replicas`` may be a column of several pool sizes."""
        clock = np.cumsum(self.seg * self._step_time(active / replicas), axis=-1)
        return np.concatenate([np.zeros(clock.shape[:-1] + (1,)), clock], axis=-1)

    def _critical(self, n_groups: np.ndarray, replicas: int, active: np.ndarray) -> np.ndarray:
        """Active responses on the replica that holds the longest group. Per-sample routing spreads
        every group, so that is the pool's share; group round-robin puts that group plus
        ``ceil(groups / replicas) − 1`` average others there. ``active`` rows hold all ``n_groups`` groups."""
        if self.per_sample:
            return active / replicas
        top = self.tail_active[0]  # the longest group of a step (q' = 1 row, averaged over the history)
        others = np.maximum(active - top, 0.0) / np.maximum(n_groups - 1, 1)[:, None]
        return top + (np.ceil(n_groups[:, None] / replicas) - 1) * others

    def prepare(self, tail_sizes: Sequence[int] = (), bulk_sizes: Sequence[int] = ()) -> None:
        """Evaluate tail and bulk predictions for several pool sizes in one vectorised pass each."""
        tails = np.array([k for k in tail_sizes if ("tail", k) not in self._memo], dtype=float)
        if len(tails):
            crit = self._critical(self.q_candidates, tails[:, None, None], self.tail_active[None])
            times = (self._step_time(crit) * self.seg).sum(axis=-1)
            for i, k in enumerate(tails.astype(int)):
                self._memo[("tail", k)] = times[i]
        bulks = np.array([k for k in bulk_sizes if ("cut", k) not in self._memo], dtype=float)
        if len(bulks):
            # one clock per q' candidate (its own bulk load), read at that candidate's cut step
            j = np.clip(np.searchsorted(self.grid, self.cut_step, side="right"), 1, len(self.grid) - 1)
            frac = np.clip((self.cut_step - self.grid[j - 1]) / (self.grid[j] - self.grid[j - 1]), 0.0, 1.0)
            rows = np.arange(len(self.cut_step))
            loads = self.bulk_active[None, None, :] * self.bulk_scale[None, :, None]
            clocks = self._clock(loads, bulks[:, None, None])
            lo, hi = clocks[:, rows, j - 1], clocks[:, rows, j]
            for i, k in enumerate(bulks.astype(int)):
                self._memo[("cut", k)] = lo[i] + frac * (hi[i] - lo[i])

    def bulk_cutoff(self, replicas: int) -> np.ndarray:
        """Predicted bulk cutoff per q candidate on ``replicas`` replicas (all fresh groups spread evenly)."""
        self.prepare(bulk_sizes=[replicas])
        return self._memo[("cut", replicas)]

    def bulk_full(self, replicas: int) -> float:
        """Predicted end of one shared pool running the whole batch (uniform routing)."""
        key = ("full", replicas)
        if key not in self._memo:
            crit = self._critical(np.array([self.batch_size]), replicas, self.bulk_active[None, :])[0]
            self._memo[key] = float(self._clock(crit, 1.0)[-1])
        return self._memo[key]

    def tail_time(self, replicas: int) -> np.ndarray:
        """Predicted tail-pool time per q candidate on ``replicas`` replicas."""
        self.prepare(tail_sizes=[replicas])
        return self._memo[("tail", replicas)]


@dataclass
class _Smoothed:
    """Exponential moving average that starts at its first sample."""

    weight: float
    value: float | None = None

    def update(self, x: float) -> float:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x
        return self.value


@dataclass
class _State:
    q: int
    m: int
    quiet_steps: int = 0
    steps: int = 0
    sec_per_tail_group: float | None = None
    pool_times: list = field(default_factory=list)  # smoothed [tail, bulk] seconds at the current split
    # smoothed time of the k-th bulk finish (NaN = unseen)
    bulk_curve: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tail_bias: dict = field(default_factory=dict)  # split m -> measured / predicted tail-pool time
    cutoff_bias: dict = field(default_factory=dict)  # split m -> measured / predicted bulk cutoff
    full_bias: float | None = None  # measured / predicted end of a shared pool (uniform routing)
    gains: dict = field(default_factory=dict)  # candidate m -> smoothed predicted gain
    history: list = field(default_factory=list)  # last consumed batches: (flat lengths, group sizes)


def _mean(biases: dict, default: float) -> float:
    return sum(biases.values()) / len(biases) if biases else default


def _work_arrays(groups: Sequence[GroupRecord]) -> tuple[np.ndarray, np.ndarray]:
    seqs = [g.lengths for g in groups]
    sizes = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    lengths = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(sizes.sum()))
    return lengths, sizes


class HierarchicalController:
    """Chooses (q, m) for the next step from measurements of the last steps."""

    def __init__(self, config: ControllerConfig, n_replicas: int, batch_size: int, perf: PerfModel,
                 per_sample: bool = True):
        """``per_sample``: the pools route samples by least in flight (else whole groups round-robin)."""
        config.validate(n_replicas, batch_size)
        self.config = config
        self.per_sample = per_sample
        self.n_replicas = n_replicas
        self.batch_size = batch_size
        self.q_max = max_q(config, batch_size)
        self.max_q_step = config.max_q_step or max(1, batch_size // 16)
        m0 = config.m_init if config.fixed_tail_replicas is None else config.fixed_tail_replicas
        q0 = max(1, config.q_init) if m0 > 0 else 0  # a tail pool needs carried groups to measure
        self.state = _State(q=q0, m=m0)
        self._table = _StepTable(perf, batch_size * 16)
        step = max(1, self.q_max // 32)
        self._q_candidates = np.unique(np.concatenate([np.arange(1, self.q_max + 1, step), [self.q_max]]))

    @property
    def decision(self) -> Decision:
        return Decision(self.state.q, self.state.m, "current")

    # ------------------------------------------------------------------ public
    def observe(self, obs: StepObservation) -> Decision:
        """Fold one step's measurements in and decide (q, m) for the next step."""
        self._check(obs)
        s, cfg = self.state, self.config
        s.steps += 1
        s.quiet_steps += 1
        s.history = (s.history + [_work_arrays(obs.tail_groups + obs.bulk_groups)])[-cfg.history_steps:]
        self._update_rates(obs)
        if cfg.fixed_tail_replicas is None and s.quiet_steps > cfg.settle_steps:
            moved = self._outer(obs)
            if moved is not None:
                return moved
        if s.m > 0 and cfg.inner_loop:
            return self._inner(obs)
        return Decision(s.q, s.m, "hold")

    def state_dict(self) -> dict:
        state = asdict(self.state)
        for key in ("gains", "tail_bias", "cutoff_bias"):
            state[key] = {str(k): float(v) for k, v in state[key].items() if v is not None}
        state["history"] = [[lengths.tolist(), sizes.tolist()] for lengths, sizes in self.state.history]
        state["bulk_curve"] = [None if np.isnan(t) else float(t) for t in self.state.bulk_curve]
        return {"config": asdict(self.config), "n_replicas": self.n_replicas, "batch_size": self.batch_size,
                "state": state}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("n_replicas") != self.n_replicas or sd.get("batch_size") != self.batch_size:
            raise ControllerError(f"checkpoint controller ran {sd.get('n_replicas')} replicas × batch "
                                  f"{sd.get('batch_size')}, this run {self.n_replicas} × {self.batch_size}; "
                                  "resume with the same rollout size or start the controller fresh")
        state = dict(sd["state"])
        for key in ("gains", "tail_bias", "cutoff_bias"):
            state[key] = {int(k): float(v) for k, v in state[key].items()}
        state["history"] = [(np.asarray(lengths, dtype=np.int64), np.asarray(sizes, dtype=np.int64))
                            for lengths, sizes in state["history"]]
        state["bulk_curve"] = np.array([np.nan if t is None else t for t in state["bulk_curve"]], dtype=float)
        self.state = _State(**state)

    # ------------------------------------------------------------------ measurements
    def _check(self, obs: StepObservation) -> None:
        n_tail, n_bulk = len(obs.tail_groups), len(obs.bulk_groups)
        if n_tail + n_bulk != self.batch_size:
            raise ControllerError(f"observation holds {n_tail} tail + {n_bulk} bulk groups; a step consumes "
                                  f"exactly batch_size = {self.batch_size}")
        if not 0 <= obs.m < self.n_replicas:
            raise ControllerError(f"observation used m = {obs.m} tail replicas of {self.n_replicas}")

    def _update_rates(self, obs: StepObservation) -> None:
        s, w = self.state, self.config.rate_smoothing
        if obs.tail_groups and obs.m > 0 and obs.tail_makespan_s > 0:
            rate = obs.tail_makespan_s / len(obs.tail_groups)
            s.sec_per_tail_group = rate if s.sec_per_tail_group is None else (1 - w) * s.sec_per_tail_group + w * rate
        finish = np.sort(np.fromiter((g.finish_s for g in obs.bulk_groups), dtype=float, count=len(obs.bulk_groups)))
        curve = np.asarray(s.bulk_curve, dtype=float) if len(s.bulk_curve) else np.full(self.batch_size, np.nan)
        head = curve[: len(finish)]
        curve[: len(finish)] = np.where(np.isnan(head), finish, (1 - w) * head + w * finish)
        s.bulk_curve = curve

    def _bulk_curve_at(self, ranks: np.ndarray) -> np.ndarray:
        """Smoothed time of the k-th bulk finish (k = ranks, 1-based); linear extrapolation past the data."""
        known = np.asarray(self.state.bulk_curve, dtype=float)
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
        if not obs.tail_groups or obs.m == 0 or s.sec_per_tail_group is None:
            return Decision(s.q, s.m, "inner: waiting for a tail-pool measurement")
        w = cfg.rate_smoothing
        measured = [obs.tail_makespan_s, obs.bulk_cutoff_s]
        s.pool_times = measured if not s.pool_times else [(1 - w) * a + w * b for a, b in zip(s.pool_times, measured)]
        tail, bulk = s.pool_times
        gap = (tail - bulk) / max(tail, bulk, 1e-12)
        if abs(gap) <= cfg.balance_tolerance:
            return Decision(s.q, s.m, f"inner: balanced (gap {gap:+.1%})")
        qs = np.arange(1, self.q_max + 1)
        predicted = np.maximum(qs * s.sec_per_tail_group, self._bulk_curve_at(self.batch_size - qs.astype(float)))
        q_star = int(qs[int(np.nanargmin(predicted))])
        direction = 1 if gap < 0 else -1  # bulk slower: isolate more
        if (q_star - s.q) * direction <= 0:
            q_star = s.q + direction  # the measurement decides the direction; the model only the size
        step = min(self.max_q_step, max(1, int(round(cfg.q_gain * abs(q_star - s.q)))))
        new_q = int(np.clip(s.q + direction * step, min(s.m, self.q_max), self.q_max))  # no idle tail replica
        if new_q != s.q:
            s.q = new_q
        return Decision(s.q, s.m, f"inner: tail {tail:.1f}s vs bulk {bulk:.1f}s -> q {s.q}")

    # ------------------------------------------------------------------ outer loop
    def _outer(self, obs: StepObservation) -> Decision | None:
        s, cfg, R = self.state, self.config, self.n_replicas
        model = _FluidModel(s.history, self.batch_size, obs.prompt_len, self._table, self._q_candidates,
                            cfg.candidate_factor, self.per_sample)
        qc = self._q_candidates
        lo, hi = max(0, s.m - cfg.search_radius), min(R - 1, s.m + cfg.search_radius)
        splits = sorted(set(range(max(1, lo), hi + 1)) | ({obs.m} - {0}))
        model.prepare(tail_sizes=splits, bulk_sizes=[R - m for m in splits])
        full_bias = self._model_bias(obs, model)
        tail_default, cutoff_default = _mean(s.tail_bias, 1.0), _mean(s.cutoff_bias, full_bias)
        best: dict[int, tuple[float, int]] = {}
        tails: dict[int, np.ndarray] = {}
        bulks: dict[int, np.ndarray] = {}
        for m in range(lo, hi + 1):
            if m == 0:
                best[m] = (model.bulk_full(R) * full_bias, 0)
                continue
            tails[m] = model.tail_time(m) * s.tail_bias.get(m, tail_default)
            bulks[m] = model.bulk_cutoff(R - m) * s.cutoff_bias.get(m, cutoff_default)
            # at least one group per tail replica
            span = np.where(qc >= min(m, self.q_max), np.maximum(tails[m], bulks[m]), np.inf)
            i = int(np.argmin(span))
            best[m] = (float(span[i]), int(qc[i]))
        current = best[s.m][0]
        for m, (span, _) in best.items():
            if m != s.m:
                gain = (current - span) / current if current > 0 else 0.0
                old = s.gains.get(m)
                s.gains[m] = gain if old is None else (1 - cfg.gain_smoothing) * old + cfg.gain_smoothing * gain
        target = max((m for m in best if m != s.m), key=lambda m: s.gains[m], default=None)
        if target is None or s.gains[target] <= cfg.switch_threshold:
            return None
        step = int(np.clip(target - s.m, -cfg.max_replica_step, cfg.max_replica_step))
        new_m = s.m + step
        if cfg.check_feasibility and not self._feasible(new_m, obs.makespan_s, model, tails, bulks):
            return None
        gain = s.gains[target]
        s.m, s.q = new_m, best[new_m][1] if new_m > 0 else 0
        s.quiet_steps = 0
        s.pool_times = []
        s.gains = {}
        return Decision(s.q, s.m, f"outer: m -> {s.m}, q -> {s.q} (best split {target}, predicted gain {gain:.1%})")

    def _model_bias(self, obs: StepObservation, model: _FluidModel) -> float:
        """Learn measured / predicted pool times of the split just run (smoothed, per split).

        A split never run borrows the mean bias of the splits measured so far (the bulk cutoff, before
        any, the shared pool's); its first run measures its own."""
        s, w, R = self.state, self.config.rate_smoothing, self.n_replicas
        qc = self._q_candidates

        def smooth(old: float | None, measured: float, predicted: float) -> float | None:
            if measured <= 0 or predicted <= 0:
                return old
            ratio = measured / predicted
            return ratio if old is None else (1 - w) * old + w * ratio

        if obs.m > 0 and obs.tail_groups:
            i_tail = int(np.clip(np.searchsorted(qc, len(obs.tail_groups)), 0, len(qc) - 1))
            s.tail_bias[obs.m] = smooth(s.tail_bias.get(obs.m), obs.tail_makespan_s,
                                        float(model.tail_time(obs.m)[i_tail]))
            isolated = self.batch_size - len(obs.bulk_groups)  # the cutoff was the (B − isolated)-th finish
            i_cut = int(np.clip(np.searchsorted(qc, isolated), 0, len(qc) - 1))
            s.cutoff_bias[obs.m] = smooth(s.cutoff_bias.get(obs.m), obs.bulk_cutoff_s,
                                          float(model.bulk_cutoff(R - obs.m)[i_cut]))
        elif obs.q == 0 and not obs.tail_groups:
            s.full_bias = smooth(s.full_bias, obs.bulk_cutoff_s, model.bulk_full(R))
        return s.full_bias or 1.0

    def _feasible(self, m: int, deadline: float, model: _FluidModel, tails: dict, bulks: dict) -> bool:
        """The enlarged pool absorbs, by the deadline, at least the groups the reduced pool releases."""
        cur, R = self.state.m, self.n_replicas
        if m == 0 or cur == 0:
            return True  # to/from uniform routing there is one pool; the gain test decides
        qc = self._q_candidates

        def tail_groups_by(k: int) -> int:  # tail groups k replicas finish by the deadline
            t = tails[k] if k in tails else model.tail_time(k)
            ok = qc[t <= deadline]
            return int(ok.max()) if len(ok) else 0

        def bulk_groups_by(k: int) -> int:  # bulk groups k replicas finish by the deadline
            b = bulks[R - k] if (R - k) in bulks else model.bulk_cutoff(k)
            ok = qc[b <= deadline]  # b[i] is the time the (B - qc[i])-th group finishes
            return self.batch_size - int(ok.min()) if len(ok) else 0

        if m > cur:  # a bulk replica moves to the tail pool
            released = bulk_groups_by(R - cur) - bulk_groups_by(R - m)
            absorbed = tail_groups_by(m) - tail_groups_by(cur)
        else:
            released = tail_groups_by(cur) - tail_groups_by(m)
            absorbed = bulk_groups_by(R - m) - bulk_groups_by(R - cur)
        return absorbed >= released
