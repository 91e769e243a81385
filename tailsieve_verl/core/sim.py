"""Multi-step closed-loop simulator: routing policies side by side on one prompt stream.

Every policy consumes ``batch_size`` (B) groups × ``n`` responses per step on ``n_replicas`` (R)
replicas; lengths are drawn fresh at every (re)generation from a :class:`core.workload.PromptPool`
(persistent prompt difficulty), and every pool is timed by the one evaluator,
:func:`core.replica.evaluate_assignment`, with the given performance model.

Policies:

* ``uniform`` — B fresh groups round-robin over all replicas; the step ends when all finish.
* ``tailsieve-fixed`` — TailSieve with the tail pool pinned (``fixed_tail_replicas``, default R/2)
  and only the inner q loop.
* ``tailsieve`` — TailSieve with both loops, starting from uniform routing (0, 0).
* ``oracle`` — knows this step's lengths: the B fresh groups routed ``topk-balanced``
  (:mod:`core.policies`) with the best (k, m), searched per step coarse-to-fine (k on a grid of
  ``B/16``, then every k around the best).

A TailSieve step (see :mod:`core.selector`): the tail pool (m replicas) regenerates the T top-scored
carried candidates; the bulk pool (R − m) runs the other candidates and new prompts, ``B − T + a``
groups, and aborts the a unfinished once ``B − T`` have finished (the cutoff); their tokens at the
abort are their scores as the next step's candidates. Makespan = max(tail pool done, cutoff). When nothing is carried
the tail replicas join the bulk pool; when m = 0 but groups are carried (return to uniform routing),
they run in the shared pool and the step also waits for them. Aborted work before the cutoff is
reported as wasted tokens. A ledger checks every prompt is consumed exactly once, by the policy
version of its step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from .controller import ControllerConfig, Decision, GroupRecord, HierarchicalController, StepObservation
from .errors import TailSieveError
from .perf import PerfModel
from .oracle import SetCost
from .policies import balanced_assignment, route, topk_assignment
from .replica import Evaluation, evaluate_assignment
from .selector import BULK, TAIL, TailSelector
from .trace import Group
from .workload import PromptPool

POLICIES = ("uniform", "tailsieve-fixed", "tailsieve", "oracle")


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

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 2 or self.n < 1:
            raise SimError(f"need --steps >= 1, --batch >= 2 and --n >= 1, got {self.steps}, {self.batch_size}, {self.n}")
        if self.n_replicas < 2:
            raise SimError(f"TailSieve needs at least 2 replicas (a tail and a bulk pool), got --replicas {self.n_replicas}")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise SimError(f"unknown policy {unknown[0] if unknown else '(none)'}; choose from {', '.join(POLICIES)}")
        if not 1 <= self.fixed_m < self.n_replicas:
            raise SimError(f"fixed tail replicas must be in 1..{self.n_replicas - 1}, got {self.fixed_m}")

    @property
    def fixed_m(self) -> int:
        return self.fixed_tail_replicas if self.fixed_tail_replicas is not None else self.n_replicas // 2


@dataclass(frozen=True)
class GroupSpan:
    """One group's run in the kept step, for the Gantt chart."""

    replica: int
    finish_s: float  # when its last sample finished (or the abort moment)
    route: str  # TAIL or BULK
    aborted: bool


@dataclass(frozen=True)
class StepRecord:
    step: int
    makespan_s: float
    q: int  # the isolation target of this step (the controller's q)
    m: int  # tail-pool replicas used this step (0 = one shared pool)
    n_tail: int  # carried groups regenerated this step
    tail_s: float  # tail pool done (0 without a tail pool)
    bulk_s: float  # bulk cutoff, or the shared pool's end
    wasted_tokens: int  # tokens of aborted responses generated before the abort
    consumed_tokens: int
    consumed_lengths: tuple[int, ...]  # response lengths of the B consumed groups (bias monitor)
    replica_busy_s: tuple[float, ...]
    next_q: int
    next_m: int
    spans: tuple[GroupSpan, ...] = ()  # only for the kept step


