"""Offline routing policies for one rollout step with known lengths, behind one registry.

Every policy maps the step's samples to replicas and is scored by the one evaluator,
:func:`core.engine.replica.evaluate_samples`. Pools: a tail pool of ``m`` replicas is replicas
``0 .. m-1``, the bulk pool ``m .. R-1``. :data:`POLICIES` (name → :class:`Policy`) serves
``route``, ``simulate``, ``bench`` and ``study``.

* ``verl`` — stock verl 0.9.1: every *sample* to the least-in-flight replica in submission order,
  which in a synchronous step is round-robin over samples (a group spreads over all replicas).
  The baseline every speedup is measured against first.
* ``uniform`` — group i → replica i mod R, all n samples together (the paper's baseline).
* ``uniform-oracle`` — balance known work over all R replicas: groups by decreasing max length,
  each to the replica with the smallest estimated completion time after taking it
  (:class:`TimeEstimate`; token-count LPT, :func:`balanced_assignment`, when no model is given).
* ``topk`` — the k groups with the largest max length go round-robin (longest first) to the
  ``m`` tail replicas; the rest go uniformly (trace order, round-robin) to the R − m others.
* ``topk-balanced`` — same tail pool; the bulk is balanced by known work as in ``uniform-oracle``
  (tail isolation with load balancing).
* ``best-k`` — ``topk-balanced`` with the best k per instance (and the best m unless
  ``tail_replicas`` is given; k = 0 is the balanced all-replica boundary, m = 0): clairvoyant
  *group* isolation.
* ``clairvoyant-sample`` — ``best-k`` over single samples: clairvoyant *sample* isolation.
* ``exact`` — the makespan optimum over group assignments (branch and bound, :mod:`core.routing.oracle`);
  when the time budget runs out it returns the best assignment found with a proven lower bound
  (``optimal=False``, ``lower_bound_s``).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from ..engine.engine import EngineConfig
from ..errors import TailSieveError
from .oracle import SetCost, root_lower_bound, solve_exact
from ..engine.perf import PerfModel, cached_per_model
from ..engine.replica import NO_LIMITS, Evaluation, evaluate_samples, expand_to_samples
from ..engine.step_table import StepTimeGrid, separable_cums
from ..data.trace import Group


class RoutingError(TailSieveError):
    """An impossible routing request (unknown policy, bad k / pool split / replica count)."""


@dataclass(frozen=True)
class Routing:
    """A routing of one step and its evaluation.

    ``assignment`` is the replica per group when the policy keeps groups whole (``group_atomic``),
    else None; ``sample_assignment`` always gives the replica per sample (flat, group-major).
    ``k``/``tail_replicas`` are the tail size and tail-pool replicas (replicas ``0..m-1``) for
    tail policies, else None. ``optimal`` is True only for a finished exact search, then
    ``lower_bound_s`` equals the makespan; an unfinished search reports its proven lower bound.
    ``complete`` is False when a time limit cut a search short (the best found is returned).
    """

    policy: str
    evaluation: Evaluation
    group_atomic: bool = False
    k: int | None = None
    tail_replicas: int | None = None
    optimal: bool = False
    lower_bound_s: float | None = None
    search_nodes: int | None = None
    complete: bool = True

    @property
    def makespan_s(self) -> float:
        return self.evaluation.makespan_s

    @property
    def sample_assignment(self) -> np.ndarray:
        return self.evaluation.sample_replica

    @property
    def assignment(self) -> np.ndarray | None:
        if not self.group_atomic:
            return None
        return self.sample_assignment[self.evaluation.group_starts]

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
        high = max(2, int(typical_active))
        one, top = StepTimeGrid(perf, [1, high], np.arange(max_len, dtype=float) + prompt_len).values
        self.replica_cum, self.request_cum = separable_cums(one, (top - one) / (high - 1))

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
    each to the replica whose estimated time after taking it is smallest (lowest index on ties).

    Groups arrive longest first, so a replica that already runs something never gets a longer
    response: taking a group adds only its request part there, and an empty replica its own
    replica part too. One heap over the busy replicas and the lowest-index empty one decide each
    group in O(log R)."""
    out = np.zeros(len(groups), dtype=np.int64)
    if not groups:
        return out
    total = sum(g.n for g in groups)
    estimate = TimeEstimate.shared(perf, max(g.max_len for g in groups), -(-total // n_replicas),
                                   float(np.mean([g.prompt_len for g in groups])))
    works = estimate.request_times(groups).tolist()
    replica_part = estimate.replica_cum
    busy: list[tuple[float, int]] = []  # (estimated time, replica)
    next_empty = 0
    for i in tail_order(groups):
        work = works[i]
        opened = replica_part[groups[i].max_len] + work if next_empty < n_replicas else float("inf")
        joined = busy[0][0] + work if busy else float("inf")
        if opened < joined or (opened == joined and next_empty < busy[0][1]):
            r, load = next_empty, opened
            next_empty += 1
        else:
            r, load = busy[0][1], joined
            heapq.heappop(busy)
        heapq.heappush(busy, (load, r))
        out[i] = offset + r
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


def least_inflight_assignment(n_samples: int, n_replicas: int, offset: int = 0,
                              rng: np.random.Generator | None = None) -> np.ndarray:
    """Stock verl's routing of one synchronous step: each request, in submission order (group-major),
    to a replica with the fewest in-flight requests (``GlobalRequestLoadBalancer``, ties broken at
    random). Every request of the step is submitted before any finishes, so each round of R requests
    visits every replica once, in a random order (``rng``; without one, in index order): the samples
    are spread evenly, and a group's n samples over the replicas."""
    if rng is None:
        base = np.arange(n_samples, dtype=np.int64) % n_replicas
    else:
        rounds = -(-n_samples // n_replicas)
        base = np.argsort(rng.random((rounds, n_replicas)), axis=1).ravel()[:n_samples]
    return offset + base


def pool_assignment(groups: Sequence[Group], replicas: int, offset: int = 0, group_atomic: bool = False,
                    rng: np.random.Generator | None = None) -> np.ndarray:
    """Replica of every sample of one pool's groups (replicas ``offset .. offset + replicas − 1``):
    each sample by least in flight (stock verl's routing), or whole groups round-robin."""
    if not groups:
        return np.zeros(0, dtype=np.int64)
    if group_atomic:
        return expand_to_samples(groups, uniform_assignment(len(groups), replicas, offset))
    return least_inflight_assignment(sum(g.n for g in groups), replicas, offset, rng)


def longest_to_tail(groups: Sequence[Group], q: int, m: int, n_replicas: int, group_atomic: bool = False,
                    rng: np.random.Generator | None = None, rank: Sequence[float] | None = None) -> np.ndarray:
    """Replica of every sample (in ``groups``' order) of a split whose lengths are known: the ``q``
    groups with the most tokens on the tail pool (replicas 0..m−1), the rest on the bulk pool, each
    pool routed by :func:`pool_assignment` (the tail first; a group keeps its order within its pool).
    ``rank``: what the groups are ranked by instead of their true tokens (e.g. what a predictor knows)."""
    work = np.asarray(rank, dtype=float) if rank is not None else np.array([sum(g.lengths) for g in groups])
    in_tail = np.zeros(len(groups), dtype=bool)
    in_tail[np.argsort(-work, kind="stable")[:q]] = True
    by_pool = {True: iter(pool_assignment([g for g, t in zip(groups, in_tail) if t], m, 0, group_atomic, rng)),
               False: iter(pool_assignment([g for g, t in zip(groups, in_tail) if not t], n_replicas - m, m,
                                           group_atomic, rng))}
    return np.fromiter((next(by_pool[bool(t)]) for g, t in zip(groups, in_tail) for _ in range(g.n)),
                       dtype=np.int64, count=sum(g.n for g in groups))


def singletons(groups: Sequence[Group]) -> list[Group]:
    """Every sample as a group of one (flat, group-major): per-sample policies are group policies on these."""
    return [Group(f"{g.prompt_id}/{j}", (length,), g.prompt_len) for g in groups for j, length in enumerate(g.lengths)]


# ---------------------------------------------------------------- the policy registry

@dataclass(frozen=True)
class RouteRequest:
    """One routing problem and its options (validated by :func:`route`). ``engine``: every replica's
    engine (:class:`core.engine.engine.EngineConfig`), read by the evaluator and by the searches' set costs."""

    groups: list[Group]
    n_replicas: int
    perf: PerfModel
    k: int | None = None
    tail_replicas: int | None = None
    engine: EngineConfig = NO_LIMITS
    time_limit_s: float | None = 10.0
    node_limit: int | None = None
    progress: Callable[[str], None] | None = None


@dataclass(frozen=True)
class Policy:
    """A routing policy: ``assign`` returns the replica of every sample (flat, group-major)."""

    name: str
    summary: str
    assign: Callable[[RouteRequest], "Routing"]
    takes_k: bool = False  # needs --k (a fixed tail size)
    searches_split: bool = False  # chooses k itself and m unless --tail-replicas is given


POLICIES: dict[str, Policy] = {}


def register_policy(name: str, summary: str, **flags):
    def wrap(fn: Callable[[RouteRequest], "Routing"]):
        POLICIES[name] = Policy(name, summary, fn, **flags)
        return fn
    return wrap


def _evaluated(req: RouteRequest, policy: str, sample_replica: np.ndarray, **extra) -> Routing:
    evaluation = evaluate_samples(req.groups, sample_replica, req.n_replicas, req.perf, req.engine)
    return Routing(policy, evaluation, **extra)


def _grouped(req: RouteRequest, policy: str, assignment: np.ndarray, **extra) -> Routing:
    return _evaluated(req, policy, expand_to_samples(req.groups, assignment), group_atomic=True, **extra)


@register_policy("verl", "stock verl 0.9.1: each sample to the least-in-flight replica (the baseline)")
def _verl(req: RouteRequest) -> Routing:
    n_samples = sum(g.n for g in req.groups)
    return _evaluated(req, "verl", least_inflight_assignment(n_samples, req.n_replicas, rng=np.random.default_rng(0)))


@register_policy("uniform", "group round-robin: group i to replica i mod R (the paper's baseline)")
def _uniform(req: RouteRequest) -> Routing:
    return _grouped(req, "uniform", uniform_assignment(len(req.groups), req.n_replicas))


@register_policy("uniform-oracle", "groups balanced by known work over all replicas, no isolation")
def _uniform_oracle(req: RouteRequest) -> Routing:
    return _grouped(req, "uniform-oracle", time_balanced_assignment(req.groups, req.n_replicas, req.perf))


@register_policy("topk", "the k longest groups round-robin on m tail replicas, the rest round-robin", takes_k=True)
def _topk(req: RouteRequest) -> Routing:
    m = req.tail_replicas or 1
    return _grouped(req, "topk", topk_assignment(req.groups, req.n_replicas, req.k, m, balanced=False),
                    k=req.k, tail_replicas=m)


@register_policy("topk-balanced", "the k longest groups on m tail replicas, the rest balanced by known work",
                 takes_k=True)
def _topk_balanced(req: RouteRequest) -> Routing:
    m = req.tail_replicas or 1
    return _grouped(req, "topk-balanced", topk_assignment(req.groups, req.n_replicas, req.k, m, balanced=True,
                                                          perf=req.perf), k=req.k, tail_replicas=m)


@register_policy("best-k", "clairvoyant group isolation: topk-balanced with the best (k, m)", searches_split=True)
def _best_k(req: RouteRequest) -> Routing:
    cost = SetCost(req.groups, req.perf, req.engine)
    found = best_k_search(req.groups, req.n_replicas, cost, req.tail_replicas, time_limit_s=req.time_limit_s,
                          progress=req.progress)
    return _grouped(req, "best-k", found.assignment, k=found.k, tail_replicas=found.m, complete=found.complete,
                    lower_bound_s=makespan_lower_bound(req.groups, req.n_replicas, req.perf, cost))


@register_policy("clairvoyant-sample", "clairvoyant sample isolation: best-k over single samples (lengths known)",
                 searches_split=True)
def _clairvoyant_sample(req: RouteRequest) -> Routing:
    samples = singletons(req.groups)
    cost = SetCost(samples, req.perf, req.engine)
    found = best_k_search(samples, req.n_replicas, cost, req.tail_replicas, time_limit_s=req.time_limit_s,
                          progress=req.progress)
    return _evaluated(req, "clairvoyant-sample", found.assignment, k=found.k, tail_replicas=found.m,
                      complete=found.complete,
                      lower_bound_s=makespan_lower_bound(samples, req.n_replicas, req.perf, cost))


@register_policy("exact", "makespan optimum over whole-group assignments (branch and bound; anytime)")
def _exact(req: RouteRequest) -> Routing:
    groups, R = req.groups, req.n_replicas
    cost = SetCost(groups, req.perf, req.engine)
    seeds = [time_balanced_assignment(groups, R, req.perf), balanced_assignment([g.total_len for g in groups], R)]
    if R >= 2:
        seeds.append(best_k_search(groups, R, cost, None, time_limit_s=req.time_limit_s).assignment)
    result = solve_exact(groups, R, req.perf, req.engine, incumbents=seeds, time_limit_s=req.time_limit_s,
                         node_limit=req.node_limit, set_cost=cost)
    routing = _grouped(req, "exact", result.assignment, optimal=result.optimal, search_nodes=result.nodes)
    # unfinished: the search's proven bound, or the generic one where its cost table cannot bound (an engine's
    # KV limit or prefill): never the 0 s of a search that proved nothing
    lower = result.makespan_s if result.optimal else max(result.lower_bound_s,
                                                         makespan_lower_bound(groups, R, req.perf, cost))
    # The search scores sets with StepCostTable; report the evaluator's makespan and keep the
    # bound consistent with it (they agree to float rounding).
    return replace(routing, lower_bound_s=min(lower, routing.makespan_s), complete=True)


# ---------------------------------------------------------------- the entry point

def route(policy: str, groups: Sequence[Group], n_replicas: int, perf: PerfModel, *, k: int | None = None,
          tail_replicas: int | None = None, engine: EngineConfig = NO_LIMITS, time_limit_s: float | None = 10.0,
          node_limit: int | None = None, progress: Callable[[str], None] | None = None) -> Routing:
    """Route ``groups`` with ``policy`` (a name in :data:`POLICIES`) and evaluate the result.

    ``k``/``tail_replicas`` apply to ``topk``/``topk-balanced`` (k required, m defaults to 1);
    ``best-k`` and ``clairvoyant-sample`` search k themselves and m too unless ``tail_replicas`` is
    given; ``time_limit_s`` bounds every search (``exact``'s branch and bound, the (k, m) scans),
    ``node_limit`` the exact one; ``progress`` gets a line now and then from long searches;
    ``engine`` is every replica's engine (default: no limit binds).
    """
    req = RouteRequest(list(groups), n_replicas, perf, k, tail_replicas, engine, time_limit_s, node_limit,
                       progress)
    _check_common(policy, req)
    return POLICIES[policy].assign(req)


# ---------------------------------------------------------------- (k, m) search

@dataclass(frozen=True)
class SplitSearch:
    assignment: np.ndarray
    k: int
    m: int
    makespan_s: float
    complete: bool  # every candidate of the search's grid was scored (False: the time limit cut it short)


EXHAUSTIVE_CANDIDATES = 1024  # (k, m) pairs scanned one by one up to this; coarse-to-fine above


def _k_grid(n: int, m: int) -> list[int]:
    """Tail sizes worth a look at scale: every multiple of m up to 8 rounds, then geometric to n."""
    small = [m * j for j in range(1, 9) if m * j <= n]
    return sorted(set(small) | {int(x) for x in np.unique(np.round(np.geomspace(max(1, m), n, 24)))})


def _m_grid(n_replicas: int) -> list[int]:
    if n_replicas <= 17:
        return list(range(1, n_replicas))
    return sorted({int(x) for x in np.unique(np.round(np.geomspace(1, n_replicas - 1, 12)))})


def best_k_search(groups: Sequence[Group], n_replicas: int, cost: SetCost, tail_replicas: int | None, *,
                  time_limit_s: float | None = None, exhaustive: bool | None = None,
                  progress: Callable[[str], None] | None = None) -> SplitSearch:
    """Smallest-makespan ``topk-balanced`` over k (and m unless given); ties → smaller k, m.

    Small instances are scanned exhaustively (exact over the family); large ones coarse-to-fine: a
    grid of m, for each a grid of k, then every k and m between the best point's grid neighbours.
    Candidates are scored until one replica exceeds the best so far, and for a fixed m the scan over
    k stops once the tail pool alone is no better (raising k only adds groups to tail replicas, which
    cannot shorten them under a monotone model). ``time_limit_s`` ends the search with the best so far
    after that many CPU seconds of this process (not wall seconds: a loaded machine does not weaken it).
    """
    n = len(groups)
    order = tail_order(groups)
    deadline = None if time_limit_s is None else time.process_time() + time_limit_s
    balanced = time_balanced_assignment(groups, n_replicas, cost.perf)
    best = SplitSearch(balanced, 0, 0, cost.makespan(balanced, n_replicas), True) if tail_replicas is None else None
    scored: set[tuple[int, int]] = set()
    complete = True

    def scan(m: int, ks) -> None:
        nonlocal best, complete
        for k in ks:
            if (k, m) in scored:
                continue
            if deadline is not None and time.process_time() > deadline and best is not None:
                complete = False
                return
            scored.add((k, m))
            if best is not None and cost.monotone and k > 0:
                if max(cost.cost(order[j:k:m]) for j in range(m)) >= best.makespan_s:
                    return
            assignment = topk_assignment(groups, n_replicas, k, m, balanced=True, perf=cost.perf)
            value = cost.makespan(assignment, n_replicas, stop_above=best.makespan_s if best else float("inf"))
            if best is None or value < best.makespan_s:
                best = SplitSearch(assignment, k, m, value, True)

    ms = [tail_replicas] if tail_replicas is not None else list(range(1, n_replicas))
    k0 = 0 if tail_replicas is not None else 1
    if exhaustive is None:
        exhaustive = len(ms) * (n + 1) <= EXHAUSTIVE_CANDIDATES
    if exhaustive:
        for m in ms:
            scan(m, range(k0, n + 1))
    else:
        coarse_ms = ms if tail_replicas is not None else _m_grid(n_replicas)
        for i, m in enumerate(coarse_ms):
            scan(m, ([0] if k0 == 0 else []) + _k_grid(n, m))
            if progress is not None:
                progress(f"(k, m) search: m {m} scanned ({i + 1}/{len(coarse_ms)}), best {best.makespan_s:.3f} s "
                         f"at k={best.k}, m={best.m}")
        if best.m > 0:
            near_ms = [m for m in ms if abs(m - best.m) <= max(1, best.m // 4)] or [best.m]
            for m in near_ms:
                grid = [0] + _k_grid(n, m)
                below = max([x for x in grid if x < best.k], default=k0)
                above = min([x for x in grid if x > best.k], default=n)
                scan(m, range(max(k0, below), above + 1))
    return replace(best, complete=complete)


def makespan_lower_bound(groups: Sequence[Group], n_replicas: int, perf: PerfModel, cost: SetCost) -> float:
    """A lower bound on the makespan of every group assignment: the exact search's root bound where
    its cost table fits and the model is monotone; else the larger of the longest response alone
    (every decode step of it costs at least the model's least step time at that context) and the
    throughput bound (tokens / R at the model's least per-token cost, taken at the shortest prompt:
    per-token cost does not fall with context in any bundled table). Under speculation a step may
    carry up to k + 1 tokens of a request at no less than a decode step's cost: the bound is divided
    by k + 1."""
    if cost.bounded and cost.monotone:
        return root_lower_bound(cost, n_replicas)
    spec = cost.engine.speculative
    tokens_per_step = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    most_active = max(2, sum(g.n for g in groups))
    active = np.unique(np.concatenate([np.arange(1, min(most_active, 64) + 1),
                                       np.geomspace(64, max(64, most_active), 32).round()]))
    context = float(min(g.prompt_len for g in groups))
    per_token = float(np.min(np.asarray(perf.step_time(active, np.full_like(active, context))) / active))
    throughput = sum(g.total_len for g in groups) / n_replicas * per_token
    longest = max(groups, key=lambda g: g.max_len)
    steps = np.arange(longest.max_len, dtype=float) + longest.prompt_len
    least = np.full(len(steps), np.inf)
    for a in active[active <= 64]:
        least = np.minimum(least, np.asarray(perf.step_time(np.full_like(steps, a), steps), dtype=float))
    return max(throughput, float(least.sum())) / tokens_per_step


def _check_common(policy: str, req: RouteRequest) -> None:
    n_replicas, k, tail_replicas = req.n_replicas, req.k, req.tail_replicas
    if policy not in POLICIES:
        raise RoutingError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if isinstance(n_replicas, bool) or not isinstance(n_replicas, (int, np.integer)) or n_replicas < 1:
        raise RoutingError(f"--replicas must be an integer >= 1, got {n_replicas!r}")
    if not req.groups:
        raise RoutingError("no groups to route; the trace is empty")
    if not isinstance(req.engine, EngineConfig):
        raise RoutingError(f"engine must be an EngineConfig, got {req.engine!r}"[:200])
    if req.time_limit_s is not None and not (math.isfinite(req.time_limit_s) and req.time_limit_s > 0):
        raise RoutingError(f"--time-limit must be a finite number of seconds > 0, got {req.time_limit_s}")
    spec = POLICIES[policy]
    if spec.takes_k:
        if k is None:
            raise RoutingError(f"policy {policy} needs --k (how many of the longest groups go to the tail pool)")
        _check_split(len(req.groups), n_replicas, k, 1 if tail_replicas is None else tail_replicas)
        return
    if k is not None:
        hint = f"{policy} chooses k itself" if spec.searches_split else f"policy {policy} has no tail pool"
        raise RoutingError(f"--k does not apply here ({hint}); use --policy topk or topk-balanced to fix k")
    if spec.searches_split:
        if n_replicas < 2:
            raise RoutingError(f"{policy} needs at least 2 replicas (1 tail + 1 bulk), got --replicas {n_replicas}")
        if tail_replicas is not None and not 1 <= tail_replicas < n_replicas:
            raise RoutingError(f"--tail-replicas must be between 1 and replicas - 1 = {n_replicas - 1}, "
                               f"got {tail_replicas}")
    elif tail_replicas is not None:
        with_split = ", ".join(p.name for p in POLICIES.values() if p.takes_k or p.searches_split)
        raise RoutingError(f"--tail-replicas does not apply to policy {policy}; use one of {with_split}")
