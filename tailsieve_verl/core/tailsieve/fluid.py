"""The controller's fluid model of a pool: what a (q, m) split would take on recent consumed batches,
priced from the perf model tabulated once (:class:`StepTable`). It is the outer loop's prior over
every candidate split and its yardstick at every step, so it must be cheap: ~0.05 ms against ~10 ms
for the replica model (:mod:`core.engine.replica`, which walks vLLM's scheduler request by request)
per stock-verl step at 256 x 16 on 8 replicas. It models each pool's ``max_num_seqs`` (the pools'
:class:`EngineConfig`), not FIFO order, KV blocks, prefill or speculation (docs/design.md)."""

from __future__ import annotations

import math
from functools import cached_property, lru_cache
from typing import NamedTuple, Sequence

import numpy as np

from ..engine.engine import EngineConfig
from ..engine.perf import PerfModel
from ..engine.step_table import StepTimeGrid


_SHARED: dict[int, tuple] = {}  # id(perf) -> (perf, its StepTable)


class StepTable:
    """The perf model tabulated on (active, context) so that a decision never calls it."""

    CONTEXTS = np.concatenate([[0.0], np.geomspace(64, 262144, 40)])

    def __init__(self, perf: PerfModel, max_active: int):
        self.perf = perf
        self._build(max(64, max_active))

    def _build(self, max_active: int) -> None:
        self.table = StepTimeGrid(self.perf, np.arange(max_active + 2), self.CONTEXTS).values
        self.rise = np.diff(self.table, axis=0)  # [a, c]: step time at a + 1 active minus at a
        self.max_active = max_active

    @classmethod
    def shared(cls, perf: PerfModel, max_active: int) -> "StepTable":
        """One table per perf model, grown as needed: a row's values do not depend on the table's size,
        so the controllers of a run (best-static's grid: one per split) share it instead of each
        tabulating the model."""
        held = _SHARED.get(id(perf))
        if held is None or held[0] is not perf:
            if len(_SHARED) >= 8:
                _SHARED.pop(next(iter(_SHARED)))
            held = _SHARED[id(perf)] = (perf, cls(perf, max_active))  # holds perf: its id is not reused
        held[1].flat(max_active)
        return held[1]

    @classmethod
    def context_index(cls, context: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(cls.CONTEXTS, context, side="right") - 1, 0, len(cls.CONTEXTS) - 1)

    def flat(self, max_active: float) -> tuple[np.ndarray, np.ndarray]:
        """The table and its rise raveled row-major (row = integer active, column = context level),
        covering ``max_active``: a fluid model gathers from them by ``active · len(CONTEXTS) + context``."""
        if max_active + 1 > self.max_active:
            self._build(int(2 ** math.ceil(math.log2(max_active + 2))))
        return self.table.ravel(), self.rise.ravel()


_UNIT_GRID = np.linspace(0.0, 1.0, 16)  # the fluid model's step grid, scaled per history
NO_LIMITS = (EngineConfig(), EngineConfig())  # (tail, bulk) pools' engines when none is given


class _Segments(NamedTuple):
    """The fluid model's step grid for responses of up to ``s_max`` tokens."""

    grid: np.ndarray  # points, 0 .. s_max
    mid: np.ndarray  # segment midpoints: a response is active on the segments with mid < its length
    seg: np.ndarray  # segment lengths
    seg_end_of: np.ndarray  # [l]: segments with mid < l, i.e. the first segment a response of l tokens is not active on


@lru_cache(maxsize=8)
def _segments(s_max: float) -> _Segments:
    """Cached (read-only): the yardstick and the prior of a step, and consecutive steps, mostly share
    the longest response (the length cap)."""
    grid = np.unique(np.concatenate([s_max * _UNIT_GRID, 16.0 * (max(s_max, 17.0) / 16.0) ** _UNIT_GRID]))
    grid = grid[grid <= s_max] if s_max > 0 else np.array([0.0, 1.0])
    mid = 0.5 * (grid[:-1] + grid[1:])
    whole_mid = np.floor(mid).astype(np.int64)  # lengths are integers: length > mid exactly when length > floor(mid)
    seg_end_of = np.cumsum(np.bincount(whole_mid + 1, minlength=int(s_max) + 1))
    segments = _Segments(grid, mid, np.diff(grid), seg_end_of)
    for array in segments:
        array.flags.writeable = False
    return segments


