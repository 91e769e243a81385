"""From the second epoch on: TailSieve's steps planned from its per-prompt record, against the per-prompt oracle
(issue 48).

Per cell (model setup x tail preset x shape, as in ``signal_gap.py``) and seed, on a dataset-sized pool
(``--pool``, 17,000 prompts: DAPO-Math-17k) whose lengths grow over training (``--trend``, log growth per
step), the run starts ``--warm`` steps before the second epoch (``SimConfig.start_step``): every prompt of
the first epoch was drawn before, and TailSieve's record holds its lengths measured at the step it was drawn,
as a run's record holds them after its first epoch (the warm steps, still first-epoch prompts, let the
controller measure one shared pool as it does in a first epoch). Then ``--steps`` second-epoch steps of:

* ``verl`` — stock verl 0.9.1, the baseline;
* ``tailsieve`` with ``record_plan`` on — each step planned from the record where it knows the step's prompts;
* ``tailsieve`` with ``record_plan`` off (the default) — its record only ranks candidates;
* ``record-oracle-split`` — the same planner fed each prompt's true length distribution;
* ``prompt-oracle-split`` — the per-prompt oracle of the grid references.

Speedups over stock verl on the second-epoch steps; the record's Spearman ρ (predicted against measured group
work, per step, averaged); TailSieve's share of the oracle's gain where that gain is >= 5 %; the planner's
CPU seconds per step. ``--epoch 3`` measures the third epoch instead (the record has seen every prompt twice).
One JSON line per run to ``--out``::

    python scripts/experiments/record_plan.py --shapes 512x16@32768 --seeds 2 --out record_plan.jsonl
    python scripts/experiments/record_plan.py --report record_plan.jsonl
    python scripts/experiments/record_plan.py --cost > planner_cost.jsonl   # the planner's CPU per step at 512 x 16
    python scripts/experiments/record_plan.py --ceiling --cells dense-weak --shapes 512x16@32768 --out history_oracle.jsonl

``--ceiling`` runs ``verl``, ``prompt-oracle-split`` and ``history-oracle-split`` (the same grid knowing each prompt only
as far as its earlier steps can tell: the most any record of past lengths can plan) on the same draws;
``--ceiling verl,group-oracle-split`` the routing ceiling TailSieve's partial rollout is held to.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np

from signal_gap import CELLS, cell_setting
from tailsieve_verl.core.data.workload import PromptPool, get_preset
from tailsieve_verl.core.simulation import sim, split_planner
from tailsieve_verl.core.simulation.step_split import StepSplitPlanner
from tailsieve_verl.core.tailsieve.cycle import spearman

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the docs' table renderer
from docs_numbers import NOW, later_epochs_table  # noqa: E402

POLICIES = ("verl", "tailsieve", "record-oracle-split", "prompt-oracle-split")
CEILING = ("verl", "prompt-oracle-split", "history-oracle-split")


def _remembered(call):
    """The online planner's pick, once per measured history: both TailSieve runs of a job measure the same
    first-epoch steps, and the planner is deterministic (fixed stream seeds), so the second asks again for nothing."""
    picks = {}

    def plan(self, history, prompt_len):
        key = (self.cfg.n_replicas, self.cfg.batch_size, prompt_len,
               tuple((b.lengths.tobytes(), b.sizes.tobytes()) for b in history))
        if key not in picks:
            picks[key] = call(self, history, prompt_len)
        return picks[key]
    return plan


split_planner.OnlineSplitPlanner.__call__ = _remembered(split_planner.OnlineSplitPlanner.__call__)


def setting(job: dict, policies: tuple[str, ...]):
    """The job's run: its cell's config started ``warm`` steps before the epoch measured (``epoch``, default the
    second), pool, perf model."""
    cfg, perf, preset, cap = cell_setting(job, policies)
    epoch = job["pool"] // cfg.batch_size
    start = (job.get("epoch", 2) - 1) * epoch - job["warm"]  # ``warm`` steps before the epoch measured
    cfg = replace(cfg, start_step=start, steps=job["warm"] + 1 + job["steps"])
    spec = get_preset(preset, max_response_length=cap, length_trend=job["trend"])
    return cfg, (lambda: PromptPool(spec, job["pool"], seed=job["seed"])), perf, epoch


def speedups(job: dict, results: dict) -> dict:
    """Each run's speedup over stock verl on the second epoch's steps (the first one also ends the first epoch)."""
    later = slice(job["warm"] + 1, None)
    base = results["verl"].window_mean_s(later)
    return {name: base / r.window_mean_s(later) for name, r in results.items()}


def ceiling(job: dict) -> dict:
    """The per-prompt oracle and the most any record of past lengths can plan (``history-oracle-split``), on the
    same draws: how much of the oracle's gain a record could reach at all (or ``job["policies"]``)."""
    cfg, pool, perf, epoch = setting(job, tuple(job["policies"].split(",")))
    t0 = time.process_time()
    result = sim.simulate(cfg, pool(), perf)
    return {**job, "cpu_s": time.process_time() - t0, "epoch_steps": epoch,
            "speedup_vs_verl": speedups(job, result.policies),
            "rho": rho_ladder(pool(), cfg.n, cfg.start_step + job["warm"], epoch, job["seed"])}


