"""Measure routing policies on real vLLM servers (``tailsieve bench``).

For one rollout step (a trace of prompt groups with known response lengths) and R replicas, each
policy's assignment of *samples* to replicas is run for real: every response becomes a forced-length
completion (``min_tokens == max_tokens == length``, ``ignore_eos``), the n samples of a group share
one prompt (wherever they run), and a replica's requests are submitted together at its start, in
group-major order. A replica's time is
from its start until its last response returns; the step's makespan is the maximum over replicas.
With R server URLs the replicas run concurrently (replica r on URL r); with U < R URLs, the replicas
mapped to one URL (r mod U) run one after another on it — legitimate because replicas of a
synchronous step are independent, so only each replica's own duration matters.

Next to each measurement the simulator predicts the same assignment
(:func:`core.engine.replica.evaluate_samples`) with a ``table:`` model built from a calibration measured
on the same server, so prediction error and speedups can be read side by side.

Policies:

* ``verl`` — stock verl 0.9.1: every sample to the least-loaded replica (the baseline; speedups
  are measured against it);
* ``uniform`` — groups round-robin over all replicas, all n samples together (the paper's baseline);
* ``tailsieve`` — the steady state of partial-rollout routing on this step, driven by a real
  engine: a first *selection run* executes the stock-verl assignment for real; the ``q`` groups
  still unfinished once ``B − q`` groups had finished are the ones a bulk pool would have aborted
  and carried (prompt identities only). Their samples go to the ``m`` tail replicas, the other
  groups' samples to the ``R − m`` bulk replicas, each pool routing per sample as verl does
  (``group_atomic``: whole groups round-robin). (q, m) is the split the simulator predicts best for
  this selection rule (or fixed by the caller), i.e. where TailSieve's controller settles;
* ``oracle`` — the makespan-optimal assignment for known lengths under the calibrated model
  (``core.routing.policies.route("exact")``; if its time budget runs out, the best found, flagged).

Repeats run the policies interleaved (ABC, CBA, …) and report medians and the spread, because a
shared machine drifts.
"""

from __future__ import annotations

import datetime as _dt
import statistics
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..core.errors import TailSieveError
from ..core.engine.perf import PerfModel
from ..core.routing.policies import expand_to_samples, least_inflight_assignment, pool_assignment, route, uniform_assignment
from ..core.engine.engine import EngineConfig
from ..core.engine.replica import NO_LIMITS, Evaluation, evaluate_samples
from ..core.data.trace import Group
from .openai_client import ForcedRequest, OpenAIServer, synthetic_prompt

POLICIES = ("verl", "uniform", "tailsieve", "oracle")
BASELINE = "verl"


class BenchError(TailSieveError):
    """A benchmark that cannot run as asked (bad sizes, policies or lengths)."""


@dataclass(frozen=True)
class MeasuredStep:
    """One real run of an assignment."""

    replica_times_s: tuple[float, ...]
    group_finish_s: tuple[float, ...]  # per group, trace order, from its replica's start
    sample_finish_s: tuple[float, ...]  # per sample, flat group-major, from its replica's start

    @property
    def makespan_s(self) -> float:
        return max(self.replica_times_s)

    def evaluation(self, groups: Sequence[Group], assignment: np.ndarray) -> Evaluation:
        """The run as the simulator's :class:`Evaluation` (measured in place of modelled times)."""
        return Evaluation.from_sample_finish(groups, assignment, np.asarray(self.sample_finish_s),
                                             list(self.replica_times_s))


