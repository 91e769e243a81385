"""Exact completion time of one replica's assigned responses under continuous batching.

Two evaluators of one model, vLLM v1's scheduler (:mod:`core.engine.scheduler`), configured per pool by
an :class:`core.engine.engine.EngineConfig`:

* the closed form, when only ``max_num_seqs`` can bind (no KV limit, token budget, prefill cost
  or speculation: ``EngineConfig()``): responses are admitted in FIFO order at t=0, up to
  ``max_num_seqs`` at once (None = no limit); each decode step every active request produces one
  token and costs ``perf.step_time(active, mean_context)`` seconds; a request of length L leaves
  after its L-th step and frees its slot for the next waiting one at the following step. The whole
  timeline is computed with difference arrays and one vectorised call to the model, so a replica
  with thousands of responses and 32k-token tails takes milliseconds;
* :class:`core.engine.scheduler.ReplicaScheduler` otherwise (KV blocks and preemption, chunked prefill,
  prefix sharing, speculation), walked step by step around events. On the closed form's cases it
  gives the same floats (``tests/core/test_engine_equality.py``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from .engine import EngineConfig, EngineEvents, ReplicaRun, TokenProgress
from .perf import PerfModel
from .scheduler import ReplicaScheduler
from ..data.trace import Group

NO_LIMITS = EngineConfig()


def simulate_replica(lengths: Sequence[int], perf: PerfModel, prompt_lens: Sequence[int] | None = None,
                     engine: EngineConfig = NO_LIMITS, groups: Sequence[int] | None = None) -> ReplicaRun:
    """Finish time of every response on one replica (input order = admission order) under ``engine``
    (its limits, ``max_num_seqs`` included, and its width: ``perf`` is one GPU's step, priced at the replica's
    width by :meth:`EngineConfig.step_model`). ``groups``: each response's prompt group, for prefix sharing."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return ReplicaRun(0.0, np.zeros(0), 0, np.zeros(0))
    if np.any(lengths < 0):
        raise ValueError("response lengths must be >= 0")
    prompt = np.zeros(n, dtype=np.int64) if prompt_lens is None else np.asarray(prompt_lens, dtype=np.int64)
    if engine.binds_beyond_max_num_seqs:
        group_ids = None if groups is None else _first_seen_labels(np.asarray(groups))
        key = (id(perf), engine, lengths.tobytes(), prompt.tobytes(), None if group_ids is None else group_ids.tobytes())
        cached = _RUNS.get(key)
        if cached is not None and cached[0] is perf:
            return cached[1]
        run = _frozen(ReplicaScheduler(lengths, prompt, group_ids, engine).run_to_end(engine.step_model(perf)))
        if len(_RUNS) >= RUN_CACHE_SIZE:
            _RUNS.pop(next(iter(_RUNS)))
        _RUNS[key] = (perf, run)  # the entry holds the model, so its id is not reused while cached
        return run
    return _closed_form(lengths, prompt, engine.step_model(perf), engine.max_num_seqs)


RUN_CACHE_SIZE = 256
_RUNS: dict[tuple, tuple[PerfModel, ReplicaRun]] = {}
"""The latest scheduler runs by (model, engine, requests): hindsight references and searches put the
same requests on the same engine again (clairvoyant-split's bulk replicas under both tail engines,
TailSieve at one shared pool beside stock verl), and a run is a pure function of these."""


def _first_seen_labels(groups: np.ndarray) -> np.ndarray:
    """Group ids renumbered by first appearance: the scheduler only asks which requests share a group."""
    _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inverse.ravel()]


def _frozen(run: ReplicaRun) -> ReplicaRun:
    """``run`` with read-only arrays: cached runs are shared by every caller."""
    arrays = [run.finish_s, run.admit_s]
    if run.progress is not None:
        p = run.progress
        arrays += [p.clock, p.request, p.step, p.tokens, p.lengths]
    for a in arrays:
        if a is not None:
            a.flags.writeable = False
    return run


