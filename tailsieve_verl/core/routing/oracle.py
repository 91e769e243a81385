"""Exact makespan-optimal routing of atomic groups: branch and bound over set partitions.

A replica's completion time depends only on *which* groups it runs (they are admitted in trace
order), so the optimum is a partition of the groups into at most R sets minimising the largest set
cost. The search:

* assigns groups in decreasing order of their stand-alone time (tails first: they decide the
  makespan, so bad branches die early);
* breaks the symmetry of identical replicas (a group may open at most one new, empty replica);
* bounds the root by the largest group alone, pigeonhole arguments over the heaviest groups and
  the longest responses, and capacity;
* prunes with lower bounds that hold for every completion of a partial assignment: the cost of
  each replica's current set under the *monotone envelope* of the step model
  (``min over a' >= a of step_time(a', ctx)``, so adding requests can never lower it), and a
  capacity bound (current costs plus the least extra time every remaining request must add,
  spread over R replicas);
* starts from an incumbent (best-k, balanced and greedy assignments) and explores children
  cheapest-first, depth first, with an explicit stack so that when the time or node budget runs
  out the smallest bound of the unexplored subtrees is a valid lower bound on the optimum.

Set costs come from :class:`StepCostTable`: prefix sums of the step model per active count, which
give the same completion time as :func:`core.engine.replica.simulate_replica` (tested to 1e-9) in
O(responses) per set when the replica's engine binds nothing (no ``max_num_seqs`` below the
instance size, no KV limit, token budget, prefill cost or speculation: every request is admitted at
t=0), all prompts have the same length and the (requests × steps) grid fits in memory.
Otherwise costs come from ``simulate_replica`` itself under the engine; the partial sets' true costs
then bound the search when the model is monotone (adding a group never shortens a replica), and
under any engine limit (FIFO admission or preemption can make a larger set finish sooner) the search
prunes only on complete assignments: exact, but practical only for small instances.
Reported makespans of every policy always come from :func:`core.engine.replica.evaluate_assignment`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import TailSieveError
from ..engine.engine import EngineConfig
from ..engine.perf import PerfModel, cached_per_model
from ..engine.replica import NO_LIMITS, simulate_replica
from ..engine.step_table import StepTimeGrid, separable_cums
from ..data.trace import Group

# Largest (active count × steps) grid a StepCostTable may allocate (float64: 8 bytes each).
MAX_TABLE_CELLS = 8_000_000
_TABLE_CACHE: dict[tuple, tuple] = {}
_TABLE_CACHE_SIZE = 4


class OracleError(TailSieveError):
    """An exact-oracle request that cannot be served (bad limits)."""


class StepCostTable:
    """Prefix sums of per-step cost for a replica whose requests all start at t=0.

    ``cum[a, s]`` = Σ_{s' < s} step_time(a, s' + prompt_len): the time a replica spends in its first
    s steps while a requests are active. With lengths sorted descending l_1 >= ... >= l_n, exactly
    j requests are active on steps [l_{j+1}, l_j), so the completion time is
    Σ_j cum[j, l_j] − cum[j, l_{j+1}]. ``env_cum`` is the same for the monotone envelope
    (never lower when requests are added), ``min_extra_cum[s]`` the least extra time one more
    active request adds over its first s steps.
    """

    def __init__(self, perf: PerfModel, max_active: int, max_len: int, prompt_len: int = 0):
        self.max_active = int(max_active)
        self.max_len = int(max_len)
        step = StepTimeGrid(perf, np.arange(self.max_active + 1), np.arange(self.max_len) + prompt_len).values
        step[0] = 0.0
        envelope = np.minimum.accumulate(step[::-1], axis=0)[::-1]
        self.monotone = bool(np.array_equal(envelope, step))
        zeros = np.zeros((self.max_active + 1, 1))
        self.cum = np.concatenate([zeros, np.cumsum(step, axis=1)], axis=1)
        self.env_cum = self.cum if self.monotone else np.concatenate([zeros, np.cumsum(envelope, axis=1)], axis=1)
        min_extra = np.diff(envelope, axis=0).min(axis=0) if self.max_active >= 1 else np.zeros(self.max_len)
        self.min_extra_cum = np.concatenate([[0.0], np.cumsum(np.maximum(min_extra, 0.0))])
        # Linear minorant for a >= 1: envelope(a, s) >= first(s) + slope(s)·(a − 1), slope = the least
        # secant from a = 1 (separable_cums caps it so that neither part is negative).
        first = envelope[1] if self.max_active >= 1 else np.zeros(self.max_len)
        if self.max_active >= 2:
            slope = ((envelope[2:] - first) / np.arange(1, self.max_active, dtype=float)[:, None]).min(axis=0)
        else:
            slope = np.zeros(self.max_len)
        self.replica_part_cum, self.request_part_cum = separable_cums(first, slope)

    @classmethod
    def shared(cls, perf: PerfModel, max_active: int, max_len: int, prompt_len: int = 0) -> "StepCostTable":
        """A cached table (studies route many instances of the same size under one model)."""
        return cached_per_model(_TABLE_CACHE, _TABLE_CACHE_SIZE, perf, (int(max_active), int(max_len), int(prompt_len)),
                                lambda: cls(perf, max_active, max_len, prompt_len))

    def _sum(self, cum: np.ndarray, sorted_desc: np.ndarray) -> float:
        n = len(sorted_desc)
        if n == 0:
            return 0.0
        nxt = np.empty(n, dtype=np.int64)
        nxt[:-1] = sorted_desc[1:]
        nxt[-1] = 0
        rows = np.arange(1, n + 1)
        return float(np.sum(cum[rows, sorted_desc] - cum[rows, nxt]))

    def cost(self, sorted_desc: np.ndarray) -> float:
        """Completion time of requests with these lengths (sorted descending)."""
        return self._sum(self.cum, sorted_desc)

    def envelope_cost(self, sorted_desc: np.ndarray) -> float:
        """A lower bound on the completion time of any superset of these requests."""
        return self._sum(self.env_cum, sorted_desc)

    def staircase_bound(self, max_lens: np.ndarray, works: np.ndarray, n_replicas: int, lo: float = 0.0) -> float:
        """Lower bound from the separable minorant cost(S) >= P(max len of S) + Σ_i Q(l_i), with items
        (groups) divisible: the least T for which filling replicas longest-first (each new replica's
        overhead P set by the item it opens with) needs at most R replicas. ``works`` = Σ Q per item."""
        order = np.argsort(-max_lens, kind="stable")
        overhead = self.replica_part_cum[max_lens[order]]
        works = works[order]
        hi = float(overhead[0] + works.sum())  # one replica holding everything: always feasible

        def feasible(t: float) -> bool:
            used, room = 1, t - overhead[0]
            if room < 0:
                return False
            for w, o in zip(works, overhead):
                while w > room:
                    w -= max(room, 0.0)
                    used, room = used + 1, t - o
                    if used > n_replicas or room <= 0:
                        return False
                room -= w
            return True

        if lo >= hi or feasible(lo):
            return lo
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if feasible(mid):
                hi = mid
            else:
                lo = mid
        return lo

    def request_work(self, lengths: np.ndarray) -> float:
        return float(np.sum(self.request_part_cum[lengths]))

    def min_extra(self, lengths: np.ndarray) -> float:
        """Least time these requests add to any replica they join."""
        return float(np.sum(self.min_extra_cum[lengths]))


class SetCost:
    """Completion time of a set of groups on one replica, cached by the set.

    Uses a :class:`StepCostTable` when that is exact for these groups (all admitted at t=0, equal
    prompt lengths, no engine limit) and small enough, else :func:`simulate_replica` under ``engine``.
    ``bounded`` says whether the envelope lower bounds are available.
    """

    def __init__(self, groups: Sequence[Group], perf: PerfModel, engine: EngineConfig = NO_LIMITS):
        self.groups = list(groups)
        self.perf = perf
        self.engine = engine
        self.lengths = [np.asarray(g.lengths, dtype=np.int64) for g in self.groups]
        total = sum(len(x) for x in self.lengths)
        max_len = max((int(x.max()) for x in self.lengths if len(x)), default=0)
        prompt_lens = {g.prompt_len for g in self.groups}
        unlimited = not engine.binds_beyond_max_num_seqs and (engine.max_num_seqs is None
                                                               or engine.max_num_seqs >= total)
        # Round the step axis up to a power of two so instances of one workload share a table.
        steps = 1 << max(0, int(max_len - 1).bit_length())
        small = (total + 1) * (steps + 1) <= MAX_TABLE_CELLS
        self.table = (StepCostTable.shared(perf, total, steps, prompt_lens.pop())
                      if unlimited and len(prompt_lens) == 1 and small else None)
        self.bounded = self.table is not None
        # Adding a group never shortens a replica: true for a step model non-decreasing in active
        # requests when every request starts at t=0 with one prompt length (no FIFO anomalies).
        if self.table is not None:
            self.monotone = self.table.monotone
        else:
            self.monotone = unlimited and len({g.prompt_len for g in self.groups}) == 1 and \
                _monotone_in_active(perf, total, max_len + self.groups[0].prompt_len)
        self._cache: dict[tuple[int, ...], float] = {}

    def merged(self, members: Sequence[int]) -> np.ndarray:
        if not members:
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.concatenate([self.lengths[i] for i in members]))[::-1]

    def cost(self, members: Sequence[int]) -> float:
        key = tuple(sorted(members))
        value = self._cache.get(key)
        if value is None:
            if not key:
                value = 0.0
            elif self.table is not None:
                value = self.table.cost(self.merged(key))
            else:
                lengths = [v for i in key for v in self.groups[i].lengths]
                prompts = [self.groups[i].prompt_len for i in key for _ in self.groups[i].lengths]
                value = simulate_replica(lengths, self.perf, prompts, self.engine, self._group_ids(key)).completion_s
            self._cache[key] = value
        return value

    def _group_ids(self, members: Sequence[int]) -> list[int]:
        """Each response's group, for the engine's prefix sharing (as :func:`evaluate_samples` passes it)."""
        return [i for i in members for _ in self.groups[i].lengths]

    def makespan(self, assignment: Sequence[int], n_replicas: int, stop_above: float = float("inf")) -> float:
        """Largest set cost; returns early (with a value > ``stop_above``) once one replica exceeds it,
        which lets searches skip hopeless candidates after one or two set costs."""
        members: list[list[int]] = [[] for _ in range(n_replicas)]
        for i, r in enumerate(assignment):
            members[int(r)].append(i)
        worst = 0.0
        for m in members:
            worst = max(worst, self.cost(m))
            if worst > stop_above:
                break
        return worst


def _monotone_in_active(perf: PerfModel, max_active: int, max_context: int) -> bool:
    """Step time non-decreasing in active requests (checked on a grid of contexts)."""
    active = np.arange(1, max_active + 1, dtype=float)
    for ctx in np.linspace(0.0, float(max_context), 9):
        step = np.asarray(perf.step_time(active, np.full_like(active, ctx)), dtype=float)
        if np.any(np.diff(step) < 0):
            return False
    return True


@dataclass(frozen=True)
class OracleResult:
    """Best assignment found; ``optimal`` when the search finished (then lower bound = makespan)."""

    assignment: np.ndarray
    makespan_s: float
    lower_bound_s: float
    optimal: bool
    nodes: int
    elapsed_s: float

    @property
    def gap(self) -> float:
        """Relative distance to the proven lower bound (0 when optimal)."""
        return 0.0 if self.optimal or self.makespan_s <= 0 else (self.makespan_s - self.lower_bound_s) / self.makespan_s


@dataclass
class _Node:
    bound: float
    depth: int
    members: tuple[tuple[int, ...], ...]
    merged: tuple[np.ndarray, ...]
    env: tuple[float, ...]
    assignment: tuple[int, ...]


def solve_exact(groups: Sequence[Group], n_replicas: int, perf: PerfModel, engine: EngineConfig = NO_LIMITS, *,
                incumbents: Sequence[Sequence[int]] = (), time_limit_s: float | None = 10.0,
                node_limit: int | None = None, set_cost: SetCost | None = None) -> OracleResult:
    """Minimise the makespan of routing atomic groups to ``n_replicas`` replicas.

    ``incumbents`` are known assignments (the best one seeds the search). The result is optimal
    when the search space was exhausted within ``time_limit_s``/``node_limit``; otherwise it is the
    best assignment found with a valid lower bound.
    """
    if n_replicas < 1:
        raise OracleError(f"need at least one replica, got {n_replicas}")
    if time_limit_s is not None and time_limit_s <= 0:
        raise OracleError(f"time limit must be > 0 seconds, got {time_limit_s}")
    if node_limit is not None and node_limit < 1:
        raise OracleError(f"node limit must be >= 1, got {node_limit}")
    start = time.perf_counter()
    cost = set_cost or SetCost(groups, perf, engine)
    n_groups = len(groups)
    if n_groups == 0:
        return OracleResult(np.zeros(0, dtype=np.int64), 0.0, 0.0, True, 0, 0.0)

    best_assignment = np.asarray(_greedy(cost, n_replicas), dtype=np.int64)
    best = cost.makespan(best_assignment, n_replicas)
    for candidate in incumbents:
        value = cost.makespan(candidate, n_replicas)
        if value < best:
            best, best_assignment = value, np.asarray(candidate, dtype=np.int64)

    if time_limit_s is not None:
        deadline = start + 0.25 * time_limit_s
        best_assignment, best = improve_locally(cost, best_assignment, n_replicas, deadline)

    bounded = cost.bounded
    table = cost.table
    alone = np.array([cost.cost([i]) for i in range(n_groups)])
    order = sorted(range(n_groups), key=lambda i: (-alone[i], i))
    if bounded:
        env_alone = np.array([table.envelope_cost(cost.merged([i])) for i in range(n_groups)])
        extra = np.array([table.min_extra(cost.lengths[i]) for i in range(n_groups)])
        extra_after = np.concatenate([np.cumsum(extra[order][::-1])[::-1], [0.0]])  # remaining work by depth
        root_bound = _root_bound(cost, env_alone, extra, n_replicas)
    else:  # true set costs bound supersets only when adding a group never shortens a replica
        root_bound = float(alone.max()) if cost.monotone else 0.0

    empty = np.zeros(0, dtype=np.int64)
    stack = [_Node(root_bound, 0, ((),) * n_replicas, (empty,) * n_replicas, (0.0,) * n_replicas, ())]
    nodes = 0
    tolerance = 1e-12
    exhausted = True
    while stack:
        if (time_limit_s is not None and time.perf_counter() - start > time_limit_s) or \
                (node_limit is not None and nodes >= node_limit):
            exhausted = False
            break
        node = stack.pop()
        if node.bound >= best * (1 - tolerance):
            continue
        nodes += 1
        if node.depth == n_groups:
            assignment = np.empty(n_groups, dtype=np.int64)
            assignment[list(order)] = node.assignment
            value = (max(table.cost(m) for m in node.merged) if bounded
                     else cost.makespan(assignment, n_replicas))
            if value < best:
                best, best_assignment = value, assignment
            continue
        g = order[node.depth]
        children = []
        opened_empty = False
        for r in range(n_replicas):
            if not node.members[r]:
                if opened_empty:
                    continue  # identical empty replicas: try one of them
                opened_empty = True
            members = list(node.members)
            members[r] = tuple(sorted(node.members[r] + (g,)))
            merged = list(node.merged)
            env = list(node.env)
            if bounded:
                merged[r] = np.sort(np.concatenate([node.merged[r], cost.lengths[g]]))[::-1]
                env[r] = table.envelope_cost(merged[r])
                capacity = (sum(env) + extra_after[node.depth + 1]) / n_replicas
                bound = max(node.bound, max(env), capacity)
            elif cost.monotone:
                env[r] = cost.cost(members[r])
                bound = max(node.bound, max(env))
            else:
                bound = node.bound
            if bound >= best * (1 - tolerance):
                continue
            children.append(_Node(bound, node.depth + 1, tuple(members), tuple(merged), tuple(env),
                                  node.assignment + (r,)))
        children.sort(key=lambda c: (c.bound, max(c.env)), reverse=True)  # cheapest explored first
        stack.extend(children)
    elapsed = time.perf_counter() - start
    if exhausted:
        lower = best
    else:
        lower = min([best] + [n.bound for n in stack])
        lower = max(lower, root_bound)
    return OracleResult(best_assignment, float(best), float(min(lower, best)), exhausted, nodes, elapsed)


def root_lower_bound(cost: SetCost, n_replicas: int) -> float:
    """The root bound of the exact search (:func:`_root_bound`) for a bounded ``cost``."""
    env_alone = np.array([cost.table.envelope_cost(cost.merged([i])) for i in range(len(cost.groups))])
    extra = np.array([cost.table.min_extra(x) for x in cost.lengths])
    return _root_bound(cost, env_alone, extra, n_replicas)


def _root_bound(cost: SetCost, env_alone: np.ndarray, extra: np.ndarray, n_replicas: int) -> float:
    """Valid for every assignment: the largest group alone; two of the R+1 heaviest groups share a
    replica; among the j groups with the longest responses some replica holds ceil(j/R), hence at
    least that many responses of length >= the j-th longest; capacity."""
    table = cost.table
    bound = float(env_alone.max())
    heavy = np.argsort(-env_alone, kind="stable")[: n_replicas + 1]
    if len(heavy) == n_replicas + 1:
        pair = min(table.envelope_cost(cost.merged([int(i), int(j)])) for i, j in itertools.combinations(heavy, 2))
        bound = max(bound, pair)
    longest = np.sort([int(x.max()) for x in cost.lengths])[::-1]
    for j in range(n_replicas + 1, len(longest) + 1):
        crowd = -(-j // n_replicas)
        bound = max(bound, table.envelope_cost(np.full(crowd, longest[j - 1], dtype=np.int64)))
    top = int(np.argmax(env_alone))
    capacity = (env_alone[top] + extra.sum() - extra[top]) / n_replicas
    bound = max(bound, float(capacity))
    works = np.array([table.request_work(x) for x in cost.lengths])
    group_max = np.array([int(x.max()) for x in cost.lengths], dtype=np.int64)
    return max(bound, table.staircase_bound(group_max, works, n_replicas, bound))


def improve_locally(cost: SetCost, assignment: np.ndarray, n_replicas: int,
                    deadline: float) -> tuple[np.ndarray, float]:
    """Move or swap groups off the slowest replica while that lowers the makespan (or, at an equal
    makespan, the slowest replica's time); stops at a local optimum or the deadline."""
    assignment = np.array(assignment, dtype=np.int64)
    members = [list(np.flatnonzero(assignment == r)) for r in range(n_replicas)]
    times = [cost.cost(m) for m in members]
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        slow = int(np.argmax(times))
        ceiling = times[slow]
        for g in members[slow]:
            rest = [x for x in members[slow] if x != g]
            rest_time = cost.cost(rest)
            for r in range(n_replicas):
                if r == slow:
                    continue
                moved = cost.cost(members[r] + [g])
                if max(rest_time, moved) < ceiling:
                    members[slow], members[r] = rest, members[r] + [g]
                    times[slow], times[r] = rest_time, moved
                    improved = True
                    break
                for h in members[r]:
                    a = cost.cost(rest + [h])
                    if a >= ceiling:
                        continue
                    b = cost.cost([x for x in members[r] if x != h] + [g])
                    if b < ceiling:
                        members[slow] = rest + [h]
                        members[r] = [x for x in members[r] if x != h] + [g]
                        times[slow], times[r] = a, b
                        improved = True
                        break
                if improved or time.perf_counter() > deadline:
                    break
            if improved or time.perf_counter() > deadline:
                break
    for r, m in enumerate(members):
        assignment[m] = r
    return assignment, cost.makespan(assignment, n_replicas)


def _greedy(cost: SetCost, n_replicas: int) -> list[int]:
    """Longest-first list scheduling on true set costs: each group joins the replica where the
    resulting completion time is smallest."""
    n = len(cost.groups)
    alone = [cost.cost([i]) for i in range(n)]
    members: list[list[int]] = [[] for _ in range(n_replicas)]
    assignment = [0] * n
    for g in sorted(range(n), key=lambda i: (-alone[i], i)):
        r = min(range(n_replicas), key=lambda r: (cost.cost(members[r] + [g]), r))
        members[r].append(g)
        assignment[g] = r
    return assignment


def brute_force(groups: Sequence[Group], n_replicas: int, perf: PerfModel,
                engine: EngineConfig = NO_LIMITS) -> tuple[np.ndarray, float]:
    """Reference optimum for tests: every subset's time from ``simulate_replica`` (trace order),
    then the best split of all groups into ``n_replicas`` subsets by exhaustive subset DP
    (O(R·3^G): use for G <= ~12)."""
    n = len(groups)
    full = (1 << n) - 1
    subset_time = [0.0] * (full + 1)
    for mask in range(1, full + 1):
        members = [i for i in range(n) if mask >> i & 1]
        lengths = [v for i in members for v in groups[i].lengths]
        prompts = [groups[i].prompt_len for i in members for _ in groups[i].lengths]
        subset_time[mask] = simulate_replica(lengths, perf, prompts, engine,
                                             [i for i in members for _ in groups[i].lengths]).completion_s
    best = list(subset_time)  # one replica: everything on it
    choice: list[list[int]] = [[]]  # choice[r][mask]: the subset replica r takes (0: none)
    for _ in range(1, n_replicas):
        nxt, pick = list(best), [0] * (full + 1)
        for mask in range(1, full + 1):
            sub = mask
            while sub:
                value = max(subset_time[sub], best[mask ^ sub])
                if value < nxt[mask]:
                    nxt[mask], pick[mask] = value, sub
                sub = (sub - 1) & mask
        best = nxt
        choice.append(pick)
    assignment = np.zeros(n, dtype=np.int64)
    mask = full
    for r in range(n_replicas - 1, -1, -1):
        sub = choice[r][mask] if r else mask
        for i in range(n):
            if sub >> i & 1:
                assignment[i] = r
        mask ^= sub
    return assignment, float(best[full])
