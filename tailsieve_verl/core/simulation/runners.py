"""The policies a user can deploy, one step at a time on one shared prompt stream, audited by a ledger
(stock verl, uniform, TailSieve and its speculative fallback), and the clairvoyant per-group and
per-sample references that run the same one-step loop."""

from __future__ import annotations

import weakref
import zlib
from collections import Counter
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..tailsieve.controller import AbortedGroup, ControllerConfig, GroupRecord, SplitPlanner
from ..tailsieve.cycle import StepPlanner, TailSieveCycle
from ..engine.engine import EngineConfig
from ..tailsieve.fallback import Arm, FallbackConfig, StockFallback
from ..engine.perf import PerfModel
from ..routing.oracle import SetCost
from ..routing.policies import (best_k_search, expand_to_samples, least_inflight_assignment, longest_to_tail, pool_assignment,
                                route, singletons)
from ..engine.replica import Evaluation, evaluate_samples, makespan_below, sample_tokens_at
from ..tailsieve.selector import Cutoff, bulk_cutoff
from ..kinds import Pool
from ..data.trace import Group
from ..data.workload import PromptPool
from .config import STOCK_SPEC_POLICIES, STOCK_TP, Execute, SimConfig
from .results import GroupSpan, PolicyResult, StepRecord
from .speculation import engine_label, stock_engines, with_speculation


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
    the cutoff falls when ``fresh_quota`` fresh bulk groups finished (:func:`core.tailsieve.selector.bulk_cutoff`).
    The makespan is the larger of the tail pool's end and the bulk pool's (``Cutoff.bulk_end_s``)."""
    tail_s = float(ev.group_finish_s[:n_tail].max()) if n_tail else 0.0
    return tail_s, bulk_cutoff(ev.group_finish_s[n_tail:], n_requeued, fresh_quota)


_DRAWS: "weakref.WeakKeyDictionary[PromptPool, dict[int, dict]]" = weakref.WeakKeyDictionary()


def _step_draws(pool: PromptPool, step: int) -> dict:
    """The groups drawn from ``pool`` at ``step`` so far, by draw key. Runners step in lockstep, so only
    this step's and the last step's draws are kept."""
    by_step = _DRAWS.setdefault(pool, {})
    if step not in by_step:
        for old in [t for t in by_step if t < step - 1]:
            del by_step[old]
        by_step[step] = {}
    return by_step[step]


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
        """Fresh lengths of each prompt at this step, drawn with :meth:`draw_key` (once per key: the
        policies of a run, best-static's grid points among them, share their draws)."""
        draws = _step_draws(self.pool, step)
        groups = []
        for i in ids:
            key = (self.cfg.n, *self.draw_key(i, step))
            group = draws.get(key)
            if group is None:
                group = draws[key] = self.pool.sample_group(prompt_of(i), self.cfg.n, step, np.random.default_rng(key[1:]))
            groups.append(group)
        return groups

    def draw_key(self, instance_id: str, step: int) -> list[int]:
        """A draw is keyed by (seed, prompt, step), not by the order of calls, so every policy that
        generates a prompt at a step gets the same lengths (common random numbers): a difference
        between policies is their routing, not their luck."""
        return [self.cfg.seed, self.draw_stream, step, zlib.crc32(prompt_of(instance_id).encode())]

    def in_flight(self) -> list[str]:
        return []

    def skip_to(self, step: int) -> list[list[str]]:
        """Start at ``step``: the stream hands out the B prompts of every earlier step (returned, by step)."""
        return [self.stream.take(self.cfg.batch_size) for _ in range(step)]

    def engines(self, m: int) -> list[EngineConfig]:
        """Every replica's engine in a step whose tail pool has m replicas."""
        return [self.cfg.engine] * self.cfg.n_replicas

    def run(self, groups: Sequence[Group], samples: np.ndarray, m: int) -> Evaluation:
        """One step's samples on their replicas: the ``execute`` hook, else the engine model."""
        if self.execute is not None:
            return self.execute(self.name, groups, samples)
        engines = self.engines(m)  # one per replica: fewer than n_replicas where a pool's replicas are wider
        return evaluate_samples(groups, samples, len(engines), self.perf, engine=engines)

    def finish(self) -> PolicyResult:
        self.result.lost, self.result.duplicated = self.ledger.audit(self.in_flight())
        self.result.stale = self.ledger.stale
        steps = self.result.records[-1].step + 1 if self.result.records else 0
        self.result.max_deferral_steps = self.ledger.deferral(self.in_flight(), steps)
        return self.result


class StaticRunner(_Runner):
    """One-step policies of :data:`core.routing.policies.POLICIES`: B fresh groups per step, all consumed.

    ``clairvoyant-*`` know this step's lengths (references, not deployable)."""

    NAMES = ("verl", "verl-redraw", "uniform", "clairvoyant-group", "clairvoyant-sample")
    STOCK_ROUTING = ("verl", "verl-redraw", STOCK_TP) + STOCK_SPEC_POLICIES  # verl's per-sample least-in-flight

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


def predicted_work(pool: PromptPool, n: int, sigma: float, seed: int) -> dict[str, float]:
    """A per-prompt length predictor of log error ``sigma``: each prompt's group work (typical length at
    step 0 × n) times exp(sigma · z), z standard normal, fixed per prompt (a predictor errs by prompt)."""
    errors = np.exp(sigma * np.random.default_rng([seed, 29]).standard_normal(len(pool)))
    return {pid: pool.typical_length(pid, 0) * n * float(e) for pid, e in zip(pool.prompt_ids, errors)}


class TailSieveRunner(_Runner):
    """Selector + controller in closed loop; the controller sees only measurable quantities."""

    def __init__(self, cfg: SimConfig, pool: PromptPool, perf: PerfModel, controller_cfg: ControllerConfig,
                 name: str, execute: Execute | None = None, planner: SplitPlanner | None = None,
                 step_planner: StepPlanner | None = None):
        """``planner``: the controller's split planner (:func:`core.simulation.split_planner.planner_for`);
        ``step_planner``: plans a step from the per-prompt record (:func:`core.simulation.step_split.step_planner_for`)."""
        self.name = name
        super().__init__(cfg, pool, perf, execute)
        # Per-pool engines on a pinned split are launched once, as the trainer launches them: replicas
        # 0..launched_tail-1 run the tail engine and serve the tail pool only, idle in a step with nothing
        # carried (m = 0) rather than lend their engine to the bulk route (integration.trainer does the same).
        pinned = controller_cfg.fixed_tail_replicas
        per_pool = cfg.tail_engine is not None or cfg.bulk_engine is not None
        self.launched_tail = pinned if pinned is not None and per_pool else 0
        self.cycle = TailSieveCycle(cfg.batch_size, cfg.n_replicas, controller_cfg, perf,
                                    per_sample=not cfg.group_atomic, record=cfg.prompt_record, prompt_key=prompt_of,
                                    record_replaces_aborts=cfg.record_replaces_aborts,
                                    engines=cfg.tail_and_bulk_engines, planner=planner, step_planner=step_planner,
                                    group_size=cfg.n)
        if cfg.length_prior_sigma is not None:
            self.cycle.record.seed(predicted_work(pool, cfg.n, cfg.length_prior_sigma, cfg.seed))
        self.generated: dict[str, int] = {}

    def in_flight(self) -> list[str]:
        return list(self.cycle.selector.carried)

    def skip_to(self, step: int) -> list[list[str]]:
        """:meth:`_Runner.skip_to`, the record holding every skipped prompt measured at the step it was drawn."""
        skipped = super().skip_to(step)
        record = self.cycle.record
        for t, ids in enumerate(skipped):
            if record is not None:
                for identity, group in zip(ids, self.sample(ids, t)):
                    record.observe(prompt_of(identity), group.lengths)
                record.advance()
        return skipped

    def engines(self, m: int) -> list[EngineConfig]:
        return self.cfg.pool_engines(m)

    def draw_key(self, instance_id: str, step: int) -> list[int]:
        key = super().draw_key(instance_id, step)
        if self.cfg.regeneration_draws and instance_id in self.generated:  # generated before: a regeneration
            key.append(self.cfg.regeneration_draws)
        return key

    def abort_scores(self, aborted_ids: Sequence[str], tokens_at_abort: Sequence[int], step: int) -> dict[str, int]:
        """Each aborted group's score as a candidate: its tokens when aborted, what the trainer measures
        (an ablation may put another signal here)."""
        return dict(zip(aborted_ids, tokens_at_abort))

    def step(self, t: int, keep: bool) -> None:
        cfg, R = self.cfg, self.cfg.n_replicas
        pulled = self.stream.take(self.cycle.n_fresh())
        self.ledger.pull(pulled, t)
        plan, m = self.cycle.plan(pulled, R)
        tail_pool = max(m, self.launched_tail)  # replicas kept from the bulk pool: m, or the launched tail
        bulk_ids = list(plan.requeued_ids) + list(plan.bulk_fresh_ids)
        tail = self.sample(plan.tail_ids, t)  # regenerated from scratch under policy version t
        bulk = self.sample(bulk_ids, t)
        self.generated.update(dict.fromkeys(list(plan.tail_ids) + bulk_ids, t))
        groups = tail + bulk
        samples = np.concatenate([pool_assignment(tail, m, 0, cfg.group_atomic, self.routing_rng),
                                  pool_assignment(bulk, R - tail_pool, tail_pool, cfg.group_atomic, self.routing_rng)])
        ev = self.run(groups, samples, tail_pool)
        tail_finish = ev.group_finish_s[:len(tail)]
        bulk_finish = ev.group_finish_s[len(tail):]
        # requeued groups run to completion; the fresh ones still running at the cutoff are aborted. After
        # the cutoff the requeued ones are timed as if the aborted ones kept decoding beside them (the
        # evaluator runs every sample to its end): an upper bound on the bulk pool's end.
        tail_s, cut = step_times(ev, len(tail), len(plan.requeued_ids), plan.fresh_quota)
        makespan = max(tail_s, cut.bulk_end_s)
        sample_tokens = sample_tokens_at(groups, ev, cut.cutoff_s)
        at_abort = np.add.reduceat(sample_tokens, ev.group_starts)[len(tail):] if len(groups) else np.zeros(0)
        aborted = {}
        for i in cut.aborted:
            start = ev.group_starts[len(tail) + i]
            tokens = tuple(int(x) for x in sample_tokens[start:start + bulk[i].n])
            aborted[bulk_ids[i]] = AbortedGroup(tokens, tuple(x < n for x, n in zip(tokens, bulk[i].lengths)))
        scores = self.abort_scores(list(aborted), [int(at_abort[i]) for i in cut.aborted], t)
        done = list(cut.consumed)
        outcome, _ = self.cycle.finish(
            plan, [bulk_ids[i] for i in done], scores,
            tail=[(pid, GroupRecord(g.lengths, float(f))) for pid, g, f in zip(plan.tail_ids, tail, tail_finish)],
            bulk=[(bulk_ids[i], GroupRecord(bulk[i].lengths, float(bulk_finish[i]))) for i in done],
            m=m, cutoff_s=cut.bulk_end_s, prompt_len=float(np.mean([g.prompt_len for g in groups])), policy_version=t,
            aborted=aborted)
        self.ledger.consume(outcome.consumed_ids, self.generated, t)
        for pid in outcome.consumed_ids:
            del self.generated[pid]
        consumed = tail + [bulk[i] for i in done]
        self.last_consumed = consumed
        lengths = tuple(x for g in consumed for x in g.lengths)
        busy = [min(x, cut.bulk_end_s) if r >= tail_pool else x for r, x in enumerate(ev.replica_times_s)]
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
            next_q=self.cycle.decision.q, next_m=self.cycle.decision.m, spans=spans,
            record_planned=self.cycle.last_record_plan.planned, record_rho=self.cycle.last_record_plan.rho,
            deferred_s=max(0.0, ev.makespan_s - makespan) if self.in_flight() else 0.0))  # ev ran every sample to its end


class FallbackRunner(TailSieveRunner):
    """``tailsieve-auto``: TailSieve's split or stock verl with speculation, each step chosen online by
    :class:`core.tailsieve.fallback.StockFallback` from the steps already run.

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
        self.launched_tail = 0  # its engines switch per step (engines()): a shared step spans every replica
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
            best = min(best, makespan_below(order, samples, R, self.perf, self.engines(m), stop_above=best))
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
