"""Stock verl and adaptive TailSieve per (cell, shape, seed), with the controller's prior at its first
outer-loop decision: what a probe rule costs where isolation does not pay (issue 33's "never below 0.99").

Run it at two commits, or with ``--set`` controller settings, to compare probe rules (the rows carry
neither; name the files by them). Cells and settings are ``signal_gap.py``'s (verl 0.9.1's rollout
defaults, a 17,000-prompt pool, 30 steps).

    python scripts/experiments/probe_margin.py --seeds 4 --out rows.jsonl [--set split_window=2]
    python scripts/experiments/probe_margin.py --report before.jsonl after.jsonl
    python scripts/experiments/probe_margin.py --report rows.jsonl --oracle scripts/results/signal_gap/signal_gap.jsonl scripts/results/signal_gap/signal_gap_64x8.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from signal_gap import CELLS, cell_setting  # scripts/experiments/ is this script's import path
from tailsieve_verl.core.data.workload import PromptPool, get_preset
from tailsieve_verl.core.simulation import sim
from tailsieve_verl.core.tailsieve.controller import HierarchicalController

SHAPES = ("512x16@32768", "256x16@16384", "64x8@16384")


def run(cell: str, shape: str, seed: int, pool_size: int, overrides: dict | None = None) -> dict:
    first_prior: list[dict] = []
    real_prior = HierarchicalController._prior

    def spy(self, obs, splits):  # the prior while only one shared pool has been measured
        model, prior = real_prior(self, obs, splits)
        if self.state.m == 0 and set(self.state.splits) == {0} and not first_prior:
            first_prior.append({m: round(v[0], 3) for m, v in prior.items() if m})
        return model, prior

    planned: list = []
    real_planned_outer = HierarchicalController._planned_outer

    def plan_spy(self, obs):  # the split planner's pick, once it has planned
        decision = real_planned_outer(self, obs)
        if self.state.planned is not None and not planned:
            planned.append(self.state.planned)
        return decision

    HierarchicalController._prior, HierarchicalController._planned_outer = spy, plan_spy
    try:
        cfg, perf, preset, cap = cell_setting({"cell": cell, "shape": shape, "seed": seed, "steps": 30}, ("verl", "tailsieve"))
        cfg = replace(cfg, controller=replace(cfg.controller, **(overrides or {})))
        result = sim.simulate(cfg, PromptPool(get_preset(preset, max_response_length=cap), pool_size, seed=seed), perf)
    finally:
        HierarchicalController._prior, HierarchicalController._planned_outer = real_prior, real_planned_outer
    adaptive = result.policies["tailsieve"]
    records = adaptive.records
    ks, ks_noise = result.length_bias()["tailsieve"]
    return {"cell": cell, "shape": shape, "seed": seed, "ts": result.speedup_vs("verl")["tailsieve"],
            "ts_steady": result.speedup_vs("verl", slice(cfg.steps // 3, None))["tailsieve"],
            "split_steps": sum(r.m > 0 for r in records), "first_prior": first_prior[0] if first_prior else None,
            "splits": [[r.q, r.m] for r in records], "wasted": adaptive.wasted_fraction,
            "max_deferral_steps": adaptive.max_deferral_steps, "ks": ks, "ks_noise": ks_noise,
            "lost_dup_stale": adaptive.lost + adaptive.duplicated + adaptive.stale,
            "planned": [planned[0].q, planned[0].m, round(planned[0].relative, 4)] if planned else None}


def report(paths: list[Path]) -> None:
    runs = [[json.loads(line) for line in p.read_text().splitlines() if line.strip()] for p in paths]
    keys = list(dict.fromkeys((r["cell"], r["shape"]) for r in runs[0]))
    print(f"{'cell':16}{'shape':14}" + "".join(f"{p.stem[:22]:>34}" for p in paths))
    below = [0] * len(paths)
    for key in keys:
        cols = []
        for i, rows in enumerate(runs):
            rs = [r for r in rows if (r["cell"], r["shape"]) == key]
            ts = np.array([r["ts"] for r in rs])
            below[i] += ts.mean() < 0.99
            cols.append(f"{ts.mean():.3f} (>={ts.min():.3f}) / {np.mean([r['ts_steady'] for r in rs]):.3f}, "
                        f"{np.mean([r['split_steps'] for r in rs]):4.1f}")
        print(f"{key[0]:16}{key[1]:14}" + "".join(f"{c:>34}" for c in cols))
    print("TailSieve over stock verl: whole-run mean (worst seed) / steady state (steps 10-29), split steps of 30")
    print("cells below 0.99x (whole-run mean): " + ", ".join(f"{p.stem} {n}" for p, n in zip(paths, below)))
    print("mean over all runs: " + ", ".join(f"{p.stem} {np.mean([r['ts'] for r in rows]):.4f}" for p, rows in zip(paths, runs)))


def oracle_report(path: Path, signal_gap_rows: list[Path]) -> None:
    """``path``'s TailSieve against ``signal_gap.py``'s rows of the same seeds: the controller there, and
    the share of prompt-oracle-split's gain where that gain is >= 5 % (issue 33's goal)."""
    ref: dict = {}
    for p in signal_gap_rows:
        for r in map(json.loads, filter(str.strip, p.read_text().splitlines())):
            ref[r["cell"], r["shape"], r["seed"]] = r["speedup_vs_verl"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(f"{'cell':16}{'shape':14}{'seeds':>6}{'before':>8}{'now':>8}{'worst':>8}{'oracle':>8}{'share':>7}"
          f"{'aborted':>9}{'defer':>6}{'KS/noise':>9}  planned (q, m: predicted)")
    for key in dict.fromkeys((r["cell"], r["shape"]) for r in rows):
        rs = [r for r in rows if (r["cell"], r["shape"]) == key and (*key, r["seed"]) in ref]
        if not rs:
            continue
        now = np.array([r["ts"] for r in rs])
        before = np.mean([ref[(*key, r["seed"])]["tailsieve"] for r in rs])
        oracle = np.mean([ref[(*key, r["seed"])]["prompt-oracle-split"] for r in rs])
        share = f"{(now.mean() - 1) / (oracle - 1):.0%}" if oracle >= 1.05 else "-"
        plans = " ".join(f"{q},{m}:{rel:.2f}" for q, m, rel in (r["planned"] or (0, 0, 1.0) for r in rs))
        ks = max(r["ks"] / r["ks_noise"] for r in rs)
        print(f"{key[0]:16}{key[1]:14}{len(rs):6}{before:8.3f}{now.mean():8.3f}{now.min():8.3f}{oracle:8.3f}{share:>7}"
              f"{np.mean([r['wasted'] for r in rs]):9.1%}{max(r['max_deferral_steps'] for r in rs):6}{ks:9.2f}  {plans}")
    print("TailSieve over stock verl, whole run; before: signal_gap.py's rows (the controller without the planned probe);")
    print("share: of prompt-oracle-split's gain where it is >= 5 %; aborted: tokens; defer: max_deferral_steps; KS/noise: worst seed")
    print(f"lost, duplicated or stale prompts: {sum(r['lost_dup_stale'] for r in rows)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1 (to extend rows)")
    ap.add_argument("--pool", type=int, default=17000)
    ap.add_argument("--set", nargs="*", default=[], metavar="KNOB=VALUE",
                    help="ControllerConfig overrides (a Python literal each), e.g. probe_tail_replicas=1")
    ap.add_argument("--out", default="")
    ap.add_argument("--report", nargs="+", type=Path, default=None, metavar="ROWS", help="print saved rows side by side")
    ap.add_argument("--oracle", nargs="+", type=Path, default=None, metavar="SIGNAL_GAP_ROWS",
                    help="with --report: the last rows against signal_gap.py's rows (before, prompt-oracle-split, share)")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        if args.oracle:
            oracle_report(args.report[-1], args.oracle)
        return 0
    if not args.out:
        ap.error("--out ROWS.jsonl is required to run")
    overrides = {key: ast.literal_eval(value) for key, value in (item.split("=", 1) for item in args.set)}
    with open(args.out, "a") as f:
        for shape in args.shapes.split(","):
            for cell in args.cells.split(","):
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    row = run(cell, shape, seed, args.pool, overrides)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
    report([Path(args.out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