@lru_cache(maxsize=8)
def _context_columns(s_max: float, prompt_len: float) -> np.ndarray:
    """Each segment's context column in the step table (cached and read-only, as the grid; the prompt
    length, unlike the grid, changes every step)."""
    ctx = StepTable.context_index(_segments(s_max).mid + prompt_len)
    ctx.flags.writeable = False
    return ctx


class ConsumedBatch:
    """One consumed batch's response lengths (integer tokens) and the summaries the fluid model
    reads, each computed once (per step grid): a batch serves the yardstick of its step and the prior
    of the next ``history_steps`` steps, mostly on one grid (the length cap's), and a fixed-split
    controller (no outer loop) needs none of them."""

    def __init__(self, lengths: np.ndarray, sizes: np.ndarray):
        self.lengths = lengths  # flat, group after group
        self.sizes = sizes  # samples per group
        self._segment_ends_on: dict[float, np.ndarray] = {}  # per grid (s_max), see segment_ends_on
        self._active_on: dict[float, np.ndarray] = {}  # per grid (s_max), see active_on

    @cached_property
    def longest(self) -> int:
        return int(self.lengths.max())

    def segment_ends_on(self, s_max: float) -> np.ndarray:
        """(group × sample): the first segment of the step grid for ``s_max`` (>= the batch's longest
        response) that each response is not active on; 0 for padding (read-only)."""
        if s_max not in self._segment_ends_on:
            ends = _segments(s_max).seg_end_of[self.by_group]
            ends.flags.writeable = False
            self._segment_ends_on[s_max] = ends
        return self._segment_ends_on[s_max]

    def active_on(self, s_max: float) -> np.ndarray:
        """Responses active on each segment of the step grid for ``s_max``: those whose segment end lies
        past it (read-only)."""
        if s_max not in self._active_on:
            ends = self.segment_ends_on(s_max)
            n_seg = len(_segments(s_max).mid)
            active = ends.size - np.cumsum(np.bincount(ends.ravel(), minlength=n_seg + 1))[:n_seg]
            active.flags.writeable = False
            self._active_on[s_max] = active
        return self._active_on[s_max]

    @cached_property
    def by_group(self) -> np.ndarray:
        """The lengths as a (group × sample) table; groups with fewer samples than the widest are padded
        with zero-length samples, which are active on no segment."""
        if self.sizes.min() == self.sizes.max():  # the usual case: every group has n samples
            return self.lengths.reshape(len(self.sizes), -1)
        table = np.zeros((len(self.sizes), self.sizes.max()), dtype=self.lengths.dtype)
        table[np.arange(self.sizes.max()) < self.sizes[:, None]] = self.lengths
        return table

    @cached_property
    def group_max(self) -> np.ndarray:
        """Each group's longest sample: when the group finishes."""
        return self.by_group.max(axis=1)


