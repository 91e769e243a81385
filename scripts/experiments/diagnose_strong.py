"""Why TailSieve trails the oracle: the mechanism's ceiling vs the controller's error.

For each setup (dense: 8 replicas on the H200 dense calibration; MoE: 4 on the MoE one) and seed,
on one prompt stream:

* **hindsight grid** — the partial-rollout mechanism (selector + pools, no controller) with every
  static (q, m) of a grid; the best static point is what a perfect controller could reach;
* the adaptive controller (``tailsieve``) and the length-knowing ``oracle``;
* **tail-signal quality** — precision of the carried groups: the share of the T regenerated groups
  that are among the T longest (by group max) of the B groups consumed that step; random picking
  scores T / B;
* **makespan breakdown** — mean tail-pool time, bulk cutoff (or the shared pool's end) and the
  share of steps each pool was the bottleneck.

    python scripts/experiments/diagnose_strong.py [--workload strong] [--setups dense,moe] [--seeds 2] [--steps 20]

Recorded results: scripts/results/strong_tails_ceiling/; every table and its command: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tailsieve_verl.core.tailsieve.controller import ControllerConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.simulation.sim import PolicyResult, SimConfig, simulate
from tailsieve_verl.core.data.workload import PromptPool, WorkloadSpec, get_preset

SETUPS = {"dense": ("table:h200-dense", 8), "moe": ("table:h200-moe", 4)}
Q_GRID = (1, 2, 4, 6, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class Job:
    setup: str
    workload: str
    seed: int
    steps: int
    batch: int
    n: int
    pool: int
    q: int | None = None  # None: the adaptive policies (uniform, tailsieve, oracle)
    m: int | None = None
    sampling_share: float | None = None  # None: the preset's; the rest of its share moves to the prompt

    def workload_spec(self) -> WorkloadSpec:
        spec = get_preset(self.workload)
        if self.sampling_share is None:
            return spec
        moved = spec.sampling_share - self.sampling_share
        return replace(spec, sampling_share=self.sampling_share, prompt_share=spec.prompt_share + moved)


def tail_precision(result: PolicyResult, n: int, window: slice) -> float:
    """Mean share of regenerated groups that are among the step's top-T consumed groups by max length."""
    hits, total = 0, 0
    for rec in result.records[window]:
        if rec.n_tail == 0:
            continue
        gmax = np.asarray(rec.consumed_lengths).reshape(-1, n).max(axis=1)
        top = set(np.argsort(-gmax, kind="stable")[:rec.n_tail].tolist())
        hits += sum(i in top for i in range(rec.n_tail))
        total += rec.n_tail
    return hits / total if total else float("nan")


def breakdown(result: PolicyResult, window: slice) -> dict:
    recs = result.records[window]
    tail = np.array([r.tail_s for r in recs])
    bulk = np.array([r.bulk_s for r in recs])
    return {"makespan_s": float(np.mean([r.makespan_s for r in recs])), "tail_s": float(tail.mean()),
            "bulk_s": float(bulk.mean()), "tail_bound_share": float(np.mean(tail > bulk)),
            "n_tail": float(np.mean([r.n_tail for r in recs])), "m": float(np.mean([r.m for r in recs]))}