@dataclass
class PolicyResult:
    name: str
    records: list[StepRecord] = field(default_factory=list)
    lost: int = 0
    duplicated: int = 0
    stale: int = 0  # consumed groups generated under an older policy version

    @property
    def makespans(self) -> np.ndarray:
        return np.array([r.makespan_s for r in self.records])

    @property
    def mean_makespan_s(self) -> float:
        return float(self.makespans.mean())

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

    def speedup_vs_uniform(self, window: slice | None = None) -> dict[str, float]:
        if "uniform" not in self.policies:
            return {}
        base = self.policies["uniform"].makespans[window or slice(None)].mean()
        return {name: float(base / r.makespans[window or slice(None)].mean()) for name, r in self.policies.items()}

    def to_json(self) -> dict:
        final = {name: r.records[-1] for name, r in self.policies.items()}
        return {
            "workload": self.workload, "perf_model": self.perf,
            "steps": self.config.steps, "replicas": self.config.n_replicas,
            "batch": self.config.batch_size, "n": self.config.n, "seed": self.config.seed,
            "policies": {name: {"mean_makespan_s": r.mean_makespan_s,
                                "final_q": final[name].next_q, "final_m": final[name].next_m,
                                "wasted_token_fraction": r.wasted_fraction,
                                "prompts_lost": r.lost, "prompts_duplicated": r.duplicated,
                                "stale_responses": r.stale,
                                "makespan_s": [round(x, 4) for x in r.makespans.tolist()],
                                "q": [x.q for x in r.records], "m": [x.m for x in r.records]}
                         for name, r in self.policies.items()},
            "speedup_vs_uniform": self.speedup_vs_uniform(),
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
    """Audits the exactly-once contract: pulled = consumed + in flight, each consumed once, on-policy."""

    def __init__(self) -> None:
        self.pulled: Counter = Counter()
        self.consumed: Counter = Counter()
        self.stale = 0

    def pull(self, ids: Sequence[str]) -> None:
        self.pulled.update(ids)

    def consume(self, ids: Sequence[str], generated_version: dict[str, int], current_version: int) -> None:
        self.consumed.update(ids)
        self.stale += sum(generated_version[i] != current_version for i in ids)

    def audit(self, in_flight: Sequence[str]) -> tuple[int, int]:
        accounted = self.consumed + Counter(in_flight)
        lost = sum((self.pulled - accounted).values())
        duplicated = sum((accounted - self.pulled).values())  # consumed twice, or consumed and still in flight
        return lost, duplicated


# ---------------------------------------------------------------------------- one step per policy

def _round_robin(n_groups: int, replicas: int, offset: int = 0) -> np.ndarray:
    return offset + np.arange(n_groups, dtype=np.int64) % replicas


def _tokens_by(lengths: Sequence[int], finish_s: np.ndarray, t: float) -> np.ndarray:
    """Tokens each response of one replica had generated at time t (all admitted at 0)."""
    lengths = np.asarray(lengths, dtype=float)
    order = np.argsort(finish_s, kind="stable")
    xs = np.concatenate([[0.0], finish_s[order]])
    ys = np.concatenate([[0.0], np.maximum.accumulate(lengths[order])])
    return np.minimum(lengths, np.floor(np.interp(t, xs, ys)))


def _spans(ev: Evaluation, assignment: np.ndarray, routes: Sequence[str], aborted: Sequence[bool],
           abort_s: float) -> tuple[GroupSpan, ...]:
    return tuple(GroupSpan(int(assignment[i]), float(min(ev.group_finish_s[i], abort_s) if aborted[i] else
                                                  ev.group_finish_s[i]), routes[i], bool(aborted[i]))
                 for i in range(len(routes)))


class _Runner:
    name = ""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel):
        self.cfg, self.pool, self.perf = cfg, pool, perf
        self.stream = PromptStream(pool.prompt_ids, cfg.seed)
        self.rng = np.random.default_rng([cfg.seed, 11])
        self.ledger = Ledger()
        self.result = PolicyResult(self.name)

    def sample(self, ids: Sequence[str], step: int) -> list[Group]:
        return [self.pool.sample_group(prompt_of(i), self.cfg.n, step, self.rng) for i in ids]

    def in_flight(self) -> list[str]:
        return []

    def finish(self) -> PolicyResult:
        self.result.lost, self.result.duplicated = self.ledger.audit(self.in_flight())
        self.result.stale = self.ledger.stale
        return self.result


