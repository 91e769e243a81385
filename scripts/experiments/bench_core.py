"""Core benchmarks: evaluator throughput, exact-oracle time vs instance size, study time.

Prints measurements side by side (no pass/fail: machines are noisy). Run from the repo root:
    .venv/bin/python scripts/experiments/bench_core.py [--quick] [--study-instances N]

A developer benchmark: prints only, records nothing (docs/development.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

from tailsieve_verl.core.engine.engine import EngineConfig  # noqa: E402
from tailsieve_verl.core.routing.oracle import StepCostTable, brute_force, solve_exact  # noqa: E402
from tailsieve_verl.core.engine.perf import parse_perf_model  # noqa: E402
from tailsieve_verl.core.routing.policies import route  # noqa: E402
from tailsieve_verl.core.engine.replica import evaluate_assignment, simulate_replica  # noqa: E402
from tailsieve_verl.core.routing.study import StudyConfig, run_study  # noqa: E402
from tailsieve_verl.core.data.workload import generate_trace  # noqa: E402


def timed(fn, repeat: int = 3) -> float:
    """Best of ``repeat`` wall times (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_evaluator(perf, quick: bool) -> None:
    print("== evaluator (core.engine.replica) ==")
    print(f"{'replica load':>28} {'steps':>7} {'simulate_replica':>17} {'tokens/s':>12} "
          f"{'StepCostTable':>14} {'ratio':>7}")
    rng = np.random.default_rng(0)
    for n in ([64, 512] if quick else [64, 512, 2048]):
        lengths = np.minimum(np.rint(np.exp(rng.normal(np.log(1024), 1.0, n))), 16384).astype(np.int64)
        t_sim = timed(lambda: simulate_replica(lengths, perf))
        table = StepCostTable(perf, n, int(lengths.max()))
        desc = np.sort(lengths)[::-1]
        t_tab = timed(lambda: table.cost(desc), repeat=20)
        print(f"{f'{n} responses, 1 replica':>28} {int(lengths.max()):>7} {t_sim * 1e3:>14.2f} ms "
              f"{lengths.sum() / t_sim:>12.3g} {t_tab * 1e6:>11.1f} µs {t_sim / t_tab:>6.0f}x")
    step = generate_trace("real", 512, 16, seed=1)
    assignment = np.arange(512) % 8
    t = timed(lambda: evaluate_assignment(step.groups, assignment, 8, perf))
    print(f"full step 512 groups x 16 on 8 replicas: evaluate_assignment {t * 1e3:.1f} ms "
          f"({sum(step.lengths) / t:.3g} simulated tokens/s)")
    t = timed(lambda: evaluate_assignment(step.groups, assignment, 8, perf, EngineConfig(max_num_seqs=256)))
    print(f"same with max_num_seqs=256 (FIFO admission): {t * 1e3:.1f} ms")


def bench_oracle(perf, quick: bool) -> None:
    print("\n== exact oracle: time to prove the optimum vs instance size (R=4, real workload, groups of 1) ==")
    print(f"{'groups':>6} {'B&B s':>8} {'nodes':>9} {'proven':>7} {'gap to bound':>13} {'brute force s':>14} "
          f"{'ratio':>7}")
    for g in ([6, 8, 10, 12, 20, 50] if quick else [6, 8, 10, 12, 16, 20, 50, 100]):
        times, nodes, proven, gaps, brute = [], [], 0, [], []
        for seed in range(3):
            groups = list(generate_trace("real", g, 1, seed=seed).groups)
            start = time.perf_counter()
            result = solve_exact(groups, 4, perf, time_limit_s=5.0)
            times.append(time.perf_counter() - start)
            nodes.append(result.nodes)
            proven += result.optimal
            gaps.append(result.gap)
            if g <= 10:
                start = time.perf_counter()
                brute_force(groups, 4, perf)
                brute.append(time.perf_counter() - start)
        b = f"{np.mean(brute):>14.2f}" if brute else f"{'-':>14}"
        r = f"{np.mean(brute) / np.mean(times):>6.0f}x" if brute else f"{'-':>7}"
        print(f"{g:>6} {np.mean(times):>8.3f} {int(np.mean(nodes)):>9} {proven:>5}/3 {100 * max(gaps):>12.3f}% {b} {r}")
    groups = list(generate_trace("real", 100, 1, seed=0).groups)
    t_bk = timed(lambda: route("best-k", groups, 4, perf), repeat=1)
    print(f"best-k on 100 groups, R=4 (searches k and m): {t_bk * 1e3:.0f} ms")


def bench_study(instances: int) -> None:
    print(f"\n== study: {instances} instances x 100 trajectories, R=4, default time limit ==")
    for workload in ("weak", "real", "strong"):
        config = StudyConfig(instances=instances, workload=workload)
        result = run_study(config)
        s = result.summary()
        bk = s["policies"]["best-k"]
        print(f"{workload:>7}: {result.elapsed_s:6.1f} s ({result.elapsed_s / instances:.2f} s/instance); best-k worst "
              f"{100 * bk['worst_gap']:.2f} %, median {100 * bk['median_gap']:.2f} %, within 1 % "
              f"{100 * bk['share_within_1pct']:.0f} %; optimum proven {s['oracle']['proven_optimal']}/{instances}, "
              f"worst best-known-to-bound {100 * s['oracle']['worst_optimum_to_bound_gap']:.2f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--study-instances", type=int, default=20, help="instances per workload in the study timing")
    args = parser.parse_args()
    perf = parse_perf_model("table:h200-dense")
    bench_evaluator(perf, args.quick)
    bench_oracle(perf, args.quick)
    bench_study(args.study_instances)


if __name__ == "__main__":
    main()
