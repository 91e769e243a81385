"""Controller decision latency: HierarchicalController.observe() at 8 replicas × 512 groups and 64 × 4,096.

Prints median / p90 / max over many decisions, separately for steps where only the inner loop runs
and steps where the outer loop also runs (measures the split against the yardstick and evaluates
the neighbouring splits: the expensive ones), plus the share of the time spent turning the
observation's groups into arrays. Targets (issue 11): inner + outer < 1 ms median at 8 × 512 and
< 5 ms at 64 × 4,096.

    python scripts/experiments/bench_controller.py [--shapes 8x512,64x4096] [--n 8] [--decisions 200] [--max-num-seqs 256]

``--max-num-seqs``: both pools' max_num_seqs in the controller's model (its binding path).

Recorded results: scripts/results/controller_decision_time/; every table and its command: docs/results.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tailsieve_verl.core.tailsieve.controller import (ControllerConfig, GroupRecord, HierarchicalController, StepObservation,
                                            _work_arrays)
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.data.workload import PromptPool


def observations(pool: PromptPool, batch: int, n: int, count: int, q: int, m: int, seed: int) -> list[StepObservation]:
    rng = np.random.default_rng(seed)
    out = []
    for step in range(count):
        groups = pool.sample_batch(batch, n, step % 8, rng)
        finish = np.sort(rng.uniform(1.0, 60.0, batch))
        tail = tuple(GroupRecord(g.lengths, float(f)) for g, f in zip(groups[:q], finish[:q]))
        bulk = tuple(GroupRecord(g.lengths, float(f)) for g, f in zip(groups[q:], finish[q:]))
        out.append(StepObservation(m=m, tail_makespan_s=50.0, bulk_cutoff_s=55.0, tail_groups=tail,
                                   bulk_groups=bulk, n_aborted=2 * q))
    return out


def time_decisions(ctl: HierarchicalController, obs: list[StepObservation]) -> np.ndarray:
    """CPU time of each decision (thread time: a busy shared machine does not inflate it)."""
    times = []
    for o in obs:
        t = time.thread_time()
        ctl.observe(o)
        times.append(time.thread_time() - t)
    return np.array(times) * 1e3


TARGET_MS = {(8, 512): 1.0, (64, 4096): 5.0}


def bench(replicas: int, batch: int, n: int, decisions: int, perf, max_num_seqs: int | None = None) -> None:
    pool = PromptPool("real", 4 * batch, seed=0)
    q, m = batch // 16, max(1, replicas // 4)
    obs = observations(pool, batch, n, decisions, q, m, seed=1)
    # inner loop only: the fixed-allocation variant
    engines = (EngineConfig(max_num_seqs=max_num_seqs),) * 2
    inner = HierarchicalController(ControllerConfig(fixed_tail_replicas=m, q_init=q), replicas, batch, perf,
                                   engines=engines)
    # outer loop every step: an unreachable threshold keeps (q, m) where the data was made
    outer = HierarchicalController(ControllerConfig(m_init=m, q_init=q, settle_steps=0, switch_threshold=1e9),
                                   replicas, batch, perf, engines=engines)
    time_decisions(inner, obs[:5])
    time_decisions(outer, obs[:5])
    t_inner, t_outer = time_decisions(inner, obs), time_decisions(outer, obs)
    ingest = []
    for o in obs:
        t = time.thread_time()
        _work_arrays(o.tail_groups + o.bulk_groups)
        ingest.append(time.thread_time() - t)
    ingest_ms = np.array(ingest) * 1e3
    print(f"\ncontroller decision latency, {replicas} replicas, {batch} groups × {n}, {decisions} decisions, "
          f"{perf.name}, max_num_seqs {max_num_seqs}")
    print(f"{'decision kind':<34}{'median ms':>10}{'p90 ms':>10}{'max ms':>10}")
    for name, t in (("inner loop only (fixed split)", t_inner), ("inner + outer", t_outer),
                    ("  of which: ingest groups", ingest_ms)):
        print(f"{name:<34}{np.median(t):>10.3f}{np.percentile(t, 90):>10.3f}{t.max():>10.3f}")
    target = TARGET_MS.get((replicas, batch))
    if target is not None:
        verdict = "meets" if np.median(t_outer) < target else "MISSES"
        print(f"inner + outer median {np.median(t_outer):.3f} ms {verdict} the {target:g} ms target")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x512,64x4096", help="replicas x groups, comma-separated")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--decisions", type=int, default=200)
    ap.add_argument("--perf-model", default="table:h200-dense")
    ap.add_argument("--max-num-seqs", type=int, help="both pools' max_num_seqs in the controller's model")
    args = ap.parse_args()
    perf = parse_perf_model(args.perf_model)
    for shape in args.shapes.split(","):
        replicas, batch = (int(x) for x in shape.split("x"))
        bench(replicas, batch, args.n, args.decisions if batch <= 1024 else max(20, args.decisions // 5), perf,
              args.max_num_seqs)


if __name__ == "__main__":
    main()