class _StaticRunner(_Runner):
    """uniform / oracle: B fresh groups per step, all consumed."""

    def step(self, t: int, keep: bool) -> None:
        cfg = self.cfg
        ids = self.stream.take(cfg.batch_size)
        self.ledger.pull(ids)
        groups = self.sample(ids, t)
        assignment, m = self.assign(groups)
        ev = evaluate_assignment(groups, assignment, cfg.n_replicas, self.perf)
        self.ledger.consume(ids, dict.fromkeys(ids, t), t)
        lengths = tuple(x for g in groups for x in g.lengths)
        routes = [TAIL if assignment[i] < m else BULK for i in range(len(groups))]
        spans = _spans(ev, assignment, routes, [False] * len(groups), ev.makespan_s) if keep else ()
        tail_s = max((ev.replica_times_s[r] for r in range(m)), default=0.0)
        bulk_s = max(ev.replica_times_s[m:])
        self.result.records.append(StepRecord(
            t, ev.makespan_s, 0, m, sum(r == TAIL for r in routes), tail_s, bulk_s, 0, sum(lengths), lengths,
            tuple(ev.replica_times_s), 0, m, spans))


class UniformRunner(_StaticRunner):
    name = "uniform"

    def assign(self, groups: list[Group]) -> tuple[np.ndarray, int]:
        return route("uniform", groups, self.cfg.n_replicas, self.perf).assignment, 0


class OracleRunner(_StaticRunner):
    name = "oracle"

    def assign(self, groups: list[Group]) -> tuple[np.ndarray, int]:
        return oracle_assignment(groups, self.cfg.n_replicas, self.perf)


def oracle_assignment(groups: Sequence[Group], n_replicas: int, perf: PerfModel) -> tuple[np.ndarray, int]:
    """``topk-balanced`` with the best (k, m): every m, k coarse-to-fine; (0, 0) = balanced everywhere."""
    cost = SetCost(groups, perf)
    n = len(groups)
    best = (cost.makespan(balanced_assignment([g.total_len for g in groups], n_replicas), n_replicas), 0, 0)
    memo: dict[tuple[int, int], float] = {}

    def value(k: int, m: int) -> float:
        if (k, m) not in memo:
            memo[(k, m)] = cost.makespan(topk_assignment(groups, n_replicas, k, m, balanced=True), n_replicas)
        return memo[(k, m)]

    stride = max(1, n // 16)
    for m in range(1, n_replicas):
        coarse = min(range(1, n + 1, stride), key=lambda k: value(k, m))
        k = min(range(max(1, coarse - stride + 1), min(n, coarse + stride - 1) + 1), key=lambda k: value(k, m))
        if value(k, m) < best[0]:
            best = (value(k, m), k, m)
    _, k, m = best
    if m == 0:
        return balanced_assignment([g.total_len for g in groups], n_replicas), 0
    return topk_assignment(groups, n_replicas, k, m, balanced=True), m


class TailSieveRunner(_Runner):
    """Selector + controller in closed loop; the controller sees only measurable quantities."""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, controller_cfg: ControllerConfig,
                 name: str):
        self.name = name
        super().__init__(cfg, pool, perf)
        self.selector = TailSelector(cfg.batch_size, controller_cfg.candidate_factor)
        self.controller = HierarchicalController(controller_cfg, cfg.n_replicas, cfg.batch_size, perf)
        self.decision: Decision = self.controller.decision
        self.generated: dict[str, int] = {}
        self.decisions: list[Decision] = []

    def in_flight(self) -> list[str]:
        return list(self.selector.carried)

    def step(self, t: int, keep: bool) -> None:
        cfg, R = self.cfg, self.cfg.n_replicas
        plan = self.selector.plan_step(self.decision.q)
        fresh_ids = self.stream.take(plan.n_fresh)
        self.ledger.pull(fresh_ids)
        bulk_ids = list(plan.requeued_ids) + fresh_ids
        tail = self.sample(plan.tail_ids, t)  # regenerated from scratch under policy version t
        bulk = self.sample(bulk_ids, t)
        self.generated.update(dict.fromkeys(list(plan.tail_ids) + bulk_ids, t))
        m = self.decision.m if tail else 0  # an idle tail pool lends its replicas to the bulk pool
        groups = tail + bulk
        if m > 0:
            assignment = np.concatenate([_round_robin(len(tail), m), _round_robin(len(bulk), R - m, m)])
        else:
            assignment = _round_robin(len(groups), R)
        ev = evaluate_assignment(groups, assignment, R, self.perf)
        tail_finish = ev.group_finish_s[:len(tail)]
        bulk_finish = ev.group_finish_s[len(tail):]
        order = np.argsort(bulk_finish, kind="stable")
        done = order[:plan.bulk_quota]
        cutoff = float(bulk_finish[done[-1]]) if len(done) else 0.0
        tail_s = float(tail_finish.max()) if len(tail) else 0.0
        makespan = max(tail_s, cutoff)
        abort_s = cutoff if m > 0 else makespan  # a shared pool aborts only when the step ends
        aborted = np.ones(len(bulk), dtype=bool)
        aborted[done] = False
        at_abort = self._tokens_at(groups, ev, assignment, len(tail), aborted, abort_s)
        outcome = self.selector.finish_step(plan, fresh_ids, [bulk_ids[i] for i in done], policy_version=t,
                                            scores={bulk_ids[i]: at_abort[i] for i in at_abort})
        self.ledger.consume(outcome.consumed_ids, self.generated, t)
        for pid in outcome.consumed_ids:
            del self.generated[pid]
        obs = StepObservation(
            q=plan.n_abort, m=m, tail_makespan_s=tail_s, bulk_cutoff_s=cutoff,
            tail_groups=tuple(GroupRecord(g.lengths, float(f)) for g, f in zip(tail, tail_finish)),
            bulk_groups=tuple(GroupRecord(bulk[i].lengths, float(bulk_finish[i])) for i in done),
            n_aborted=plan.n_abort, prompt_len=float(np.mean([g.prompt_len for g in groups])))
        self.decision = self.controller.observe(obs)
        self.decisions.append(self.decision)
        consumed = tail + [bulk[i] for i in done]
        lengths = tuple(x for g in consumed for x in g.lengths)
        busy = [min(x, abort_s) if r >= m else x for r, x in enumerate(ev.replica_times_s)]
        spans = ()
        if keep:
            routes = [TAIL] * len(tail) + [BULK] * len(bulk)
            spans = _spans(ev, assignment, routes, [False] * len(tail) + aborted.tolist(), abort_s)
        self.result.records.append(StepRecord(
            t, makespan, plan.q, m, len(tail), tail_s if m > 0 else 0.0, cutoff if m > 0 else makespan,
            int(sum(at_abort.values())), sum(lengths), lengths, tuple(busy), self.decision.q, self.decision.m, spans))

    @staticmethod
    def _tokens_at(groups: list[Group], ev: Evaluation, assignment: np.ndarray, n_tail: int, aborted: np.ndarray,
                   abort_s: float) -> dict[int, int]:
        """Response tokens each aborted bulk group had generated at the abort (bulk index -> tokens):
        its abort score, and the wasted work."""
        out: dict[int, int] = {}
        for r in np.unique(assignment[n_tail:][aborted]):
            members = np.flatnonzero(assignment == r)
            lengths = [x for i in members for x in groups[i].lengths]
            finish = np.concatenate([ev.response_finish_s[i] for i in members])
            tokens = _tokens_by(lengths, finish, abort_s)
            pos = 0
            for i in members:
                k = groups[i].n
                if i >= n_tail and aborted[i - n_tail]:
                    out[int(i - n_tail)] = int(tokens[pos:pos + k].sum())
                pos += k
        return out


