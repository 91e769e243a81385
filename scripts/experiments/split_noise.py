"""How noisy is the outer loop's measurement, and how do the pools respond to q? Each step's relative
makespan (makespan over the yardstick, the perf model's stock-verl time of the step's own consumed batch)
at fixed (q, m) splits: its mean and its step-to-step standard deviation, steps from the third on (the
carried queue filled), with the mean tail-pool and bulk-pool times. Against the gains a split brings,
the noise sizes how many visits the controller must average before it trusts a split
(``ControllerConfig.split_window``). Cells and settings are ``signal_gap.py``'s.

    python scripts/experiments/split_noise.py --cell dense-weak --shape 256x16@16384 --splits 0,0 2,1 4,1 8,2
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from signal_gap import cell_setting  # scripts/experiments/ is this script's import path
from tailsieve_verl.core.data.workload import PromptPool, get_preset
from tailsieve_verl.core.simulation.references import static_split_runner
from tailsieve_verl.core.tailsieve import controller as ctl

FIRST_STEP = 3


def measure(cell: str, shape: str, seed: int, splits: list[tuple[int, int]], pool_size: int,
            steps: int) -> dict[tuple[int, int], tuple[np.ndarray, float, float]]:
    """Each split's per-step relative makespan (as the controller measures it), mean tail and bulk seconds."""
    measured: dict[int, list[float]] = {}
    observe = ctl.HierarchicalController.observe

    def spy(self, obs):
        consumed = ctl.ConsumedBatch(*ctl._work_arrays(obs.tail_groups + obs.bulk_groups))
        measured.setdefault(id(self), []).append(obs.makespan_s / self.yardstick_s(consumed, obs.prompt_len))
        return observe(self, obs)

    cfg, perf, preset, cap = cell_setting({"cell": cell, "shape": shape, "seed": seed, "steps": steps}, ("verl",))
    pool = PromptPool(get_preset(preset, max_response_length=cap), pool_size, seed=seed)
    runners = {split: static_split_runner(cfg, pool, perf, split, str(split)) for split in splits}
    ctl.HierarchicalController.observe = spy
    try:
        for t in range(steps):
            for runner in runners.values():
                runner.step(t, keep=False)
    finally:
        ctl.HierarchicalController.observe = observe
    out = {}
    for split, runner in runners.items():
        records = runner.finish().records[FIRST_STEP:]
        out[split] = (np.array(measured[id(runner.cycle.controller)][FIRST_STEP:]),
                      float(np.mean([r.tail_s for r in records])), float(np.mean([r.bulk_s for r in records])))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cell", default="dense-weak")
    ap.add_argument("--shape", default="256x16@16384")
    ap.add_argument("--splits", nargs="+", default=["0,0", "2,1", "4,1", "8,2"], metavar="Q,M")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pool", type=int, default=17000)
    args = ap.parse_args()
    splits = [tuple(int(x) for x in s.split(",")) for s in args.splits]
    print(f"{args.cell} {args.shape}, steps {FIRST_STEP}-{args.steps - 1}: relative makespan per step, mean ± "
          "standard deviation over the steps; [tail pool s / bulk pool s]")
    for seed in range(args.seeds):
        rows = measure(args.cell, args.shape, seed, splits, args.pool, args.steps)
        print(f"seed {seed}  " + "  ".join(f"{q},{m}: {rel.mean():.3f} ± {rel.std():.3f} [{tail:.0f}/{bulk:.0f}]"
                                            for (q, m), (rel, tail, bulk) in rows.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