def _closed_form(lengths: np.ndarray, prompt: np.ndarray, perf: PerfModel, max_num_seqs: int | None) -> ReplicaRun:
    n = len(lengths)
    admit = _admission_steps(lengths, max_num_seqs)
    end = admit + lengths  # exclusive: the request is active on steps admit .. end-1
    total_steps = int(end.max())
    if total_steps == 0:
        return ReplicaRun(0.0, np.zeros(n), 0, np.zeros(n))
    live = lengths > 0
    # active(s) and Σ context(s) = Σ (prompt_i + s - admit_i) over active i, via difference arrays.
    d_count = np.zeros(total_steps + 1)
    d_offset = np.zeros(total_steps + 1)
    np.add.at(d_count, admit[live], 1.0)
    np.add.at(d_count, end[live], -1.0)
    offset = (prompt - admit).astype(float)
    np.add.at(d_offset, admit[live], offset[live])
    np.add.at(d_offset, end[live], -offset[live])
    active = np.cumsum(d_count)[:total_steps]
    ctx_sum = np.cumsum(d_offset)[:total_steps] + active * np.arange(total_steps)
    mean_ctx = np.divide(ctx_sum, active, out=np.zeros(total_steps), where=active > 0)
    step = np.asarray(perf.step_time(active, mean_ctx), dtype=float)
    clock = np.concatenate([[0.0], np.cumsum(step)])
    finish = clock[end]
    admit_s = clock[admit]
    if not admit.any():  # everyone started at 0: tokens at t follow from the finish times alone
        return ReplicaRun(float(clock[-1]), finish, total_steps, admit_s, EngineEvents(steps=total_steps))
    events = EngineEvents(steps=total_steps, queue_wait_s=float(admit_s.sum()), max_queue_wait_s=float(admit_s.max()))
    order = np.arange(n)
    progress = TokenProgress(clock, np.repeat(order, 2), np.stack([admit, end], axis=1).ravel(),
                             np.stack([np.zeros(n), lengths], axis=1).ravel().astype(float), lengths)
    return ReplicaRun(float(clock[-1]), finish, total_steps, admit_s, events, progress)


def _admission_steps(lengths: np.ndarray, max_num_seqs: int | None) -> np.ndarray:
    n = len(lengths)
    if max_num_seqs is None or max_num_seqs >= n:
        return np.zeros(n, dtype=np.int64)
    admit = np.zeros(n, dtype=np.int64)
    running = [int(x) for x in lengths[:max_num_seqs]]  # end steps of admitted requests
    heapq.heapify(running)
    for i in range(max_num_seqs, n):
        start = heapq.heappop(running)  # a slot frees when the earliest running request ends
        admit[i] = start
        heapq.heappush(running, start + int(lengths[i]))
    return admit


@dataclass(frozen=True)
class Evaluation:
    """Result of running an assignment of samples (or whole groups) to replicas."""

    makespan_s: float
    replica_times_s: list[float]
    group_finish_s: np.ndarray  # per group, trace order: when its last sample finished
    response_finish_s: list[np.ndarray]  # per group, trace order: finish time of each sample
    sample_replica: np.ndarray  # replica of every sample, flat in group-major trace order
    admit_s: np.ndarray | None = None  # when each sample was first admitted (flat); None: not known (measured)
    replica_events: tuple[EngineEvents, ...] = ()  # per replica: preemptions, queue wait, recompute, speculation
    progress: tuple[TokenProgress | None, ...] = ()  # per replica (its samples in flat order); None: all
    #   started at 0 and decoded a token per step, see :func:`tokens_generated_at`

    @classmethod
    def from_sample_finish(cls, groups: Sequence[Group], sample_replica: np.ndarray, finish: np.ndarray,
                           replica_times_s: list[float], admit_s: np.ndarray | None = None,
                           replica_events: Sequence[EngineEvents] = (),
                           progress: Sequence[TokenProgress | None] = ()) -> "Evaluation":
        """Group the per-sample finish times (flat, group-major), simulated or measured on an engine."""
        sizes = np.fromiter((g.n for g in groups), dtype=np.int64, count=len(groups))
        starts = np.concatenate([[0], np.cumsum(sizes)])
        response_finish = [finish[starts[i]:starts[i + 1]] for i in range(len(groups))]
        group_finish = (np.maximum.reduceat(finish, starts[:-1]) if len(groups) and len(finish)
                        else np.zeros(len(groups)))
        return cls(max(replica_times_s) if replica_times_s else 0.0, list(replica_times_s), group_finish,
                   response_finish, np.asarray(sample_replica, dtype=np.int64), admit_s, tuple(replica_events),
                   tuple(progress))

    @property
    def group_starts(self) -> np.ndarray:
        """Index of each group's first sample in the flat, group-major sample order."""
        sizes = [len(x) for x in self.response_finish_s]
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def expand_to_samples(groups: Sequence[Group], assignment: Sequence[int]) -> np.ndarray:
    """A per-group assignment as the per-sample one it means (all n samples on the group's replica)."""
    return np.repeat(np.asarray(assignment, dtype=np.int64), [g.n for g in groups])