class Candidates:
    """The q' a fluid model evaluates and what they fix for a batch size and a history length — the
    same every decision, so computed once per controller rather than per model."""

    def __init__(self, q: np.ndarray, batch_size: int, candidate_factor: float):
        self.q = q
        self.batch_size = batch_size
        # the bulk pool runs B − q' + a' groups (a' = candidate_factor · q' aborted): a load B'/B times
        # the history's, cut when B − q' of them have finished (that quantile of the history's groups)
        self.held = batch_size + (candidate_factor - 1.0) * q
        self.bulk_scale = self.held / batch_size
        self._ranks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def ranks(self, h: int, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
        """For ``n_groups`` groups of ``h`` batches, longest first: per candidate, the rank of the group
        whose finish cuts the bulk pool; per rank, the first candidate isolating that group (len(q): none)."""
        if (h, n_groups) not in self._ranks:
            cut = (n_groups * (self.batch_size - self.q) / self.held).astype(np.int64) - 1
            cut = np.minimum(np.maximum(cut, 0), n_groups - 1)
            first = np.searchsorted(self.q * h, np.arange(n_groups), side="right")
            self._ranks[h, n_groups] = cut, first
        return self._ranks[h, n_groups]


class FluidModel:
    """Predicted pool times for a response-work population (the last ``H`` consumed batches).

    Responses of a pool start together and are spread evenly over its replicas; between grid points
    the number of active responses is taken as constant, so a pool's clock is a sum of segment
    lengths times the tabulated step time at the per-replica concurrency. A group finishes at its
    longest sample; the tail pool holds the q' groups with the longest samples; the bulk pool holds
    B − q' + candidate_factor · q' groups (the history's load scaled) and is cut when B − q' finish.

    It is the fluid limit of the replica evaluator (:mod:`core.engine.replica`), kept beside it for speed: a
    decision evaluates every q' candidate on every pool size in one vectorised pass (~0.3 ms at
    256 × 16 on 8 replicas), where the evaluator takes 20–70 ms for one split of one batch. Of each
    pool's :class:`core.engine.engine.EngineConfig` it models the concurrency limit (``max_num_seqs``): a replica
    with ``a`` responses active and cap ``c < a`` runs ``c`` at a time, so a segment takes ``a / c``
    times as many steps at concurrency ``c`` (processor sharing; FIFO order, KV blocks, preemption,
    prefill and speculation are the evaluator's alone).
    """

    def __init__(self, history: Sequence[ConsumedBatch], batch_size: int, prompt_len: float,
                 table: StepTable, candidates: Candidates, per_sample: bool, shared_only: bool = False,
                 engines: tuple[EngineConfig, EngineConfig] | None = None):
        """``shared_only``: only :meth:`bulk_full` will be asked (the yardstick): skip the split tables;
        ``candidates`` then need only hold q' = 1 (the longest group: all group routing needs).
        ``engines``: the (tail, bulk) pools' engines (None: no limit); one shared pool runs the bulk's."""
        self.h = len(history)
        self.tail_cap, self.bulk_cap = (float(e.max_num_seqs or math.inf) for e in (engines or NO_LIMITS))
        self.per_sample = per_sample
        self.batch_size = batch_size
        self.q_candidates = candidates.q
        s_max = float(max(batch.longest for batch in history))
        segments = _segments(s_max)
        self.grid, self.mid, self.seg = segments.grid, segments.mid, segments.seg
        self._ctx = _context_columns(s_max, prompt_len)
        self._table, self._rise = table.flat(sum(len(batch.lengths) for batch in history) / self.h)
        self._memo: dict[tuple[str, int], np.ndarray | float] = {}
        # responses active on each segment (longer than its mid), per batch of the history
        self.bulk_active = sum(batch.active_on(s_max) for batch in history) / self.h
        if shared_only and per_sample:
            return
        gmax = np.concatenate([batch.group_max for batch in history])
        n_groups = len(gmax)
        # longest group first, ties in history order: a stable sort, done as one sort of unique keys
        order = np.sort((int(s_max) - gmax) * n_groups + np.arange(n_groups)) % n_groups
        self.bulk_scale = candidates.bulk_scale
        cut_rank, first_row_of_rank = candidates.ranks(self.h, n_groups)
        self.cut_step = gmax[order[::-1][cut_rank]].astype(float)  # step at which the (B − q')-th bulk group finishes
        # Tail: the q' groups with the longest samples; responses counted per (candidate, segment).
        n_rows = len(self.q_candidates)
        first_row = np.empty(n_groups, dtype=np.int64)  # first candidate holding each group
        first_row[order] = first_row_of_rank
        n_seg = len(self.mid)
        # (candidate, segment a response stops being active on) of each response; groups no candidate
        # isolates have row n_rows, which the cumulative count below leaves out
        flat, start = [], 0
        for batch in history:
            row = first_row[start: start + len(batch.sizes)]
            flat.append((row[:, None] * (n_seg + 1) + batch.segment_ends_on(s_max)).ravel())
            start += len(batch.sizes)
        counts = np.bincount(np.concatenate(flat), minlength=(n_rows + 1) * (n_seg + 1))
        counts = np.cumsum(counts.reshape(n_rows + 1, n_seg + 1), axis=0)[:n_rows]
        self.tail_active = np.cumsum(counts[:, ::-1], axis=1)[:, ::-1][:, 1:] / self.h

    def _step_time(self, active: np.ndarray) -> np.ndarray:
        """Seconds per decode step on each segment (last axis) at fractional ``active`` per replica,
        linear between integers; 0 where nothing runs."""
        busy = np.maximum(active, 1.0)  # a busy replica runs >= 1 request
        lo = busy.astype(np.int64)
        at = lo * len(StepTable.CONTEXTS) + self._ctx
        seconds = self._rise[at]  # in place from here: these arrays are large enough for allocation to count
        seconds *= busy - lo
        seconds += self._table[at]
        seconds[~(active > 0)] = 0.0
        return seconds

    def _segment_seconds(self, active: np.ndarray, cap: float | np.ndarray = math.inf) -> np.ndarray:
        """Seconds each segment (last axis) takes at ``active`` responses per replica, at most ``cap``
        of them running at once (the rest wait: the segment stretches by active / cap)."""
        if np.all(np.isinf(cap)):
            seconds = self._step_time(active)
            seconds *= self.seg
            return seconds
        seconds = self._step_time(np.minimum(active, cap))
        seconds *= self.seg
        seconds *= np.maximum(active / cap, 1.0)
        return seconds

    @staticmethod
    def _clock(segment_seconds: np.ndarray) -> np.ndarray:
        """Clock at each grid point (last axis)."""
        clock = np.zeros(segment_seconds.shape[:-1] + (segment_seconds.shape[-1] + 1,))
        np.cumsum(segment_seconds, axis=-1, out=clock[..., 1:])
        return clock

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
        """Evaluate tail and bulk predictions for several pool sizes in one vectorised pass."""
        tails = np.array([k for k in tail_sizes if ("tail", k) not in self._memo], dtype=float)
        bulks = np.array([k for k in bulk_sizes if ("cut", k) not in self._memo], dtype=float)
        # active responses per replica, [pool size, q' candidate, segment]: a tail pool runs the
        # candidate's groups; a bulk pool runs the history's load scaled by the candidate's own aborts
        tail_load = self._critical(self.q_candidates, tails[:, None, None], self.tail_active[None])
        bulk_load = self.bulk_active[None, None, :] * self.bulk_scale[None, :, None] / bulks[:, None, None]
        caps = np.repeat([self.tail_cap, self.bulk_cap], [len(tails), len(bulks)])[:, None, None]
        seconds = self._segment_seconds(np.concatenate([tail_load, bulk_load]), caps)  # both pools in one pass
        times = seconds[: len(tails)].sum(axis=-1)
        for i, k in enumerate(tails.astype(int)):
            self._memo[("tail", k)] = times[i]
        if len(bulks):
            # one clock per q' candidate (its own bulk load), read at that candidate's cut step
            # (np.minimum / np.maximum: np.clip's Python wrapper costs more than these small arrays)
            j = np.minimum(np.maximum(np.searchsorted(self.grid, self.cut_step, side="right"), 1), len(self.grid) - 1)
            frac = (self.cut_step - self.grid[j - 1]) / (self.grid[j] - self.grid[j - 1])
            frac = np.minimum(np.maximum(frac, 0.0), 1.0)
            rows = np.arange(len(self.cut_step))
            clocks = self._clock(seconds[len(tails):])
            lo, hi = clocks[:, rows, j - 1], clocks[:, rows, j]
            cuts = lo + frac * (hi - lo)
            for i, k in enumerate(bulks.astype(int)):
                self._memo[("cut", k)] = cuts[i]

    def bulk_cutoff(self, replicas: int) -> np.ndarray:
        """Predicted bulk cutoff per q candidate on ``replicas`` replicas (all fresh groups spread evenly)."""
        if ("cut", replicas) not in self._memo:
            self.prepare(bulk_sizes=[replicas])
        return self._memo[("cut", replicas)]

    def bulk_full(self, replicas: int) -> float:
        """Predicted end of one shared pool running the whole batch."""
        key = ("full", replicas)
        if key not in self._memo:
            crit = self._critical(np.array([self.batch_size]), replicas, self.bulk_active[None, :])[0]
            self._memo[key] = float(self._clock(self._segment_seconds(crit, self.bulk_cap))[-1])
        return self._memo[key]

    def tail_time(self, replicas: int) -> np.ndarray:
        """Predicted tail-pool time per q candidate on ``replicas`` replicas."""
        if ("tail", replicas) not in self._memo:
            self.prepare(tail_sizes=[replicas])
        return self._memo[("tail", replicas)]
