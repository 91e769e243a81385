"""Does the controller's yardstick see what a split costs against stock verl? (issue 48: a seed below stock verl)

The controller judges a step by its makespan over the **yardstick**: the perf model's one-shared-pool time of the
groups the step *consumed* (``HierarchicalController.yardstick_s``). A split step consumes the groups its carry
regenerates (the slowest of the step before) beside the fresh ones, so its batch is not the batch stock verl runs
at that step: the carry moves prompts between steps, and the yardstick, priced on the step's own batch, cannot see
what that move costs or saves.

Per run (``record_plan.py``'s later-epoch setup, record planning off: the default controller; ``--epoch 1``: the
run's first steps), on TailSieve's split steps (a tail pool and aborts) past the warm ones, the same perf model
prices three batches per step:

* ``consumed``: the groups the step consumed (the controller's yardstick);
* ``pulled``: the fresh prompts the step pulled, the aborted ones at the lengths their regeneration measured a
  step later (the dataloader's batch, every prompt of it consumed within a step);
* ``stock``: stock verl's own batch at that step, on the same draws.

``truth`` = TailSieve's makespans over stock verl's on those steps. The controller's verdict on the split against
stock verl is ``truth * stock / consumed``: ``consumed / stock`` above 1 is how far its yardstick flatters the
split on that run, below 1 how far it undersells it. One JSON line per run::

    python scripts/experiments/yardstick_check.py --cells dense-weak,dense8b-weak --shapes 64x8@16384 --seeds 24 \
        --jobs 2 --out yardstick_check.jsonl      # and 256x16@16384, 512x16@32768; --epoch 1 --warm 0 --steps 20
    python scripts/experiments/yardstick_check.py --report yardstick_check.jsonl
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from record_plan import map_to_jsonl, setting, speedups
from tailsieve_verl.core.simulation import sim
from tailsieve_verl.core.tailsieve import cycle
from tailsieve_verl.core.tailsieve.controller import GroupRecord, _work_arrays
from tailsieve_verl.core.tailsieve.fluid import ConsumedBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the docs' table renderer
from docs_numbers import yardstick_table  # noqa: E402

_steps: list[dict] = []  # every TailSieveCycle.finish of this process's run (the tap below)


def _tap(finish):
    """Each closed step's cycle, makespan, split, aborts, consumed groups by identity and fresh pulls (read only)."""
    def tapped(self, plan, finished_bulk_ids, scores, **kw):
        outcome, obs = finish(self, plan, finished_bulk_ids, scores, **kw)
        carried = set(plan.tail_ids) | set(plan.requeued_ids)
        consumed = dict(list(kw["tail"]) + list(kw["bulk"]))
        _steps.append({"cycle": id(self), "controller": self.controller, "makespan_s": obs.makespan_s, "m": obs.m,
                       "prompt_len": kw["prompt_len"], "consumed": consumed, "aborted": list(scores),
                       "fresh": [p for p in consumed if p not in carried]})
        return outcome, obs
    return tapped


cycle.TailSieveCycle.finish = _tap(cycle.TailSieveCycle.finish)


def run(job: dict) -> dict:
    cfg, pool, perf, _ = setting(job, ("verl", "tailsieve"))
    cfg = replace(cfg, policies=("verl", "tailsieve"), controller=replace(cfg.controller, record_plan=False))
    _steps.clear()
    result = sim.simulate(cfg, pool(), perf)
    stock = result.policies["verl"].records
    runs = [c for c, k in Counter(s["cycle"] for s in _steps).items() if k == len(stock)]  # not the planner's
    if len(runs) != 1:
        raise RuntimeError(f"expected one TailSieve run of {len(stock)} steps, found {len(runs)}")
    steps = [s for s in _steps if s["cycle"] == runs[0]]
    controller = steps[0]["controller"]

    def price(groups, prompt_len: float) -> float:
        return controller.yardstick_s(ConsumedBatch(*_work_arrays(groups)), prompt_len)

    sums = dict.fromkeys(("makespan", "verl", "consumed", "pulled", "stock"), 0.0)
    n_split = 0
    for t, (s, after) in enumerate(zip(steps, steps[1:])):
        if t <= job["warm"] or not (s["m"] > 0 and s["aborted"]):
            continue  # split steps past the warm ones (the last step's aborted groups are never measured)
        pulled = [s["consumed"][p] for p in s["fresh"]] + [after["consumed"][p] for p in s["aborted"]]
        lengths = stock[t].consumed_lengths
        own = [GroupRecord(tuple(lengths[i:i + cfg.n]), 0.0) for i in range(0, len(lengths), cfg.n)]
        n_split += 1
        sums["makespan"] += s["makespan_s"]
        sums["verl"] += stock[t].makespan_s
        sums["consumed"] += price(list(s["consumed"].values()), s["prompt_len"])
        sums["pulled"] += price(pulled, s["prompt_len"])
        sums["stock"] += price(own, s["prompt_len"])
    out = {**job, "split_steps": n_split, "speedup_vs_verl": speedups(job, result.policies)["tailsieve"]}
    if n_split:
        out.update(truth=sums["makespan"] / sums["verl"], consumed_vs_stock=sums["consumed"] / sums["stock"],
                   pulled_vs_stock=sums["pulled"] / sums["stock"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="dense-weak,dense8b-weak")
    ap.add_argument("--shapes", default="64x8@16384")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="steps measured (default: as record_plan.jsonl, 12 at 512 x 16, else 10)")
    ap.add_argument("--warm", type=int, default=8, help="steps simulated before them")
    ap.add_argument("--epoch", type=int, default=2, help="the epoch measured (1: the run's first steps, with --warm 0)")
    ap.add_argument("--trend", type=float, default=0.004)
    ap.add_argument("--pool", type=int, default=17000)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--report", nargs="+")
    args = ap.parse_args()
    if args.report:
        print(yardstick_table(tuple(Path(p) for p in args.report)))
        return 0
    jobs = [{"cell": c, "shape": s, "seed": k, "steps": args.steps or (12 if s.startswith("512x") else 10),
             "warm": args.warm, "trend": args.trend, "pool": args.pool, "epoch": args.epoch}
            for s in args.shapes.split(",") for c in args.cells.split(",")
            for k in range(args.first_seed, args.first_seed + args.seeds)]
    map_to_jsonl(run, jobs, args.jobs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