def pooled_assignment(groups: Sequence[Group], tail: Sequence[int], n_replicas: int, tail_replicas: int,
                      group_atomic: bool = False) -> np.ndarray:
    """Replica of every sample (flat, group-major): the ``tail`` groups on replicas 0..m-1, the others
    on m..R-1, each pool routing per sample by least in flight (or whole groups round-robin)."""
    if not 1 <= tail_replicas < n_replicas:
        raise BenchError(f"tail replicas must be in 1..{n_replicas - 1} for {n_replicas} replicas, got {tail_replicas}")
    is_tail = np.zeros(len(groups), dtype=bool)
    is_tail[list(tail)] = True
    sample_is_tail = np.repeat(is_tail, [g.n for g in groups])
    out = np.empty(len(sample_is_tail), dtype=np.int64)
    out[sample_is_tail] = pool_assignment([g for g, t in zip(groups, is_tail) if t], tail_replicas, 0, group_atomic)
    out[~sample_is_tail] = pool_assignment([g for g, t in zip(groups, is_tail) if not t], n_replicas - tail_replicas,
                                           tail_replicas, group_atomic)
    return out


def verl_assignment(groups: Sequence[Group], n_replicas: int) -> np.ndarray:
    """Stock verl's routing of the step: every sample by least in flight (ties in a fixed random order)."""
    return least_inflight_assignment(sum(g.n for g in groups), n_replicas, rng=np.random.default_rng(0))


def carried_at_cutoff(group_finish_s: Sequence[float], q: int) -> list[int]:
    """The partial-rollout rule: the ``q`` groups still running once ``B − q`` groups have finished."""
    if q <= 0:
        return []
    order = np.argsort(np.asarray(group_finish_s), kind="stable")
    return sorted(int(i) for i in order[len(order) - q:])


def best_tailsieve_split(groups: Sequence[Group], n_replicas: int, perf: PerfModel,
                         selection_group_finish_s: Sequence[float], engine: EngineConfig = NO_LIMITS,
                         group_atomic: bool = False) -> tuple[int, int, float]:
    """(q, m, predicted makespan) minimising the predicted makespan under the partial-rollout rule;
    (0, 0) is one shared pool (stock verl's routing, or group round-robin when ``group_atomic``)."""
    shared = (expand_to_samples(groups, uniform_assignment(len(groups), n_replicas)) if group_atomic
              else verl_assignment(groups, n_replicas))
    best = (0, 0, evaluate_samples(groups, shared, n_replicas, perf, engine).makespan_s)
    for m in range(1, n_replicas):
        for q in range(1, len(groups) - (n_replicas - m) + 1):
            tail = carried_at_cutoff(selection_group_finish_s, q)
            assignment = pooled_assignment(groups, tail, n_replicas, m, group_atomic)
            makespan = evaluate_samples(groups, assignment, n_replicas, perf, engine).makespan_s
            if makespan < best[2] - 1e-12:
                best = (q, m, makespan)
    return best


def _replica_requests(groups: Sequence[Group], sample_group: np.ndarray, sample_length: np.ndarray,
                      members: np.ndarray, run_key: str) -> tuple[list[ForcedRequest], list[int]]:
    """The requests of these samples and the sample index of each. A group's samples share one
    prompt (as in GRPO); prompts are fresh per run, so no run profits from another's prefix cache."""
    requests, owner = [], []
    for j in members:
        i, length = int(sample_group[j]), int(sample_length[j])
        if length > 0:
            requests.append(ForcedRequest(synthetic_prompt(groups[i].prompt_len, key=(run_key, i)), length))
            owner.append(int(j))
    return requests, owner


