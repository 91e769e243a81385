"""How far TailSieve's tail signal is from the best a per-prompt predictor could do, at DAPO scale (issue 33).

Per cell (model setup x tail preset x shape) and seed, one ``core.simulation.sim`` run under verl 0.9.1's
rollout defaults (``EngineConfig.verl_defaults``) on a dataset-sized prompt pool (``--pool``, default
17,000 prompts: DAPO-Math-17k, so a prompt recurs once an epoch as in training, not every few steps) of:

* ``verl`` — stock verl 0.9.1 (every sample to the least-loaded replica), the baseline;
* ``tailsieve`` — TailSieve routing-only, adaptive (q, m), as ``tailsieve simulate`` runs it;
* ``prompt-oracle-split`` — the best of a grid of splits per step with each prompt's true typical length
  known (nothing of its samples): what an ideal per-prompt predictor reaches;
* ``group-oracle-split`` — the same grid with this step's true group tokens known: the routing ceiling.

Prints per cell the mean and worst-seed speedup over stock verl, TailSieve's share of the prompt oracle's
gain (where that gain is >= 5 %), the aborted-token share, ``max_deferral_steps`` and the consumed-length KS
distance to stock verl against its noise. Writes one JSON line per run to ``--out``.

    python scripts/experiments/signal_gap.py --seeds 4 --jobs 2 [--cells dense8b-real,...] [--shapes 512x16@32768]
    python scripts/experiments/signal_gap.py --ablation --seeds 4 --cells dense8b-real,dense8b-weak
    python scripts/experiments/signal_gap.py --ceiling --seeds 2 --jobs 1

``--ceiling`` asks whether any fixed split of the partial-rollout mechanism reaches the per-prompt oracle:
``best-static`` beside TailSieve and ``prompt-oracle-split``, whole-run and steady-state (:func:`report_ceiling`).

``--ablation`` runs, per cell and seed, what each signal is worth (:func:`run_ablation`); ``--predictor`` what
a length predictor at the step's start would add in a first epoch, by its quality (:func:`run_predictor`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from strongest_stock import SETUPS
from tailsieve_verl.core.data.workload import PromptPool, get_preset
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.simulation import sim
from tailsieve_verl.core.simulation.runners import predicted_work

POLICIES = ("verl", "tailsieve", "prompt-oracle-split", "group-oracle-split")
CEILING = ("verl", "tailsieve", "best-static", "prompt-oracle-split")  # --ceiling: the mechanism's best fixed split
NOISE = "verl-redraw"  # stock verl on its own length draws: how far a speedup moves by sampling alone
CELLS = tuple(f"{setup}-{preset}" for setup in ("dense", "dense8b", "moe") for preset in ("weak", "real", "strong"))
SHAPES = ("256x16@16384", "512x16@32768")


def cell_setting(job: dict, policies: tuple[str, ...]) -> tuple[sim.SimConfig, object, str, int]:
    """A job's (cell, shape, seed) as the simulation's config (verl's rollout defaults on the cell's model),
    its perf model, its tail preset and its response cap."""
    setup, preset = job["cell"].split("-")
    perf_name, n_replicas, model = SETUPS[setup]
    perf = parse_perf_model(perf_name)
    shape, cap = job["shape"].split("@")
    batch, n = (int(x) for x in shape.split("x"))
    cfg = sim.SimConfig(steps=job["steps"], n_replicas=n_replicas, batch_size=batch, n=n, seed=job["seed"],
                        policies=policies, engine=EngineConfig.verl_defaults(model, perf))
    return cfg, perf, preset, int(cap)


def run(job: dict) -> dict:
    if job.get("ceiling"):
        cfg, perf, preset, cap = cell_setting(job, CEILING)
        cfg = replace(cfg, best_static_grid="coarse")
    else:
        cfg, perf, preset, cap = cell_setting(job, POLICIES + ((NOISE,) if job.get("noise") else ()))
    pool = PromptPool(get_preset(preset, max_response_length=cap), job["pool"], seed=job["seed"])
    t0 = time.process_time()
    result = sim.simulate(cfg, pool, perf)
    bias = result.length_bias()
    return {**job, "cpu_s": time.process_time() - t0,
            "speedup_vs_verl": result.speedup_vs("verl"),
            "steady_speedup_vs_verl": result.speedup_vs("verl", slice(cfg.steps // 3, None)),
            "wasted_fraction": {k: r.wasted_fraction for k, r in result.policies.items()},
            "max_deferral_steps": {k: r.max_deferral_steps for k, r in result.policies.items()},
            "lost_dup_stale": sum(r.lost + r.duplicated + r.stale for r in result.policies.values()),
            "ks": {k: bias[k][0] for k in bias}, "ks_noise": {k: bias[k][1] for k in bias},
            "final_split": [result.policies["tailsieve"].records[-1].next_q, result.policies["tailsieve"].records[-1].next_m],
            "choice": {k: r.choice for k, r in result.policies.items() if r.choice}}


class TrueRankTailSieveRunner(sim.TailSieveRunner):
    """TailSieve whose aborted candidates are scored by their prompt's true typical length (the prompt
    oracle's ranking) instead of their tokens at the abort: the same mechanism, a perfect ranking of its
    candidates. What a better score could add; the candidates themselves are still the unfinished ones."""

    def abort_scores(self, aborted_ids, tokens_at_abort, step):
        return {i: self.pool.typical_length(sim.prompt_of(i), step) * self.cfg.n for i in aborted_ids}


def run_ablation(job: dict) -> dict:
    """What each signal is worth in one cell: TailSieve as it runs (carry; its per-prompt record idle in a
    first epoch of a dataset-sized pool), with its candidates ranked by the truth, with half the aborted
    candidates (``candidate_factor`` 1: less aborted work, less choice), at its best fixed split in
    hindsight (``best-static``, with ``--best-static``: the controller's share of the gap), and on a pool
    of 4 x batch prompts (each prompt back every 4 steps, as in a later epoch: the record at work) as it
    runs and with ``record_replaces_aborts``, each against stock verl on its pool."""
    setting, perf, preset, cap = cell_setting(job, ("verl", "tailsieve", "prompt-oracle-split"))
    out = {**job, "speedup_vs_verl": {}, "wasted_fraction": {}}
    t0 = time.process_time()
    for pool_size, label in ((job["pool"], ""), (4 * setting.batch_size, ", prompts back every 4 steps")):
        cfg = setting
        pool = PromptPool(get_preset(preset, max_response_length=cap), pool_size, seed=job["seed"])
        if not label and job.get("best_static"):
            cfg = replace(cfg, policies=cfg.policies + ("best-static",))
        runners = sim.build_runners(cfg, pool, perf)
        if label:
            runners.append(sim.adaptive_runner(replace(cfg, record_replaces_aborts=True), pool, perf,
                                               "tailsieve, record replaces aborts"))
        else:
            runners.append(TrueRankTailSieveRunner(cfg, pool, perf, cfg.controller, "tailsieve, true candidate ranking",
                                                   planner=sim.planner_for(cfg.controller, cfg, perf)))
            runners.append(sim.adaptive_runner(cfg, pool, perf, "tailsieve, candidate_factor 1",
                                               replace(cfg.controller, candidate_factor=1.0)))
        for t in range(cfg.steps):
            for r in runners:
                r.step(t, keep=False)
        results = {r.name: r.finish() for r in runners}
        base = results["verl"].mean_makespan_s
        out["speedup_vs_verl"].update({name + label: base / r.mean_makespan_s for name, r in results.items()})
        out["wasted_fraction"].update({name + label: r.wasted_fraction for name, r in results.items()})
    out["cpu_s"] = time.process_time() - t0
    return out


PRIOR_SIGMAS = (0.0, 0.25, 0.5, 1.0)


def run_predictor(job: dict) -> dict:
    """What a step-start length signal would be worth in a first epoch: TailSieve with its per-prompt
    record seeded by a predictor of log error sigma (``SimConfig.length_prior_sigma``; 0 = each prompt's
    true typical length), beside the partial-rollout carry (``+ carry``) and instead of it
    (``record_replaces_aborts``: the tail named at the step's start, nothing aborted). ``rho``: the
    predictor's Spearman correlation with each prompt's typical length and with a drawn group's tokens."""
    cfg, perf, preset, cap = cell_setting(job, ("verl", "tailsieve", "prompt-oracle-split"))
    pool = PromptPool(get_preset(preset, max_response_length=cap), job["pool"], seed=job["seed"])
    t0 = time.process_time()
    runners = sim.build_runners(cfg, pool, perf)
    for sigma in PRIOR_SIGMAS:
        for replaces in (False, True):
            c = replace(cfg, length_prior_sigma=sigma, record_replaces_aborts=replaces)
            runners.append(sim.adaptive_runner(c, pool, perf, f"prior sigma {sigma}" + (", no aborts" if replaces else " + carry")))
    for t in range(cfg.steps):
        for r in runners:
            r.step(t, keep=False)
    results = {r.name: r.finish() for r in runners}
    base = results["verl"].mean_makespan_s
    prompts = pool.prompt_ids[:4000]
    typical = [pool.typical_length(p, 0) * cfg.n for p in prompts]
    drawn = [pool.sample_group(p, cfg.n, 0, np.random.default_rng([job["seed"], i])).total_len for i, p in enumerate(prompts)]
    rho = {}
    for sigma in PRIOR_SIGMAS:
        predicted = predicted_work(pool, cfg.n, sigma, cfg.seed)
        rho[str(sigma)] = [float(spearmanr([predicted[p] for p in prompts], truth).statistic) for truth in (typical, drawn)]
    return {**job, "cpu_s": time.process_time() - t0,
            "speedup_vs_verl": {name: base / r.mean_makespan_s for name, r in results.items()},
            "wasted_fraction": {name: r.wasted_fraction for name, r in results.items()}, "rho": rho}


def report_ablation(rows: list[dict]) -> None:
    names = list(dict.fromkeys(k for r in rows for k in r["speedup_vs_verl"] if not k.startswith("verl")))
    for key in sorted({(r["cell"], r["shape"]) for r in rows}):
        cell = [r for r in rows if (r["cell"], r["shape"]) == key]
        print(f"{key[0]} {key[1]}")
        for name in names:
            values = [r["speedup_vs_verl"][name] for r in cell if name in r["speedup_vs_verl"]]
            wasted = [r["wasted_fraction"][name] for r in cell if name in r["wasted_fraction"]]
            if values:
                print(f"  {name:42} {np.mean(values):.3f} (>={min(values):.3f}, {len(values)} seeds)"
                      f"  aborted {100 * np.mean(wasted):4.1f}%")
    print("speedups over stock verl on the same pool: mean over seeds (worst seed); aborted: the aborted-token share")


def report_predictor(rows: list[dict]) -> None:
    """Per cell: TailSieve, the per-prompt oracle, and TailSieve seeded by a predictor of each quality, with
    the carry and without aborts."""
    sigmas = [str(s) for s in PRIOR_SIGMAS]
    print(f"{'cell':16} {'shape':14} {'seeds':>5} {'tailsieve':>9} {'oracle':>7} "
          + " ".join(f"{'s=' + s + ' carry/none':>18}" for s in sigmas))
    for key in sorted({(r["cell"], r["shape"]) for r in rows}):
        cell = [r for r in rows if (r["cell"], r["shape"]) == key]
        mean = lambda name: np.mean([r["speedup_vs_verl"][name] for r in cell])  # noqa: E731
        print(f"{key[0]:16} {key[1]:14} {len(cell):5d} {mean('tailsieve'):9.3f} {mean('prompt-oracle-split'):7.3f} "
              + " ".join(f"{mean(f'prior sigma {s} + carry'):>11.3f} / {mean(f'prior sigma {s}, no aborts'):.3f}"
                         for s in sigmas))
    rho = {s: np.mean([r["rho"][s] for r in rows], axis=0) for s in sigmas}
    print("speedups over stock verl, mean over seeds; s: the predictor's log error sigma (0: each prompt's true typical "
          "length); carry: beside the partial-rollout carry; none: record_replaces_aborts (nothing aborted once the "
          "predictor names the tail). The predictor's Spearman rho with the prompt's typical length / with a drawn "
          "group's tokens: " + ", ".join(f"s={s}: {rho[s][0]:.2f} / {rho[s][1]:.2f}" for s in sigmas))


def report_ceiling(rows: list[dict]) -> None:
    """Whole-run and steady-state (the last two thirds of the steps) speedups: a pinned split defers its
    first step's tail, a one-off gain the steady state leaves out."""
    names = CEILING[1:]
    print(f"{'cell':16} {'shape':14} {'seeds':>5} " + " ".join(f"{n + ' all/steady':>31}" for n in names)
          + f" {'best-static share (steady)':>27}")
    for key in sorted({(r["cell"], r["shape"]) for r in rows}):
        cell = [r for r in rows if (r["cell"], r["shape"]) == key]
        whole = {p: np.mean([r["speedup_vs_verl"][p] for r in cell]) for p in names}
        steady = {p: np.mean([r["steady_speedup_vs_verl"][p] for r in cell]) for p in names}
        gain = steady["prompt-oracle-split"] - 1
        share = f"{100 * (steady['best-static'] - 1) / gain:5.0f}%" if gain >= 0.05 else "n/a"
        print(f"{key[0]:16} {key[1]:14} {len(cell):5d} " + " ".join(f"{whole[p]:>22.3f} / {steady[p]:.3f}" for p in names)
              + f" {share:>27}")
    print("speedups over stock verl, mean over seeds: the whole run / its steady state (steps from a third on); best-static "
          "on the coarse grid (core.simulation.references.static_grid), picked in hindsight on the whole run; share: "
          "best-static's steady-state gain / prompt-oracle-split's where that is >= 5 %")


def report(rows: list[dict]) -> None:
    print(f"{'cell':16} {'shape':14} {'seeds':>5} {'tailsieve':>16} {'prompt-oracle':>16} {'group-oracle':>16} "
          f"{'share':>6} {'aborted':>8} {'defer':>5} {'KS/noise':>9} {'redraw':>13}")
    for key in sorted({(r["cell"], r["shape"]) for r in rows}):
        cell = [r for r in rows if (r["cell"], r["shape"]) == key]
        sp = {p: np.array([r["speedup_vs_verl"][p] for r in cell]) for p in POLICIES[1:]}
        gain = sp["prompt-oracle-split"].mean() - 1
        share = f"{100 * (sp['tailsieve'].mean() - 1) / gain:5.0f}%" if gain >= 0.05 else "   n/a"
        ks = max(r["ks"]["tailsieve"] / r["ks_noise"]["tailsieve"] for r in cell)
        redraw = [r["speedup_vs_verl"][NOISE] for r in cell if NOISE in r["speedup_vs_verl"]]
        noise = f"{np.std(redraw, ddof=1) / np.sqrt(len(redraw)) if len(redraw) > 1 else 0:.3f}" if redraw else "  -"
        print(f"{key[0]:16} {key[1]:14} {len(cell):5d} " + " ".join(
            f"{sp[p].mean():7.3f} (>={sp[p].min():5.3f})" for p in POLICIES[1:]) +
            f" {share:>6} {100 * np.mean([r['wasted_fraction']['tailsieve'] for r in cell]):7.1f}%"
            f" {max(r['max_deferral_steps']['tailsieve'] for r in cell):5d} {ks:9.2f}"
            + (f" {np.mean(redraw):.3f} ±{noise}" if redraw else ""))
    print("speedups over stock verl: mean over seeds (worst seed); share: TailSieve's gain / prompt-oracle-split's "
          "where that is >= 5 %; aborted: TailSieve's aborted-token share; defer: max_deferral_steps; KS/noise: the "
          "largest consumed-length KS distance to stock verl over its noise (bias shows above ~2); redraw (--noise): stock "
          "verl on its own length draws, mean ± its standard error over the seeds: the noise floor of every speedup")
    print(f"lost + duplicated + stale prompts over all runs: {sum(r['lost_dup_stale'] for r in rows)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--shapes", default=",".join(SHAPES), help="BxN@CAP, comma-separated")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pool", type=int, default=17000, help="prompts in the dataset")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="scripts/results/signal_gap/signal_gap.jsonl")
    ap.add_argument("--report-only", action="store_true", help="print the table of --out without running")
    ap.add_argument("--ablation", action="store_true",
                    help="what each signal is worth (run_ablation); default --out signal_gap/ablation.jsonl")
    ap.add_argument("--noise", action="store_true", help="also verl-redraw: the noise floor of the speedups")
    ap.add_argument("--best-static", action="store_true", help="--ablation: also best-static (~70 TailSieve runs)")
    ap.add_argument("--ceiling", action="store_true",
                    help="the mechanism's ceiling: verl, tailsieve, best-static (coarse grid) and prompt-oracle-split, "
                         "whole-run and steady-state; default --out signal_gap/mechanism_ceiling.jsonl")
    ap.add_argument("--predictor", action="store_true",
                    help="what a step-start length predictor would be worth (run_predictor); default --out "
                         "signal_gap/predictor.jsonl")
    args = ap.parse_args()
    mode = "ablation" if args.ablation else "mechanism_ceiling" if args.ceiling else "predictor" if args.predictor else ""
    if mode and args.out == ap.get_default("out"):
        args.out = f"scripts/results/signal_gap/{mode}.jsonl"
    out = Path(args.out)
    work, table = {"ablation": (run_ablation, report_ablation), "mechanism_ceiling": (run, report_ceiling),
                   "predictor": (run_predictor, report_predictor)}.get(mode, (run, report))
    if not args.report_only:
        jobs = [{"cell": c, "shape": s, "seed": seed, "steps": args.steps, "pool": args.pool, "best_static": args.best_static,
                 "noise": args.noise, "ceiling": args.ceiling}
                for s in args.shapes.split(",") for c in args.cells.split(",") for seed in range(args.seeds)]
        out.parent.mkdir(parents=True, exist_ok=True)
        with ProcessPoolExecutor(args.jobs) as workers, out.open("a") as f:
            for row in workers.map(work, jobs):
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(f"{row['cell']} {row['shape']} seed {row['seed']}: tailsieve "
                      f"{row['speedup_vs_verl']['tailsieve']:.3f}x, prompt-oracle "
                      f"{row['speedup_vs_verl']['prompt-oracle-split']:.3f}x ({row['cpu_s']:.0f} CPU s)", flush=True)
    table([json.loads(line) for line in out.read_text().splitlines() if line.strip()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