def rho_ladder(pool: PromptPool, n: int, step: int, epoch: int, seed: int, prompts: int = 2048) -> dict:
    """Spearman ρ of predicted against drawn group work at ``step`` (an epoch's first), for what each predictor
    knows: the prompt under this step's policy (``truth``), all its history can tell (``history``), and one group
    drawn an epoch earlier (``one_visit``: the record's raw input after one epoch)."""
    rng = np.random.default_rng([seed, 48])
    ids = pool.prompt_ids[:prompts]
    drawn = [sum(g.lengths) for g in pool.sample_groups(ids, n, step, rng)]
    known = {"truth": [sum(pool.typical_group(p, n, step).lengths) for p in ids],
             "history": [sum(pool.typical_group(p, n, step, history_only=True).lengths) for p in ids],
             "one_visit": [sum(g.lengths) for g in pool.sample_groups(ids, n, step - epoch, rng)]}
    return {name: float(spearman(x, drawn)) for name, x in known.items()}


def run(job: dict) -> dict:
    cfg, pool, perf, epoch = setting(job, POLICIES)
    t0 = time.process_time()
    main = sim.simulate(replace(cfg, controller=replace(cfg.controller, record_plan=True)), pool(), perf)
    off = sim.simulate(replace(cfg, policies=("tailsieve",), controller=replace(cfg.controller, record_plan=False)),
                       pool(), perf)
    results = {**main.policies, NOW: off.policies["tailsieve"]}
    later = slice(job["warm"] + 1, None)
    out = {**job, "cpu_s": time.process_time() - t0, "epoch_steps": epoch, "speedup_vs_verl": speedups(job, results)}
    for name in ("tailsieve", "record-oracle-split"):
        records = results[name].records[later]
        rhos = [r.record_rho for r in records if r.record_rho is not None]
        out[name] = {"record_rho": float(np.mean(rhos)) if rhos else None,
                     "planned_steps": sum(r.record_planned for r in records),
                     "split_steps": sum(r.m > 0 for r in records),
                     "max_deferral_steps": results[name].max_deferral_steps,
                     "aborted_share": results[name].wasted_fraction,
                     "lost": results[name].lost, "duplicated": results[name].duplicated}
    out[NOW] = {"aborted_share": results[NOW].wasted_fraction, "max_deferral_steps": results[NOW].max_deferral_steps}
    return out


def report(paths: list[str]) -> None:
    print("Epochs >= 2 (second-epoch steps; speedup over stock verl, mean over seeds [worst seed]); share = TailSieve's "
          "gain / prompt-oracle-split's where that is >= 5 %")
    print(later_epochs_table(tuple(Path(p) for p in paths)))


def planner_cost(repeats: int) -> None:
    """CPU seconds of one step's plan at 512 x 16 (dense8b, verl's defaults, real tails, 32k cap), on the typical
    groups alone and on the record's draws of its error (spread 0.3, about what the runs above measure)."""
    for replicas in (8, 16):
        job = {"cell": "dense8b-real", "shape": "512x16@32768", "seed": 0, "steps": 1}
        cfg, perf, preset, cap = cell_setting(job, ("verl",))
        pool = PromptPool(get_preset(preset, max_response_length=cap), 512 * repeats, seed=0)
        planner = StepSplitPlanner(replicas, 512, perf, (cfg.engine, cfg.engine))
        for spread in (0.0, 0.3):
            costs = []
            for k in range(repeats):
                groups = [pool.typical_group(pid, 16, k) for pid in pool.prompt_ids[k * 512:(k + 1) * 512]]
                start = time.process_time()
                pick = planner(groups, spread)
                costs.append(time.process_time() - start)
            print(json.dumps({"replicas": replicas, "spread": spread, "steps": repeats, "cpu_s_mean": float(np.mean(costs)),
                              "cpu_s_min": min(costs), "cpu_s_max": max(costs),
                              "last_pick": [pick.q, pick.m, round(pick.relative, 4)]}), flush=True)


def map_to_jsonl(fn, jobs: list[dict], workers: int, out: str | None, shown: tuple[str, ...] = ()) -> None:
    """``fn`` on every job in ``workers`` processes: each result printed (its ``shown`` keys, or all) and appended to
    ``out`` as one JSON line as it comes."""
    with open(out, "a") if out else nullcontext() as sink, ProcessPoolExecutor(workers) as ex:
        for r in ex.map(fn, jobs):
            print(json.dumps({k: r[k] for k in shown} if shown else r), flush=True)
            if sink:
                sink.write(json.dumps(r) + "\n")
                sink.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--shapes", default="512x16@32768")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--steps", type=int, default=12, help="second-epoch steps")
    ap.add_argument("--warm", type=int, default=3, help="first-epoch steps simulated before them")
    ap.add_argument("--trend", type=float, default=0.004, help="log length growth per step (0.004: x1.14 an epoch "
                                                                "of 33 steps)")
    ap.add_argument("--pool", type=int, default=17000)
    ap.add_argument("--epoch", type=int, default=2, help="the epoch measured (>= 2): the record has measured each "
                                                         "prompt epoch - 1 times")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--report", nargs="+")
    ap.add_argument("--cost", type=int, nargs="?", const=4, help="time the planner on this many steps")
    ap.add_argument("--ceiling", nargs="?", const=",".join(CEILING),
                    help="run these policies instead (default " + ",".join(CEILING) + "), and the rho ladder")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return 0
    if args.cost:
        planner_cost(args.cost)
        return 0
    jobs = [{"cell": c, "shape": s, "seed": k, "steps": args.steps, "warm": args.warm, "trend": args.trend,
             "pool": args.pool, "epoch": args.epoch, **({"policies": args.ceiling} if args.ceiling else {})} for s in args.shapes.split(",") for c in args.cells.split(",")
            for k in range(args.first_seed, args.first_seed + args.seeds)]
    map_to_jsonl(ceiling if args.ceiling else run, jobs, args.jobs, args.out,
                 shown=("cell", "shape", "seed", "cpu_s", "speedup_vs_verl"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
