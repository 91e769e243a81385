"""Exact completion time of one replica's assigned responses under continuous batching.

Model (vLLM's decode loop without preemption): responses are admitted in FIFO order at t=0, up to
``max_num_seqs`` at once (None = no cap); each decode step every active request produces one token
and costs ``perf.step_time(active, mean_context)`` seconds; a request of length L leaves after its
L-th step and frees its slot for the next waiting one at the following step. Prefill is ignored.
The whole timeline is computed with difference arrays and one vectorised call to the model, so a
replica with thousands of responses and 32k-token tails takes milliseconds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .perf import PerfModel
from .trace import Group


@dataclass(frozen=True)
class ReplicaRun:
    completion_s: float
    finish_s: np.ndarray  # per response, in input order
    steps: int


def simulate_replica(lengths: Sequence[int], perf: PerfModel, prompt_lens: Sequence[int] | None = None,
                     max_num_seqs: int | None = None) -> ReplicaRun:
    """Finish time of every response on one replica (input order = admission order)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return ReplicaRun(0.0, np.zeros(0), 0)
    if np.any(lengths < 0):
        raise ValueError("response lengths must be >= 0")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    prompt = np.zeros(n, dtype=np.int64) if prompt_lens is None else np.asarray(prompt_lens, dtype=np.int64)
    admit = _admission_steps(lengths, max_num_seqs)
    end = admit + lengths  # exclusive: the request is active on steps admit .. end-1
    total_steps = int(end.max())
    if total_steps == 0:
        return ReplicaRun(0.0, np.zeros(n), 0)
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
    return ReplicaRun(float(clock[-1]), finish, total_steps)


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

    @classmethod
    def from_sample_finish(cls, groups: Sequence[Group], sample_replica: np.ndarray, finish: np.ndarray,
                           replica_times_s: list[float]) -> "Evaluation":
        """Group the per-sample finish times (flat, group-major), simulated or measured on an engine."""
        sizes = np.fromiter((g.n for g in groups), dtype=np.int64, count=len(groups))
        starts = np.concatenate([[0], np.cumsum(sizes)])
        response_finish = [finish[starts[i]:starts[i + 1]] for i in range(len(groups))]
        group_finish = (np.maximum.reduceat(finish, starts[:-1]) if len(groups) and len(finish)
                        else np.zeros(len(groups)))
        return cls(max(replica_times_s) if replica_times_s else 0.0, list(replica_times_s), group_finish,
                   response_finish, np.asarray(sample_replica, dtype=np.int64))

    @property
    def group_starts(self) -> np.ndarray:
        """Index of each group's first sample in the flat, group-major sample order."""
        sizes = [len(x) for x in self.response_finish_s]
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def expand_to_samples(groups: Sequence[Group], assignment: Sequence[int]) -> np.ndarray:
    """A per-group assignment as the per-sample one it means (all n samples on the group's replica)."""
    return np.repeat(np.asarray(assignment, dtype=np.int64), [g.n for g in groups])


def evaluate_assignment(groups: Sequence[Group], assignment: Sequence[int], n_replicas: int, perf: PerfModel,
                        max_num_seqs: int | None = None) -> Evaluation:
    """Run every replica's groups (atomic, admitted in trace order) and report the makespan."""
    if len(assignment) != len(groups):
        raise ValueError(f"assignment has {len(assignment)} entries for {len(groups)} groups")
    return evaluate_samples(groups, expand_to_samples(groups, assignment), n_replicas, perf, max_num_seqs)


def evaluate_samples(groups: Sequence[Group], sample_replica: Sequence[int], n_replicas: int, perf: PerfModel,
                     max_num_seqs: int | None = None) -> Evaluation:
    """Run each sample on its replica (flat, group-major trace order = admission order on a replica).

    A group finishes with its last sample, wherever that ran: the unit of routing may be the sample
    (stock verl, TailSieve's pools) while the group stays the unit of consumption."""
    sample_replica = np.asarray(sample_replica, dtype=np.int64)
    sizes = np.fromiter((g.n for g in groups), dtype=np.int64, count=len(groups))
    if len(sample_replica) != int(sizes.sum()):
        raise ValueError(f"sample assignment has {len(sample_replica)} entries for {int(sizes.sum())} samples")
    if len(sample_replica) and (sample_replica.min() < 0 or sample_replica.max() >= n_replicas):
        raise ValueError(f"assignment uses replica indices outside 0..{n_replicas - 1}")
    lengths = np.fromiter((x for g in groups for x in g.lengths), dtype=np.int64, count=len(sample_replica))
    prompts = np.repeat(np.fromiter((g.prompt_len for g in groups), dtype=np.int64, count=len(groups)), sizes)
    finish = np.zeros(len(sample_replica))
    replica_times = [0.0] * n_replicas
    for r in range(n_replicas):
        members = np.flatnonzero(sample_replica == r)
        if len(members) == 0:
            continue
        run = simulate_replica(lengths[members], perf, prompts[members], max_num_seqs)
        replica_times[r] = run.completion_s
        finish[members] = run.finish_s
    return Evaluation.from_sample_finish(groups, sample_replica, finish, replica_times)