def evaluate_assignment(groups: Sequence[Group], assignment: Sequence[int], n_replicas: int, perf: PerfModel,
                        engine: EngineConfig | Sequence[EngineConfig] = NO_LIMITS) -> Evaluation:
    """Run every replica's groups (atomic, admitted in trace order) and report the makespan."""
    if len(assignment) != len(groups):
        raise ValueError(f"assignment has {len(assignment)} entries for {len(groups)} groups")
    return evaluate_samples(groups, expand_to_samples(groups, assignment), n_replicas, perf, engine)


class _Samples(NamedTuple):
    """One step's samples, flat in group-major trace order, checked against their assignment."""

    engines: list[EngineConfig]
    sample_replica: np.ndarray
    lengths: np.ndarray
    prompts: np.ndarray
    group_of: np.ndarray


def _samples(groups: Sequence[Group], sample_replica: Sequence[int], n_replicas: int,
             engine: EngineConfig | Sequence[EngineConfig]) -> _Samples:
    engines = [engine] * n_replicas if isinstance(engine, EngineConfig) else list(engine)
    if len(engines) != n_replicas:
        raise ValueError(f"{len(engines)} engine configs for {n_replicas} replicas; give one, or one per replica")
    sample_replica = np.asarray(sample_replica, dtype=np.int64)
    sizes = np.fromiter((g.n for g in groups), dtype=np.int64, count=len(groups))
    if len(sample_replica) != int(sizes.sum()):
        raise ValueError(f"sample assignment has {len(sample_replica)} entries for {int(sizes.sum())} samples")
    if len(sample_replica) and (sample_replica.min() < 0 or sample_replica.max() >= n_replicas):
        raise ValueError(f"assignment uses replica indices outside 0..{n_replicas - 1}")
    lengths = np.fromiter((x for g in groups for x in g.lengths), dtype=np.int64, count=len(sample_replica))
    prompts = np.repeat(np.fromiter((g.prompt_len for g in groups), dtype=np.int64, count=len(groups)), sizes)
    return _Samples(engines, sample_replica, lengths, prompts, np.repeat(np.arange(len(groups)), sizes))


def _replica_runs(step: _Samples, perf: PerfModel, replicas: Iterable[int]) -> Iterator[tuple[int, np.ndarray, ReplicaRun]]:
    """(replica, its samples' flat indices, its run) for each replica of ``replicas`` that has samples,
    in that order, lazily: a caller may stop early."""
    for r in replicas:
        members = np.flatnonzero(step.sample_replica == r)
        if len(members):
            yield int(r), members, simulate_replica(step.lengths[members], perf, step.prompts[members], step.engines[r],
                                                    step.group_of[members])


def evaluate_samples(groups: Sequence[Group], sample_replica: Sequence[int], n_replicas: int, perf: PerfModel,
                     engine: EngineConfig | Sequence[EngineConfig] = NO_LIMITS) -> Evaluation:
    """Run each sample on its replica (flat, group-major trace order = admission order on a replica).

    A group finishes with its last sample, wherever that ran: the unit of routing may be the sample
    (stock verl, TailSieve's pools) while the group stays the unit of consumption. ``engine``: one
    config for every replica, or one per replica (a pool's replicas share theirs)."""
    step = _samples(groups, sample_replica, n_replicas, engine)
    finish = np.zeros(len(step.sample_replica))
    admit = np.zeros(len(step.sample_replica))
    replica_times = [0.0] * n_replicas
    events: list[EngineEvents] = [EngineEvents()] * n_replicas
    progress: list[TokenProgress | None] = [None] * n_replicas
    for r, members, run in _replica_runs(step, perf, range(n_replicas)):
        replica_times[r] = run.completion_s
        finish[members] = run.finish_s
        admit[members] = run.admit_s
        events[r], progress[r] = run.events, run.progress
    return Evaluation.from_sample_finish(groups, step.sample_replica, finish, replica_times, admit, events, progress)


def makespan_below(groups: Sequence[Group], sample_replica: Sequence[int], n_replicas: int, perf: PerfModel,
                   engine: EngineConfig | Sequence[EngineConfig] = NO_LIMITS, stop_above: float = math.inf) -> float:
    """:func:`evaluate_samples`' makespan, or ``math.inf`` as soon as one replica takes longer than
    ``stop_above``: a search over candidate assignments skips the rest of a loser. Replicas run heaviest
    first (most response tokens), the likeliest to end a loser early."""
    step = _samples(groups, sample_replica, n_replicas, engine)
    load = np.bincount(step.sample_replica, weights=step.lengths, minlength=n_replicas)
    makespan = 0.0
    for _, _, run in _replica_runs(step, perf, np.argsort(-load, kind="stable")):
        makespan = max(makespan, run.completion_s)
        if makespan > stop_above:
            return math.inf
    return makespan


