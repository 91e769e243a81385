"""At worst, stock verl (issue 56): the default controller against stock verl per (cell, shape, seed, epoch), under the
controller's judge of a split and under the judge it replaced, on the same length draws.

The judge: a split step's makespan over stock verl's price of what the step *pulled* (its consumed fresh groups as
measured, its aborted groups run to their end with each cut sample's length drawn past its abort from the run's own
finished and cut samples: ``HierarchicalController.stock_price_s``), not over the price of the batch it consumed,
which the carry fills with the last step's slowest groups; a planned split is probed only where its predicted gain
clears ``probe_z`` standard errors of the plan, and left as soon as its fair relative makespan resolves a loss
against one shared pool's. ``--rule old`` runs the judge it replaced (the consumed batch's price alone, no standard
errors) on the same draws.

Per run: the speedup over stock verl over a whole 30-step run that starts at the epoch's first step (epoch 1: no
prompt recurs; 2: every prompt ran once an epoch earlier and lengths have grown with the trend): a run measured from
the controller's first step carries no work into its window from steps outside it (``window_mean_s`` pays carried-in
work, not credits it), the split steps, the most steps a prompt waited, lost/duplicated/stale prompts, and on the split steps: ``truth`` (their makespans over stock verl's on
the same steps), ``consumed_read`` (their makespans over the consumed batches' price, over one shared pool's measured
ratio: what the old judge saw) and ``fair_read`` (the same over stock verl's price of the pulls: what the new judge
sees). One JSON line per run::

    python scripts/experiments/judge_check.py --shapes 64x8@16384 --seeds 24 --epochs 1,2 --rules new,old --jobs 2 \
        --out scripts/results/at_worst_stock_verl/judge_64x8.jsonl      # and 256x16@16384, 512x16@32768 at 8 seeds
    python scripts/experiments/judge_check.py --report scripts/results/at_worst_stock_verl/judge_*.jsonl
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from record_plan import map_to_jsonl, setting
from signal_gap import CELLS
from tailsieve_verl.core.simulation import sim, split_planner
from tailsieve_verl.core.tailsieve import controller as ctl
from tailsieve_verl.core.tailsieve.fluid import ConsumedBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the docs' table renderer
from docs_numbers import judge_table  # noqa: E402

_seen: list[dict] = []  # every split step the controllers of this process measured (the tap below)


def _tap(measure):
    """Each measured split step's makespan and both prices (read only)."""
    def tapped(self, obs, consumed):
        if obs.m > 0 and obs.tail_groups and obs.aborted_groups:
            _seen.append({"controller": self, "step": self.state.steps, "makespan_s": obs.makespan_s,
                          "consumed_price": self.yardstick_s(consumed, obs.prompt_len),
                          "fair_price": self.stock_price_s(obs)})
        return measure(self, obs, consumed)
    return tapped


ctl.HierarchicalController._measure_split = _tap(ctl.HierarchicalController._measure_split)
_plans: list = []  # every plan the planners of this process made (the tap below)


def _tap_plans(plan):
    """Each plan the planner returns (read only)."""
    def tapped(self, *args):
        _plans.append(plan(self, *args))
        return _plans[-1]
    return tapped


split_planner.OnlineSplitPlanner.__call__ = _tap_plans(split_planner.OnlineSplitPlanner.__call__)


def _old_rule(config: ctl.ControllerConfig) -> ctl.ControllerConfig:
    """The judge the controller had before: no standard errors, and no fair price to leave on (patched below)."""
    return replace(config, probe_z=0.0)


def run(job: dict) -> dict:
    cfg, pool, perf, _ = setting(job, ("verl", "tailsieve"))
    controller = replace(cfg.controller, record_plan=False)
    old = job["rule"] == "old"
    cfg = replace(cfg, policies=("verl", "verl-redraw", "tailsieve"), controller=_old_rule(controller) if old else controller)
    real_fair_loss = ctl.HierarchicalController._fair_loss_resolved
    if old:
        ctl.HierarchicalController._fair_loss_resolved = lambda self, split, shared: False
    _seen.clear()
    _plans.clear()
    try:
        result = sim.simulate(cfg, pool(), perf)
    finally:
        ctl.HierarchicalController._fair_loss_resolved = real_fair_loss
    stock, ts = result.policies["verl"], result.policies["tailsieve"]
    out = {**job, "speedup_vs_verl": stock.mean_makespan_s / ts.mean_makespan_s,
           "redraw_vs_verl": stock.mean_makespan_s / result.policies["verl-redraw"].mean_makespan_s,
           "split_steps": sum(r.m > 0 for r in ts.records), "max_deferral_steps": ts.max_deferral_steps,
           "lost_dup_stale": ts.lost + ts.duplicated + ts.stale,
           **({"plan": [_plans[-1].relative, _plans[-1].spread, _plans[-1].q, _plans[-1].m]} if _plans else {})}
    # the run's own controller: the one that measured the most split steps (the planner's run a few steps each)
    by_controller: dict[int, list] = {}
    for s in _seen:
        by_controller.setdefault(id(s["controller"]), []).append(s)
    steps = max(by_controller.values(), key=len, default=[])
    shared_record = steps[0]["controller"].state.splits.get(0) if steps else None
    shared = shared_record.fair.mean if shared_record is not None and shared_record.fair.n else None
    if steps and shared:
        makespan = sum(s["makespan_s"] for s in steps)
        out.update(truth=makespan / sum(stock.records[s["step"] - 1].makespan_s for s in steps),
                   consumed_read=makespan / sum(s["consumed_price"] for s in steps) / shared,
                   fair_read=makespan / sum(s["fair_price"] for s in steps) / shared)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--shapes", default="64x8@16384")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--epochs", default="1,2", help="runs of 30 steps from the first step of these epochs")
    ap.add_argument("--rules", default="new", help="new (the controller's judge), old (the one it replaced), or both")
    ap.add_argument("--trend", type=float, default=0.004)
    ap.add_argument("--pool", type=int, default=17000)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--report", nargs="+")
    args = ap.parse_args()
    if args.report:
        print(judge_table(tuple(Path(p) for p in args.report)))
        return 0
    jobs = []
    for epoch in map(int, args.epochs.split(",")):
        for shape in args.shapes.split(","):
            for cell in args.cells.split(","):
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    for rule in args.rules.split(","):
                        jobs.append({"cell": cell, "shape": shape, "seed": seed, "epoch": epoch, "rule": rule,
                                     "trend": args.trend, "pool": args.pool, "warm": 0, "steps": 29})
    map_to_jsonl(run, jobs, args.jobs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
