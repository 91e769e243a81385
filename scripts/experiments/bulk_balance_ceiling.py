"""What balancing a pool by *predicted* work could gain over stock verl's least-in-flight (issue 11).

Per step, one shared pool of B groups × n samples on R replicas, timed by the perf model:
stock verl's per-sample least-in-flight against samples balanced (``time_balanced_assignment``) by

* their true lengths — clairvoyant, the ceiling of any balancing;
* their prompt's typical length (``PromptPool.typical_length``: prompt and checkpoint effects, no
  sampling noise) — the best any per-prompt record can know, so the ceiling of balancing by it.

    python scripts/experiments/bulk_balance_ceiling.py [--seeds 4] [--steps 30]

Recorded results: none (prints its table; recorded in scripts/results/controller_vs_stock_verl/controller_v2_log.md); every table and its command: docs/results.md.
"""

from __future__ import annotations

import argparse

import numpy as np

from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.routing.policies import route, singletons, time_balanced_assignment
from tailsieve_verl.core.engine.replica import evaluate_samples
from tailsieve_verl.core.data.trace import Group
from tailsieve_verl.core.data.workload import PromptPool

SETUPS = {"dense-8": ("table:h200-dense", 8), "MoE-4": ("table:h200-moe", 4)}


def balanced_makespan(groups: list[Group], by: list[Group], n_replicas: int, perf) -> float:
    """Makespan of ``groups`` when their samples are balanced by the lengths of ``by`` (same order)."""
    return evaluate_samples(groups, time_balanced_assignment(by, n_replicas, perf), n_replicas, perf).makespan_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    print(f"one shared pool, {args.batch} × {args.n}, {args.seeds} seeds × {args.steps} steps: "
          "mean speedup over stock verl's least-in-flight (worst step)")
    print(f"{'cell':<16}{'true lengths':>22}{'typical lengths':>24}")
    for setup, (perf_name, R) in SETUPS.items():
        perf = parse_perf_model(perf_name)
        for preset in ("weak", "real", "strong"):
            clairvoyant, typical = [], []
            for seed in range(args.seeds):
                pool, rng = PromptPool(preset, 4096, seed=seed), np.random.default_rng(seed)
                for step in range(args.steps):
                    groups = pool.sample_batch(args.batch, args.n, step, rng)
                    verl = route("verl", groups, R, perf).makespan_s
                    clairvoyant.append(verl / balanced_makespan(groups, singletons(groups), R, perf))
                    predicted = [Group(g.prompt_id, (pool.typical_length(g.prompt_id, step),) * g.n, g.prompt_len)
                                 for g in groups]  # every sample of a prompt at its typical length
                    typical.append(verl / balanced_makespan(groups, singletons(predicted), R, perf))
            print(f"{setup + ' ' + preset:<16}{np.mean(clairvoyant):>14.3f} ({min(clairvoyant):.3f})"
                  f"{np.mean(typical):>16.3f} ({min(typical):.3f})")


if __name__ == "__main__":
    main()