def run_assignment(servers: Sequence[OpenAIServer], groups: Sequence[Group], assignment: np.ndarray,
                   n_replicas: int, run_key: str = "run") -> MeasuredStep:
    """Run every replica's samples for real (``assignment``: replica per sample, flat group-major);
    replicas on distinct servers run concurrently."""
    assignment = np.asarray(assignment, dtype=np.int64)
    sample_group = np.repeat(np.arange(len(groups)), [g.n for g in groups])
    sample_length = np.fromiter((x for g in groups for x in g.lengths), dtype=np.int64, count=len(sample_group))
    replica_times = [0.0] * n_replicas
    sample_finish = [0.0] * len(sample_group)  # a zero-length sample is done at its start
    errors: list[BaseException] = []

    def run_lane(server: OpenAIServer, replicas: list[int]) -> None:
        try:
            for r in replicas:
                requests, owner = _replica_requests(groups, sample_group, sample_length,
                                                    np.flatnonzero(assignment == r), run_key)
                if not requests:
                    continue
                timings = server.run_together(requests)
                replica_times[r] = max(t.finish_s for t in timings)
                for j, t in zip(owner, timings):
                    sample_finish[j] = t.finish_s
        except BaseException as e:
            errors.append(e)

    lanes = [(servers[u], [r for r in range(n_replicas) if r % len(servers) == u]) for u in range(len(servers))]
    threads = [threading.Thread(target=run_lane, args=lane, daemon=True) for lane in lanes if lane[1]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    group_finish = [0.0] * len(groups)
    for j, i in enumerate(sample_group):
        group_finish[i] = max(group_finish[i], sample_finish[j])
    return MeasuredStep(tuple(replica_times), tuple(group_finish), tuple(sample_finish))


@dataclass
class PolicyResult:
    policy: str
    assignment: list[int]  # replica per sample, flat group-major
    predicted_s: float
    predicted_replica_s: list[float]
    measured_s: list[float] = field(default_factory=list)
    measured_replica_s: list[list[float]] = field(default_factory=list)

    @property
    def measured_median_s(self) -> float:
        return statistics.median(self.measured_s)

    @property
    def prediction_error(self) -> float:
        """(predicted − measured) / measured, on the median measured makespan."""
        return (self.predicted_s - self.measured_median_s) / self.measured_median_s


def check_lengths(groups: Sequence[Group], max_model_len: int | None) -> None:
    if not groups:
        raise BenchError("the trace has no groups")
    if max_model_len is None:
        return
    worst = max(g.prompt_len + g.max_len for g in groups)
    if worst > max_model_len:
        raise BenchError(f"a group needs {worst} tokens of context but the server allows {max_model_len}; "
                         "shrink the lengths with --length-scale/--max-len or start the server with a larger "
                         "--max-model-len")


def scale_groups(groups: Sequence[Group], scale: float, max_len: int | None) -> list[Group]:
    """Scale (and optionally clip) response lengths so a long trace fits a small server; >= 1 token."""
    if scale <= 0:
        raise BenchError(f"--length-scale must be > 0, got {scale}")
    out = []
    for g in groups:
        lengths = [max(1, int(round(x * scale))) for x in g.lengths]
        if max_len is not None:
            lengths = [min(x, max_len) for x in lengths]
        out.append(Group(g.prompt_id, tuple(lengths), g.prompt_len))
    return out


def bench(groups: Sequence[Group], servers: Sequence[OpenAIServer], n_replicas: int, perf: PerfModel,
          policies: Sequence[str] = POLICIES, oracle_time_limit_s: float = 10.0,
          repeats: int = 3, split: tuple[int, int] | None = None, engine: EngineConfig = NO_LIMITS,
          group_atomic: bool = False, on_run: Callable[[int, int, str, float], None] | None = None) -> dict:
    """Plan, run and compare the policies; returns a JSON-able report (see module docstring)."""
    if n_replicas < 2:
        raise BenchError(f"need at least 2 replicas (a tail and a bulk pool), got {n_replicas}")
    if not servers:
        raise BenchError("need at least one server URL")
    if len(servers) > n_replicas:
        raise BenchError(f"{len(servers)} server URLs for {n_replicas} replicas; give at most R URLs")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or BASELINE not in policies:
        raise BenchError(f"policies must include {BASELINE} (stock verl, the baseline) and come from "
                         f"{', '.join(POLICIES)}; got {list(policies)}")
    if repeats < 1:
        raise BenchError(f"repeats must be >= 1, got {repeats}")
    n_groups = len(groups)
    stock = verl_assignment(groups, n_replicas)
    total_runs = repeats * len(policies) + ("tailsieve" in policies)
    done = 0
    results: dict[str, PolicyResult] = {}
    report: dict = {}

    def record(name: str, assignment: np.ndarray) -> None:
        ev = evaluate_samples(groups, assignment, n_replicas, perf, engine)
        results[name] = PolicyResult(name, [int(a) for a in assignment], ev.makespan_s, list(ev.replica_times_s))

    record("verl", stock)
    if "uniform" in policies:
        record("uniform", expand_to_samples(groups, uniform_assignment(n_groups, n_replicas)))
    if "tailsieve" in policies:
        # Selection run: the shared pool for real; its finish order is the partial-rollout signal.
        shared = (expand_to_samples(groups, uniform_assignment(n_groups, n_replicas)) if group_atomic else stock)
        selection = run_assignment(servers, groups, shared, n_replicas, run_key="selection")
        done += 1
        if on_run:
            on_run(done, total_runs, "selection (shared pool)", selection.makespan_s)
        predicted_shared = evaluate_samples(groups, shared, n_replicas, perf, engine)
        if split is None:
            q, m, _ = best_tailsieve_split(groups, n_replicas, perf, selection.group_finish_s, engine,
                                           group_atomic)
        else:
            q, m = split
        if q == 0 or m == 0:
            record("tailsieve", shared)
            carried: list[int] = []
        else:
            if not 1 <= q <= n_groups - (n_replicas - m):
                raise BenchError(f"q must be in 1..{n_groups - (n_replicas - m)} with m={m}, got {q}")
            carried = carried_at_cutoff(selection.group_finish_s, q)
            record("tailsieve", pooled_assignment(groups, carried, n_replicas, m, group_atomic))
        predicted_carried = carried_at_cutoff(predicted_shared.group_finish_s, q)
        report["tailsieve_selection"] = {
            "q": q, "m": m, "group_atomic": group_atomic, "carried_groups": [groups[i].prompt_id for i in carried],
            "selection_run_makespan_s": selection.makespan_s,
            "carried_overlap_with_predicted_rule": len(set(carried) & set(predicted_carried)),
        }
    if "oracle" in policies:
        routing = route("exact", groups, n_replicas, perf, engine=engine, time_limit_s=oracle_time_limit_s)
        record("oracle", routing.sample_assignment)
        report["oracle"] = {"policy": "exact", "optimal": routing.optimal, "gap_to_bound": routing.gap_to_bound}

    names = [p for p in POLICIES if p in results]
    for rep in range(repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            res = results[name]
            run = run_assignment(servers, groups, np.asarray(res.assignment), n_replicas, run_key=f"{name}:{rep}")
            res.measured_s.append(run.makespan_s)
            res.measured_replica_s.append(list(run.replica_times_s))
            done += 1
            if on_run:
                on_run(done, total_runs, name, run.makespan_s)

    base = results[BASELINE]
    policy_rows = []
    for name in names:
        res = results[name]
        paired = [u / x for u, x in zip(base.measured_s, res.measured_s)]
        policy_rows.append({
            "policy": name,
            "predicted_makespan_s": res.predicted_s,
            "measured_makespan_s": res.measured_median_s,
            "measured_makespan_range_s": [min(res.measured_s), max(res.measured_s)],
            "prediction_error": res.prediction_error,
            "predicted_speedup": base.predicted_s / res.predicted_s,  # vs stock verl
            "measured_speedup": statistics.median(paired),
            "measured_speedup_range": [min(paired), max(paired)],
            "measured_over_predicted_speedup": statistics.median(paired) / (base.predicted_s / res.predicted_s),
            "predicted_replica_s": res.predicted_replica_s,
            "measured_replica_s": res.measured_replica_s,
            "measured_runs_s": res.measured_s,
            "assignment": res.assignment,
        })
    report.update({
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "n_groups": n_groups,
        "n_responses": sum(g.n for g in groups),
        "n_replicas": n_replicas,
        "servers": [s.url for s in servers],
        "server_model": servers[0].model,
        "replicas_per_server_run": "concurrent" if len(servers) == n_replicas else "sequential per server",
        "perf_model": perf.name,
        "engine": asdict(engine),
        "repeats": repeats,
        "policies": policy_rows,
    })
    return report