class PriorityOrder(NamedTuple):
    """A step's routed samples in the arrival order of priority scheduling (:func:`priority_admission_order`)."""

    groups: list[Group]  # the groups, highest priority first (ties: submission order)
    sample_replica: np.ndarray  # each sample's replica, flat in the new group-major order (routing unchanged)
    group_order: np.ndarray  # group_order[j]: the submission index of new group j (maps results back)


def priority_admission_order(groups: Sequence[Group], sample_replica: Sequence[int],
                             priority: Sequence[float]) -> PriorityOrder:
    """What :func:`evaluate_samples` should see for vLLM's ``scheduling_policy="priority"`` when
    ``priority[i]`` ranks group i (larger = admitted first, e.g. a predicted length: longest first).

    vLLM's priority queue pops the smallest (priority, arrival) and, short of KV blocks, preempts the
    running request with the largest; a preempted request re-enters the heap at its own key. In a
    synchronous step every request is queued before the first schedule, so every running request's key
    stays below every waiting one's (the most recently admitted holds the largest): exactly the
    FCFS engine model (:mod:`core.engine.scheduler`: admit in input order, preempt the most recently
    admitted, re-queue it at the front) fed each replica's requests in key order. Sorting the groups
    (stably, by decreasing priority) gives every replica that order, with the samples of a group (equal
    keys) by submission order as vLLM's arrival time breaks the tie. The replica of every sample stays
    what the router chose in submission order: priority does not change routing."""
    sample_replica = np.asarray(sample_replica, dtype=np.int64)
    priority = np.asarray(priority, dtype=float)
    if priority.shape != (len(groups),):
        raise ValueError(f"priority needs one value per group ({len(groups)}), got shape {priority.shape}")
    if np.isnan(priority).any():
        raise ValueError("priority must not be NaN")
    sizes = np.fromiter((g.n for g in groups), dtype=np.int64, count=len(groups))
    if len(sample_replica) != int(sizes.sum()):
        raise ValueError(f"sample assignment has {len(sample_replica)} entries for {int(sizes.sum())} samples")
    order = np.argsort(-priority, kind="stable")
    starts = np.concatenate([[0], np.cumsum(sizes)])
    flat = (np.concatenate([np.arange(starts[i], starts[i + 1]) for i in order]) if len(order)
            else np.zeros(0, dtype=np.int64))
    return PriorityOrder([groups[i] for i in order], sample_replica[flat], order.astype(np.int64))


def tokens_generated_at(groups: Sequence[Group], ev: Evaluation, t: float) -> np.ndarray:
    """Response tokens each group had generated at time t (a cutoff's abort moment), summed over its samples
    (:func:`sample_tokens_at`)."""
    return np.add.reduceat(sample_tokens_at(groups, ev, t), ev.group_starts) if len(groups) else np.zeros(0)


def sample_tokens_at(groups: Sequence[Group], ev: Evaluation, t: float) -> np.ndarray:
    """Response tokens each sample had generated at time t, flat, group after group.

    A replica whose samples all started at 0 and decoded one token per step (no queueing,
    preemption or speculation) interpolates between its finish times; otherwise each sample's
    progress from the engine counts whole steps done since its admission, and stalls while it waits."""
    lengths = np.fromiter((x for g in groups for x in g.lengths), dtype=np.int64, count=len(ev.sample_replica))
    finish = np.concatenate(ev.response_finish_s) if groups else np.zeros(0)
    tokens = np.zeros(len(lengths))
    for r in np.unique(ev.sample_replica):
        members = np.flatnonzero(ev.sample_replica == r)
        progress = ev.progress[r] if len(ev.progress) > r else None
        if progress is not None:
            tokens[members] = progress.tokens_at(t)
            continue
        order = members[np.argsort(finish[members], kind="stable")]
        xs = np.concatenate([[0.0], finish[order]])
        ys = np.concatenate([[0.0], np.maximum.accumulate(lengths[order].astype(float))])
        tokens[members] = np.minimum(lengths[members], np.floor(np.interp(t, xs, ys)))
    return tokens
