"""Offline routing policies over atomic prompt groups with known lengths.

Every policy maps groups (trace order) to replicas and is scored by the one evaluator,
:func:`core.replica.evaluate_assignment`. Pools: a tail pool of ``m`` replicas is replicas
``0 .. m-1``, the bulk pool ``m .. R-1``.

* ``uniform`` — group i → replica i mod R (what a count-balancing router does).
* ``uniform-oracle`` — balance known work over all R replicas: groups by decreasing max length,
  each to the replica with the smallest estimated completion time after taking it
  (:class:`TimeEstimate`; token-count LPT, :func:`balanced_assignment`, when no model is given).
* ``topk`` — the k groups with the largest max length go round-robin (longest first) to the
  ``m`` tail replicas; the rest go uniformly (trace order, round-robin) to the R − m others.
* ``topk-balanced`` — same tail pool; the bulk is balanced by known work as in ``uniform-oracle``
  (tail isolation with load balancing).
* ``best-k`` — ``topk-balanced`` with the best k per instance (and the best m unless
  ``tail_replicas`` is given; k = 0 is the balanced all-replica boundary, m = 0).
* ``exact`` — the makespan optimum (branch and bound, :mod:`core.oracle`); when the time budget
  runs out it returns the best assignment found with a proven lower bound
  (``optimal=False``, ``lower_bound_s``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import TailSieveError
from .oracle import SetCost, solve_exact
from .perf import PerfModel, cached_per_model
from .replica import Evaluation, evaluate_assignment
from .trace import Group

POLICIES = ("uniform", "uniform-oracle", "topk", "topk-balanced", "best-k", "exact")
TAIL_POLICIES = ("topk", "topk-balanced")


class RoutingError(TailSieveError):
    """An impossible routing request (unknown policy, bad k / pool split / replica count)."""


@dataclass(frozen=True)
class Routing:
    """An assignment of groups (trace order) to replicas and its evaluation.

    ``k``/``tail_replicas`` are the tail size and tail-pool replicas (replicas ``0..m-1``) for
    tail policies, else None. ``optimal`` is True only for a finished exact search, then
    ``lower_bound_s`` equals the makespan; an unfinished search reports its proven lower bound.
    """

    policy: str
    assignment: np.ndarray
    evaluation: Evaluation
    k: int | None = None
    tail_replicas: int | None = None
    optimal: bool = False
    lower_bound_s: float | None = None
    search_nodes: int | None = None

    @property
    def makespan_s(self) -> float:
        return self.evaluation.makespan_s

    @property
    def gap_to_bound(self) -> float | None:
        """(makespan − lower bound) / makespan, when a bound is known."""
        if self.lower_bound_s is None or self.makespan_s <= 0:
            return None
        return (self.makespan_s - self.lower_bound_s) / self.makespan_s


# ---------------------------------------------------------------- assignment building blocks

def uniform_assignment(n_groups: int, n_replicas: int, offset: int = 0) -> np.ndarray:
    """Round-robin in trace order over replicas ``offset .. offset + n_replicas - 1``."""
    return offset + np.arange(n_groups, dtype=np.int64) % n_replicas


def balanced_assignment(work: Sequence[float], n_replicas: int, offset: int = 0) -> np.ndarray:
    """LPT: largest work first, each to the currently least-loaded replica (lowest index on ties)."""
    work = np.asarray(work, dtype=float)
    out = np.zeros(len(work), dtype=np.int64)
    heap = [(0.0, r) for r in range(n_replicas)]
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        load, r = heapq.heappop(heap)
        out[i] = offset + r
        heapq.heappush(heap, (load + work[i], r))
    return out


class TimeEstimate:
    """Separable estimate of a replica's completion time, for balancing (scoring stays exact).

    Each decode step costs about ``α(s) + β(s)·active``: β is the secant of the step model between
    1 and ``typical_active`` requests at step s, α the rest. A replica then takes
    ``P(longest response) + Σ Q(length)`` with P, Q prefix sums of α, β — exact for a linear model,
    and what makes the replica holding the longest response take fewer tokens.
    """

    def __init__(self, perf: PerfModel, max_len: int, typical_active: int, prompt_len: float = 0.0):
        steps = np.arange(max_len, dtype=float) + prompt_len
        high = max(2, int(typical_active))
        one = np.asarray(perf.step_time(np.ones_like(steps), steps), dtype=float)
        slope = (np.asarray(perf.step_time(np.full_like(steps, high), steps), dtype=float) - one) / (high - 1)
        slope = np.clip(slope, 0.0, one)
        self.replica_cum = np.concatenate([[0.0], np.cumsum(one - slope)])
        self.request_cum = np.concatenate([[0.0], np.cumsum(slope)])

    @classmethod
    def shared(cls, perf: PerfModel, max_len: int, typical_active: int, prompt_len: float = 0.0) -> "TimeEstimate":
        """A cached estimate (searches balance hundreds of candidate pools of one instance)."""
        # Powers of two: candidates and instances of one workload share a handful of estimates.
        steps = 1 << max(0, int(max_len - 1).bit_length())
        typical_active = 1 << max(1, int(typical_active - 1).bit_length())
        return cached_per_model(_ESTIMATES, 64, perf, (steps, typical_active, float(prompt_len)),
                                lambda: cls(perf, steps, typical_active, prompt_len))

    def request_times(self, groups: Sequence[Group]) -> np.ndarray:
        """Σ Q(length) per group."""
        flat = np.fromiter((v for g in groups for v in g.lengths), dtype=np.int64)
        starts = np.cumsum([0] + [g.n for g in groups[:-1]])
        return np.add.reduceat(self.request_cum[flat], starts)


_ESTIMATES: dict[tuple, tuple] = {}


def time_balanced_assignment(groups: Sequence[Group], n_replicas: int, perf: PerfModel,
                             offset: int = 0) -> np.ndarray:
    """Balance estimated completion times (:class:`TimeEstimate`): groups by decreasing max length,
    each to the replica whose estimated time after taking it is smallest (lowest index on ties)."""
    out = np.zeros(len(groups), dtype=np.int64)
    if not groups:
        return out
    total = sum(g.n for g in groups)
    estimate = TimeEstimate.shared(perf, max(g.max_len for g in groups), -(-total // n_replicas),
                                   float(np.mean([g.prompt_len for g in groups])))
    works = estimate.request_times(groups).tolist()
    replica_part = estimate.replica_cum
    longest = [0] * n_replicas
    load = [0.0] * n_replicas  # estimated time: replica part of the longest response + request parts
    for i in tail_order(groups):
        g_max, work = groups[i].max_len, works[i]
        after = [(replica_part[max(longest[r], g_max)] - replica_part[longest[r]]) + load[r] + work
                 for r in range(n_replicas)]
        r = after.index(min(after))
        out[i] = offset + r
        load[r] = after[r]
        longest[r] = max(longest[r], g_max)
    return out


def tail_order(groups: Sequence[Group]) -> list[int]:
    """Group indices by decreasing max length (then total length, then trace order)."""
    return sorted(range(len(groups)), key=lambda i: (-groups[i].max_len, -groups[i].total_len, i))


def topk_assignment(groups: Sequence[Group], n_replicas: int, k: int, tail_replicas: int,
                    balanced: bool, perf: PerfModel | None = None) -> np.ndarray:
    """The k longest groups round-robin over replicas 0..m-1, the bulk over m..R-1 (round-robin in
    trace order, or balanced: by estimated time under ``perf``, by tokens without one)."""
    _check_split(len(groups), n_replicas, k, tail_replicas)
    order = tail_order(groups)
    tail = order[:k]
    bulk = sorted(order[k:])  # trace order
    out = np.zeros(len(groups), dtype=np.int64)
    for j, i in enumerate(tail):
        out[i] = j % tail_replicas
    n_bulk = n_replicas - tail_replicas
    if bulk:
        if balanced and perf is not None:
            out[bulk] = time_balanced_assignment([groups[i] for i in bulk], n_bulk, perf, tail_replicas)
        elif balanced:
            out[bulk] = balanced_assignment([groups[i].total_len for i in bulk], n_bulk, tail_replicas)
        else:
            out[bulk] = uniform_assignment(len(bulk), n_bulk, tail_replicas)
    return out


def _check_split(n_groups: int, n_replicas: int, k: int, tail_replicas: int) -> None:
    if n_replicas < 2:
        raise RoutingError(f"a tail pool needs at least 2 replicas (1 tail + 1 bulk), got --replicas {n_replicas}")
    if not 1 <= tail_replicas < n_replicas:
        raise RoutingError(f"--tail-replicas must be between 1 and replicas - 1 = {n_replicas - 1} "
                           f"(the bulk pool needs a replica), got {tail_replicas}")
    if not 0 <= k <= n_groups:
        raise RoutingError(f"--k must be between 0 and the number of groups ({n_groups}), got {k}")


# ---------------------------------------------------------------- the entry point

def route(policy: str, groups: Sequence[Group], n_replicas: int, perf: PerfModel, *, k: int | None = None,
          tail_replicas: int | None = None, max_num_seqs: int | None = None, time_limit_s: float | None = 10.0,
          node_limit: int | None = None) -> Routing:
    """Route ``groups`` with ``policy`` (one of :data:`POLICIES`) and evaluate the result.

    ``k``/``tail_replicas`` apply to ``topk``/``topk-balanced`` (k required, m defaults to 1);
    ``best-k`` searches k itself and m too unless ``tail_replicas`` is given; ``time_limit_s`` and
    ``node_limit`` bound the ``exact`` search.
    """
    groups = list(groups)
    _check_common(policy, groups, n_replicas, k, tail_replicas, max_num_seqs)
    if policy == "uniform":
        return _routing(policy, groups, uniform_assignment(len(groups), n_replicas), n_replicas, perf, max_num_seqs)
    if policy == "uniform-oracle":
        assignment = time_balanced_assignment(groups, n_replicas, perf)
        return _routing(policy, groups, assignment, n_replicas, perf, max_num_seqs)
    if policy in TAIL_POLICIES:
        m = 1 if tail_replicas is None else tail_replicas
        assignment = topk_assignment(groups, n_replicas, k, m, balanced=policy == "topk-balanced", perf=perf)
        return _routing(policy, groups, assignment, n_replicas, perf, max_num_seqs, k=k, tail_replicas=m)
    cost = SetCost(groups, perf, max_num_seqs)
    if policy == "best-k":
        assignment, best_k, best_m = best_k_search(groups, n_replicas, cost, tail_replicas)
        return _routing(policy, groups, assignment, n_replicas, perf, max_num_seqs, k=best_k, tail_replicas=best_m)
    # exact
    seeds = [time_balanced_assignment(groups, n_replicas, perf),
             balanced_assignment([g.total_len for g in groups], n_replicas)]
    if n_replicas >= 2:
        seeds.append(best_k_search(groups, n_replicas, cost, None)[0])
    result = solve_exact(groups, n_replicas, perf, max_num_seqs, incumbents=seeds, time_limit_s=time_limit_s,
                         node_limit=node_limit, set_cost=cost)
    routing = _routing(policy, groups, result.assignment, n_replicas, perf, max_num_seqs)
    lower = result.makespan_s if result.optimal else result.lower_bound_s
    # The search scores sets with StepCostTable; report the evaluator's makespan and keep the
    # bound consistent with it (they agree to float rounding).
    lower = min(lower, routing.makespan_s)
    return Routing(policy, routing.assignment, routing.evaluation, optimal=result.optimal, lower_bound_s=lower,
                   search_nodes=result.nodes)


def best_k_search(groups: Sequence[Group], n_replicas: int, cost: SetCost,
                  tail_replicas: int | None) -> tuple[np.ndarray, int, int]:
    """Smallest-makespan ``topk-balanced`` over k (and m unless given); ties → smaller k, m.

    Exact over the family: candidates are scored until one replica exceeds the best so far, and
    for a fixed m the scan over k stops once the tail pool alone is no better (raising k only adds
    groups to tail replicas, which cannot shorten them under a monotone model).
    """
    n = len(groups)
    order = tail_order(groups)
    balanced = time_balanced_assignment(groups, n_replicas, cost.perf)
    best = (cost.makespan(balanced, n_replicas), balanced, 0, 0) if tail_replicas is None else None
    for m in ([tail_replicas] if tail_replicas is not None else range(1, n_replicas)):
        for k in range(0 if tail_replicas is not None else 1, n + 1):
            if best is not None and cost.monotone:
                tail = max(cost.cost(order[j:k:m]) for j in range(m))
                if tail >= best[0]:
                    break
            assignment = topk_assignment(groups, n_replicas, k, m, balanced=True, perf=cost.perf)
            value = cost.makespan(assignment, n_replicas, stop_above=best[0] if best else float("inf"))
            if best is None or value < best[0]:
                best = (value, assignment, k, m)
    return best[1], best[2], best[3]


def _routing(policy: str, groups: list[Group], assignment: np.ndarray, n_replicas: int, perf: PerfModel,
             max_num_seqs: int | None, **extra) -> Routing:
    evaluation = evaluate_assignment(groups, assignment, n_replicas, perf, max_num_seqs)
    return Routing(policy, np.asarray(assignment, dtype=np.int64), evaluation, **extra)


def _check_common(policy: str, groups: list[Group], n_replicas: int, k: int | None, tail_replicas: int | None,
                  max_num_seqs: int | None) -> None:
    if policy not in POLICIES:
        raise RoutingError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if isinstance(n_replicas, bool) or not isinstance(n_replicas, (int, np.integer)) or n_replicas < 1:
        raise RoutingError(f"--replicas must be an integer >= 1, got {n_replicas!r}")
    if not groups:
        raise RoutingError("no groups to route; the trace is empty")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise RoutingError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    if policy in TAIL_POLICIES:
        if k is None:
            raise RoutingError(f"policy {policy} needs --k (how many of the longest groups go to the tail pool)")
        _check_split(len(groups), n_replicas, k, 1 if tail_replicas is None else tail_replicas)
        return
    if k is not None:
        hint = "best-k chooses k itself" if policy == "best-k" else f"policy {policy} has no tail pool"
        raise RoutingError(f"--k does not apply here ({hint}); use --policy topk or topk-balanced to fix k")
    if policy == "best-k":
        if n_replicas < 2:
            raise RoutingError(f"best-k needs at least 2 replicas (1 tail + 1 bulk), got --replicas {n_replicas}")
        if tail_replicas is not None and not 1 <= tail_replicas < n_replicas:
            raise RoutingError(f"--tail-replicas must be between 1 and replicas - 1 = {n_replicas - 1}, "
                               f"got {tail_replicas}")
    elif tail_replicas is not None:
        raise RoutingError(f"--tail-replicas does not apply to policy {policy}; use topk, topk-balanced or best-k")
