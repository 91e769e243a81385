"""Engine model v2 speed: the replica evaluator's time per replica-step under verl 0.9.1's rollout
defaults (vLLM scheduler walked around events) next to today's closed form (no limits), and
``tailsieve simulate`` under verl's defaults with speculation on (issue 21's speed benchmark: 256 x 16
on 8 replicas, 30 steps, every non-clairvoyant policy, each policy timed on its own).

Prints measurements (no pass/fail: machines are noisy). Run from the repo root:
    .venv/bin/python scripts/bench_engine.py [--steps 5] [--workload real] [--perf-model table:h200-dense]
        [--sim-steps 30] [--sim-policies verl,...] (--sim-steps 0 skips the simulate benchmark)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tailsieve_verl.core.engine.engine import EngineConfig, SpeculativeConfig  # noqa: E402
from tailsieve_verl.core.engine.perf import parse_perf_model  # noqa: E402
from tailsieve_verl.core.routing.policies import least_inflight_assignment  # noqa: E402
from tailsieve_verl.core.engine.replica import evaluate_samples  # noqa: E402
from tailsieve_verl.core.simulation.sim import ALL_POLICIES, STOCK_TP, SimConfig, simulate  # noqa: E402
from tailsieve_verl.core.data.workload import PromptPool  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="training steps (fresh batches) to time")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--workload", default="real")
    p.add_argument("--perf-model", default="table:h200-dense")
    p.add_argument("--model", default="qwen3-1.7b", help="bundled H200 shape for the KV capacity")
    p.add_argument("--sim-steps", type=int, default=30, help="steps of the simulate benchmark (0: skip it)")
    p.add_argument("--sim-policies", default=",".join(NON_CLAIRVOYANT),
                   help="policies of the simulate benchmark (default: every non-clairvoyant one)")
    args = p.parse_args()
    perf = parse_perf_model(args.perf_model)
    pool = PromptPool(args.workload, 4 * args.batch, seed=0)
    rng = np.random.default_rng(0)
    verl = EngineConfig.verl_defaults(args.model, perf)
    configs = {
        "today (no limits)": EngineConfig(),
        "max_num_seqs 256 only": EngineConfig(max_num_seqs=256),
        "verl defaults": verl,
        "verl defaults, KV / 8": EngineConfig.verl_defaults(args.model, perf,
                                                            num_gpu_blocks=max(1, verl.num_gpu_blocks // 8)),
        "verl defaults + MTP k=3": EngineConfig.verl_defaults(
            args.model, perf, speculative=SpeculativeConfig(3, (0.85, 0.8, 0.75), acceptance_half_life=85_000,
                                                            draft_cost=1 / 28)),
    }
    print(f"{args.batch} groups x {args.n} on {args.replicas} replicas, workload {args.workload}, {perf.name}; "
          f"verl defaults: max_num_seqs 256, {verl.num_gpu_blocks} KV blocks x 16 ({args.model} at 0.5 of an H200), "
          f"8192-token budget, prefill {verl.prefill_s_per_token * 1e6:.1f} us/token")
    batches = [pool.sample_batch(args.batch, args.n, t, rng) for t in range(args.steps)]
    samples = [least_inflight_assignment(args.batch * args.n, args.replicas, rng=rng) for _ in batches]
    print(f"{'engine':>28} {'CPU s/step':>20} {'replica-steps':>14} {'us/replica-step':>16} "
          f"{'mean makespan':>14} {'preempt/replica':>16} {'queue wait/req':>15}")
    for name, cfg in configs.items():
        start = time.process_time()  # CPU time: the machine may be shared
        evs = [evaluate_samples(g, s, args.replicas, perf, engine=cfg) for g, s in zip(batches, samples)]
        elapsed = time.process_time() - start
        steps = sum(e.steps for ev in evs for e in ev.replica_events)
        preempt = np.mean([e.preemptions for ev in evs for e in ev.replica_events])
        wait = np.mean([e.queue_wait_s for ev in evs for e in ev.replica_events]) / (args.batch * args.n / args.replicas)
        print(f"{name:>28} {elapsed / len(batches):>20.3f} {steps:>14} {elapsed / steps * 1e6:>16.2f} "
              f"{np.mean([ev.makespan_s for ev in evs]):>12.1f} s {preempt:>16.1f} {wait:>13.1f} s")
    if args.sim_steps:
        bench_simulate(args, perf, verl)


NON_CLAIRVOYANT = tuple(name for name in ALL_POLICIES if not name.startswith("clairvoyant") and name != STOCK_TP)


def bench_simulate(args, perf, engine: EngineConfig) -> None:
    """``tailsieve simulate --engine-defaults MODEL`` with every policy given (the speculation policies
    speculate as :data:`core.simulation.sim.DEFAULT_SPECULATION` says), one policy at a time: wall and CPU seconds."""
    pool = PromptPool(args.workload, 2048, seed=0)  # the CLI's --pool-size default
    policies = [name.strip() for name in args.sim_policies.split(",") if name.strip()]
    print(f"\ntailsieve simulate --engine-defaults {args.model}: {args.batch} x {args.n} on {args.replicas} replicas, "
          f"{args.sim_steps} steps, workload {args.workload}, {perf.name}")
    print(f"{'policy':>18} {'wall s':>9} {'CPU s':>9} {'mean makespan':>14}")
    wall_total = cpu_total = 0.0
    for name in policies:
        cfg = SimConfig(steps=args.sim_steps, n_replicas=args.replicas, batch_size=args.batch, n=args.n,
                        policies=(name,), engine=engine)
        wall, cpu = time.perf_counter(), time.process_time()
        result = simulate(cfg, pool, perf, args.workload)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        wall_total, cpu_total = wall_total + wall, cpu_total + cpu
        print(f"{name:>18} {wall:>9.1f} {cpu:>9.1f} {result.policies[name].mean_makespan_s:>12.1f} s", flush=True)
    print(f"{'all':>18} {wall_total:>9.1f} {cpu_total:>9.1f}")


if __name__ == "__main__":
    main()
