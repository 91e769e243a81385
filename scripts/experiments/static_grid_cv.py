"""How much of best-static is hindsight on the stream: every static split, cross-validated over seeds.

``best-static`` (``controller_v2_eval.py``) picks the best fixed (q, m) on the very stream it is scored
on. This runs **every** split of ``sim.static_grid`` to the end (no screening) on each seed, under
``--draws`` sets of regeneration draws, next to adaptive TailSieve, and prints per cell:

* per-seed best: the best split on draw 0 of that seed, scored on the other draws (out of sample);
* cross-validated: the split with the best mean over the *other* seeds (draw 0), scored on this seed's
  other draws — a split a user could have fixed in advance for this workload;
* adaptive on the other draws, and its ratio to both;
* with ``--plan-traces K``: the fixed split ``tailsieve plan`` picks from each of K logged stock-verl
  runs (``--plan-log-steps`` steps of the cell's preset on prompt pools of their own), scored on this grid.

``--dapo SHAPE@CAP`` runs ``signal_gap.py``'s DAPO-sized cells instead (verl 0.9.1's rollout defaults, a
17,000-prompt pool, dense8b among the setups), on the coarse grid, optionally cut to ``--tail-sizes``. With
``--draws 1`` the per-seed best is scored on the draw it was chosen on (hindsight) and the cross-validated
split on this seed's own draw (chosen on the other seeds: out of sample).

    python scripts/experiments/static_grid_cv.py --cells dense-weak --batch 256 --n 16 --seeds 0,1,2,3,4,5,6,7 --out cv.json
    python scripts/experiments/static_grid_cv.py --table-only cv.json --plan-traces 6
    python scripts/experiments/static_grid_cv.py --dapo 512x16@32768 --tail-sizes 1,2 --draws 1 --cells dense-weak --seeds 0,1,2,3,4,5

Recorded results: scripts/results/adaptive_vs_best_static_split/; every table and its command: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from controller_v2_eval import cell_parts, cell_setup  # scripts/experiments/ is this script's import path
from signal_gap import cell_setting
from tailsieve_verl.core.simulation import sim
from tailsieve_verl.core.simulation.planner import plan_from_trace
from tailsieve_verl.core.data.workload import PromptPool, WorkloadSpec, generate_trace, get_preset


def dapo_cell(job: dict) -> tuple[sim.SimConfig, object, WorkloadSpec]:
    """signal_gap's DAPO-sized cell at ``job["dapo"]`` (its shape): config, perf model and capped workload."""
    cfg, perf, preset, cap = cell_setting({**job, "shape": job["dapo"]}, ("verl",))
    return cfg, perf, get_preset(preset, max_response_length=cap)


def setup(job: dict) -> tuple[sim.SimConfig, PromptPool, object, list[tuple[int, int]]]:
    """The job's config, pool, perf model and static splits: controller_v2_eval's cells, or signal_gap's
    DAPO-sized ones on the coarse grid (``job["dapo"]`` = its shape), m cut to ``job["tail_sizes"]``."""
    if job.get("dapo"):
        cfg, perf, workload = dapo_cell(job)
        pool = PromptPool(workload, job["pool"], seed=job["seed"])
    else:
        cfg, pool, perf = cell_setup(job, policies=("verl",))
    grid = sim.static_grid(cfg.n_replicas, cfg.batch_size, cfg.controller.max_q_fraction, coarse=bool(job.get("dapo")))
    sizes = job.get("tail_sizes")
    return cfg, pool, perf, [s for s in grid if not sizes or s[1] == 0 or s[1] in sizes]


def run(job: dict) -> dict:
    cfg, pool, perf, splits = setup(job)
    runners = sim.build_runners(cfg, pool, perf)
    for k in range(job["draws"]):
        drawn = replace(cfg, regeneration_draws=k)
        runners.append(sim.adaptive_runner(drawn, pool, perf, f"adaptive|{k}"))
        runners += [sim.static_split_runner(drawn, pool, perf, split, f"{split[0]},{split[1]}|{k}") for split in splits]
    for t in range(cfg.steps):
        for runner in runners:
            runner.step(t, keep=False)
    results = {runner.name: runner.finish() for runner in runners}
    base = results["verl"].mean_makespan_s
    return {"cell": job["cell"], "seed": job["seed"], "dapo": job.get("dapo", ""),
            "speedup": {name: base / r.mean_makespan_s for name, r in results.items() if name != "verl"}}


def plan_pick(job: dict) -> dict:
    """The fixed split ``tailsieve plan`` picks from a logged stock-verl run of the cell's preset (with ``dapo``:
    signal_gap's cell, its response cap and verl's rollout defaults)."""
    if job.get("dapo"):
        cfg, perf, workload = dapo_cell(job)
        logged = generate_trace(workload, job["log_steps"] * cfg.batch_size, cfg.n, seed=job["seed"])
        plan = plan_from_trace(logged, cfg.n_replicas, perf, batch_size=cfg.batch_size, steps=job["steps"],
                               engine=cfg.engine)
    else:
        preset, perf, n_replicas = cell_parts(job["cell"])
        logged = generate_trace(preset, job["log_steps"] * job["batch"], job["n"], seed=job["seed"])
        plan = plan_from_trace(logged, n_replicas, perf, batch_size=job["batch"], steps=job["steps"])
    return {"cell": job["cell"], "trace_seed": job["seed"], "log_steps": job["log_steps"], "split": f"{plan.fixed_q},{plan.fixed_m}",
            "predicted": plan.fixed_speedup}