def run_job(job: Job) -> tuple[Job, dict]:
    spec, replicas = SETUPS[job.setup]
    perf = parse_perf_model(spec)
    window = slice(job.steps // 4, None)
    if job.q is None:
        policies, ctl, fixed = ("uniform", "tailsieve", "clairvoyant-group"), ControllerConfig(), None
    else:
        policies = ("tailsieve-fixed",)
        ctl, fixed = ControllerConfig(q_init=job.q, inner_loop=False), job.m
    cfg = SimConfig(steps=job.steps, n_replicas=replicas, batch_size=job.batch, n=job.n, seed=job.seed,
                    policies=policies, fixed_tail_replicas=fixed, controller=ctl)
    result = simulate(cfg, PromptPool(job.workload_spec(), job.pool, seed=job.seed), perf, job.workload)
    out = {}
    for name, r in result.policies.items():
        out[name] = breakdown(r, window) | {"precision": tail_precision(r, job.n, window)}
    return job, out


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="strong")
    ap.add_argument("--setups", default="dense,moe")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--pool", type=int, default=2048)
    ap.add_argument("--q-grid", default=",".join(map(str, Q_GRID)))
    ap.add_argument("--sampling-share", type=float, default=None,
                    help="override the share of length variance from sampling noise (the rest goes to the prompt); "
                         "0 = a perfectly persistent tail signal")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="experiments_out")
    args = ap.parse_args()
    q_grid = [int(x) for x in args.q_grid.split(",") if int(x) <= args.batch // 2]
    jobs = []
    for setup in args.setups.split(","):
        replicas = SETUPS[setup][1]
        for seed in range(args.seeds):
            base = Job(setup, args.workload, seed, args.steps, args.batch, args.n, args.pool,
                       sampling_share=args.sampling_share)
            jobs.append(base)
            jobs += [Job(**{**base.__dict__, "q": q, "m": m}) for m in range(1, replicas) for q in q_grid]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as ex:
        done = list(ex.map(run_job, jobs))
    report: dict = {"args": vars(args), "setups": {}}
    rows, grid_rows = [], []
    for setup in args.setups.split(","):
        replicas = SETUPS[setup][1]
        per_seed = []
        for seed in range(args.seeds):
            adaptive = next(o for j, o in done if j.setup == setup and j.seed == seed and j.q is None)
            base = adaptive["uniform"]["makespan_s"]
            grid = {(j.q, j.m): o["tailsieve-fixed"] for j, o in done
                    if j.setup == setup and j.seed == seed and j.q is not None}
            per_seed.append({"adaptive": adaptive, "grid": {f"{q},{m}": v for (q, m), v in grid.items()},
                             "uniform_s": base})
        report["setups"][setup] = per_seed
        mean_uniform = np.mean([s["uniform_s"] for s in per_seed])
        keys = per_seed[0]["grid"].keys()
        grid_mean = {k: np.mean([s["grid"][k]["makespan_s"] for s in per_seed]) for k in keys}
        best_key = min(grid_mean, key=grid_mean.get)
        per_m = {}
        for k, v in grid_mean.items():
            q, m = map(int, k.split(","))
            if m not in per_m or v < grid_mean[per_m[m]]:
                per_m[m] = k
        for m in sorted(per_m):
            k = per_m[m]
            g = [s["grid"][k] for s in per_seed]
            grid_rows.append([setup, m, k.split(",")[0], f"{mean_uniform / grid_mean[k]:.3f}",
                              f"{np.mean([x['tail_s'] for x in g]):.1f}", f"{np.mean([x['bulk_s'] for x in g]):.1f}",
                              f"{np.mean([x['tail_bound_share'] for x in g]):.0%}",
                              f"{np.mean([x['precision'] for x in g]):.2f}"])
        best = [s["grid"][best_key] for s in per_seed]
        for name in ("uniform", "tailsieve", "clairvoyant-group"):
            vals = [s["adaptive"][name] for s in per_seed]
            rows.append([setup, name, f"{np.mean([v['makespan_s'] for v in vals]):.1f}",
                         f"{mean_uniform / np.mean([v['makespan_s'] for v in vals]):.3f}",
                         f"{np.mean([v['tail_s'] for v in vals]):.1f}", f"{np.mean([v['bulk_s'] for v in vals]):.1f}",
                         f"{np.mean([v['tail_bound_share'] for v in vals]):.0%}",
                         f"{np.mean([v['n_tail'] for v in vals]):.1f} / {np.mean([v['m'] for v in vals]):.1f}",
                         "" if name != "tailsieve" else f"{np.mean([v['precision'] for v in vals]):.2f}"])
        rows.append([setup, f"best static ({best_key})", f"{grid_mean[best_key]:.1f}",
                     f"{mean_uniform / grid_mean[best_key]:.3f}", f"{np.mean([v['tail_s'] for v in best]):.1f}",
                     f"{np.mean([v['bulk_s'] for v in best]):.1f}",
                     f"{np.mean([v['tail_bound_share'] for v in best]):.0%}", best_key.replace(",", " / "),
                     f"{np.mean([v['precision'] for v in best]):.2f}"])
    noise = "" if args.sampling_share is None else f", sampling share {args.sampling_share:g}"
    print(f"\n### {args.workload} tails{noise}: adaptive vs hindsight-best static (q, m) vs oracle "
          f"(B={args.batch}×{args.n}, {args.steps} steps, {args.seeds} seeds, steps ≥ {args.steps // 4})\n")
    print(_table(["setup", "policy", "makespan s", "speedup", "tail pool s", "bulk cutoff / shared s",
                  "tail-bound steps", "T / m", "tail precision"], rows))
    print("\n### Best static q per tail-pool size m\n")
    print(_table(["setup", "m", "best q", "speedup", "tail pool s", "bulk cutoff s", "tail-bound steps",
                  "tail precision"], grid_rows))
    print(f"\n(random picking scores tail precision T/B; {len(jobs)} runs in {time.perf_counter() - t0:.0f} s)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    suffix = "" if args.sampling_share is None else f"_sampling{args.sampling_share:g}"
    (Path(args.out) / f"diagnose_{args.workload}{suffix}.json").write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
