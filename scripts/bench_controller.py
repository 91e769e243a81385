"""Controller decision latency: HierarchicalController.observe() for 8 replicas and 512 groups × 8.

Prints median / p90 / max over many decisions, separately for steps where only the inner loop runs
and steps where the outer loop evaluates nearby splits (the expensive ones), plus the share of the
time spent turning the observation's groups into arrays. Target: well under 1 ms per decision.

    python scripts/bench_controller.py [--replicas 8] [--batch 512] [--n 8] [--decisions 300]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tailsieve_verl.core.controller import (ControllerConfig, GroupRecord, HierarchicalController, StepObservation,
                                            _work_arrays)
from tailsieve_verl.core.perf import parse_perf_model
from tailsieve_verl.core.workload import PromptPool


def observations(pool: PromptPool, batch: int, n: int, count: int, q: int, m: int, seed: int) -> list[StepObservation]:
    rng = np.random.default_rng(seed)
    out = []
    for step in range(count):
        groups = pool.sample_batch(batch, n, step % 8, rng)
        finish = np.sort(rng.uniform(1.0, 60.0, batch))
        tail = tuple(GroupRecord(g.lengths, float(f)) for g, f in zip(groups[:q], finish[:q]))
        bulk = tuple(GroupRecord(g.lengths, float(f)) for g, f in zip(groups[q:], finish[q:]))
        out.append(StepObservation(q=q, m=m, tail_makespan_s=50.0, bulk_cutoff_s=55.0, tail_groups=tail,
                                   bulk_groups=bulk, n_aborted=q))
    return out


def time_decisions(ctl: HierarchicalController, obs: list[StepObservation]) -> np.ndarray:
    """CPU time of each decision (thread time: a busy shared machine does not inflate it)."""
    times = []
    for o in obs:
        t = time.thread_time()
        ctl.observe(o)
        times.append(time.thread_time() - t)
    return np.array(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--decisions", type=int, default=300)
    ap.add_argument("--perf-model", default="table:h200-dense")
    args = ap.parse_args()
    perf = parse_perf_model(args.perf_model)
    pool = PromptPool("real", 4 * args.batch, seed=0)
    q, m = args.batch // 16, max(1, args.replicas // 4)
    obs = observations(pool, args.batch, args.n, args.decisions, q, m, seed=1)
    # inner loop only: the fixed-allocation variant
    inner = HierarchicalController(ControllerConfig(fixed_tail_replicas=m, q_init=q), args.replicas, args.batch, perf)
    # outer loop every step: never settles, and an unreachable threshold keeps (q, m) where the data was made
    outer = HierarchicalController(ControllerConfig(m_init=m, q_init=q, settle_steps=0, switch_threshold=1e9,
                                                    inner_loop=False), args.replicas, args.batch, perf)
    time_decisions(inner, obs[:10])
    time_decisions(outer, obs[:10])
    t_inner, t_outer = time_decisions(inner, obs), time_decisions(outer, obs)
    ingest = []
    for o in obs:
        t = time.thread_time()
        _work_arrays(o.tail_groups + o.bulk_groups)
        ingest.append(time.thread_time() - t)
    ingest_ms = np.array(ingest) * 1e3
    print(f"controller decision latency, {args.replicas} replicas, {args.batch} groups × {args.n}, "
          f"{args.decisions} decisions, {perf.name}")
    print(f"{'decision kind':<34}{'median ms':>10}{'p90 ms':>10}{'max ms':>10}")
    for name, t in (("inner loop only (fixed split)", t_inner), ("inner + outer evaluation", t_outer),
                    ("  of which: ingest groups", ingest_ms)):
        print(f"{name:<34}{np.median(t):>10.3f}{np.percentile(t, 90):>10.3f}{t.max():>10.3f}")
    print(f"outer/inner median ratio: {np.median(t_outer) / np.median(t_inner):.2f}×")


if __name__ == "__main__":
    main()