def summarise(rows: list[dict], picks: list[dict]) -> None:
    for cell in dict.fromkeys(r["cell"] for r in rows):
        cr = [r for r in rows if r["cell"] == cell]
        draws = sorted({int(k.split("|")[1]) for k in cr[0]["speedup"]})
        scoring = draws[1:] or draws  # one draw: the per-seed best is scored in hindsight, on its own draw
        splits = [k.split("|")[0] for k in cr[0]["speedup"] if k.endswith("|0") and not k.startswith("adaptive")]
        chosen_on = np.array([[r["speedup"][f"{s}|0"] for s in splits] for r in cr])  # seeds × splits
        scored = np.array([[np.mean([r["speedup"][f"{s}|{k}"] for k in scoring]) for s in splits] for r in cr])
        adaptive = np.array([np.mean([r["speedup"][f"adaptive|{k}"] for k in scoring]) for r in cr])
        own = chosen_on.argmax(axis=1)
        others = [np.delete(chosen_on, i, axis=0).mean(axis=0).argmax() for i in range(len(cr))]
        per_seed, cross = scored[np.arange(len(cr)), own], scored[np.arange(len(cr)), others]

        def ratio(a: np.ndarray, b: np.ndarray) -> str:
            x = a / b
            return f"{x.mean():.3f} ± {x.std(ddof=1) / np.sqrt(len(x)):.3f}"

        print(f"{' '.join(filter(None, (cell, cr[0].get('dapo'))))}, {len(cr)} seeds, {len(splits)} splits, scored on draws {scoring}"
              f"{' (per-seed best in hindsight)' if len(draws) == 1 else ''}: speedup vs stock verl")
        print(f"  per-seed best static {per_seed.mean():.3f} (on its own draw {chosen_on.max(axis=1).mean():.3f}); "
              f"cross-validated static {cross.mean():.3f} (splits {sorted({splits[i] for i in others})}); "
              f"adaptive {adaptive.mean():.3f}")
        print(f"  adaptive / per-seed best {ratio(adaptive, per_seed)}; adaptive / cross-validated "
              f"{ratio(adaptive, cross)}; cross-validated / per-seed best {ratio(cross, per_seed)}")
        for i, r in enumerate(cr):
            print(f"    seed {r['seed']:>4}: best {splits[own[i]]:>6} {per_seed[i]:.3f}, cross-validated "
                  f"{splits[others[i]]:>6} {cross[i]:.3f}, adaptive {adaptive[i]:.3f}")
        for pick in (p for p in picks if p["cell"] == cell):
            if pick["split"] not in splits:
                print(f"  `tailsieve plan` on logged run {pick['trace_seed']}: pin {pick['split']} (predicted "
                      f"{pick['predicted']:.3f}), not among the scored splits")
                continue
            pinned = scored[:, splits.index(pick["split"])]
            print(f"  `tailsieve plan` on logged run {pick['trace_seed']} ({pick['log_steps']} steps): pin {pick['split']:>6} (predicted "
                  f"{pick['predicted']:.3f}): {pinned.mean():.3f}, / per-seed best {ratio(pinned, per_seed)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="dense-weak")
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7", help="comma-separated stream seeds")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--pool", type=int, default=0, help="prompts in the pool (default 4096, with --dapo 17,000)")
    ap.add_argument("--draws", type=int, default=3, help="sets of regeneration draws (draw 0 chooses)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="")
    ap.add_argument("--plan-traces", type=int, default=0, help="also score the split `tailsieve plan` picks "
                    "from this many logged stock-verl runs of each cell (prompt pools 1000, 1001, ...)")
    ap.add_argument("--plan-log-steps", type=int, default=4, help="steps of each logged run (of --batch prompts)")
    ap.add_argument("--table-only", default="", help="summarise a saved JSON (and plan picks) and exit")
    ap.add_argument("--dapo", default="", metavar="SHAPE@CAP", help="signal_gap.py's DAPO-sized cells at this shape, "
                    "e.g. 512x16@32768 (a 17,000-prompt pool unless --pool; --batch and --n are ignored)")
    ap.add_argument("--tail-sizes", default="", help="only the static splits with these tail sizes m (comma-separated; m = 0 is always kept)")
    args = ap.parse_args()
    cells = args.cells.split(",")
    pool = args.pool or (17000 if args.dapo else 4096)
    sizes = [int(m) for m in args.tail_sizes.split(",") if m]
    jobs = [dict(cell=c, seed=int(s), steps=args.steps, batch=args.batch, n=args.n, pool=pool, draws=args.draws,
                 dapo=args.dapo, tail_sizes=sizes) for c in cells for s in args.seeds.split(",")]
    plans = [dict(cell=c, seed=1000 + k, steps=args.steps, batch=args.batch, n=args.n, log_steps=args.plan_log_steps,
                  dapo=args.dapo)
             for c in cells for k in range(args.plan_traces)]
    with ProcessPoolExecutor(args.jobs) as ex:
        picks = list(ex.map(plan_pick, plans))
        rows = json.loads(Path(args.table_only).read_text()) if args.table_only else list(ex.map(run, jobs))
    if args.out and not args.table_only:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    summarise(rows, picks)


if __name__ == "__main__":
    main()