def build_runners(cfg: SimConfig, pool: PromptPool, perf: PerfModel) -> list[_Runner]:
    runners: list[_Runner] = []
    for name in cfg.policies:
        if name == "uniform":
            runners.append(UniformRunner(cfg, pool, perf))
        elif name == "oracle":
            runners.append(OracleRunner(cfg, pool, perf))
        elif name == "tailsieve":
            runners.append(TailSieveRunner(cfg, pool, perf, replace(cfg.controller, fixed_tail_replicas=None), name))
        else:
            fixed = replace(cfg.controller, fixed_tail_replicas=cfg.fixed_m,
                            q_init=max(1, cfg.controller.q_init or cfg.batch_size // 16))
            runners.append(TailSieveRunner(cfg, pool, perf, fixed, name))
    return runners


def simulate(cfg: SimConfig, pool: PromptPool, perf: PerfModel, workload_name: str = "",
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Run every policy of ``cfg`` for ``cfg.steps`` steps; ``progress(done, total)`` after each step."""
    cfg.validate()
    if len(pool) < 2 * cfg.batch_size:
        raise SimError(f"the prompt pool has {len(pool)} prompts; the simulation needs at least 2 × batch = "
                       f"{2 * cfg.batch_size} (a prompt is in flight at most once)")
    runners = build_runners(cfg, pool, perf)
    keep = cfg.steps - 1 if cfg.gantt_step is None else cfg.gantt_step
    total = cfg.steps * len(runners)
    for t in range(cfg.steps):
        for j, runner in enumerate(runners):
            runner.step(t, keep=t == keep)
            if progress is not None:
                progress(t * len(runners) + j + 1, total)
    return SimResult(cfg, workload_name or pool.spec.name, getattr(perf, "name", str(perf)),
                     {r.name: r.finish() for r in runners})
