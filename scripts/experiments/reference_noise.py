"""Is the adaptive controller's gap to best-static its yardstick or its noise? (issue 11)

The outer loop rates a split by makespan / yardstick, the perf model's stock-verl time of the batch the
step consumed. Under isolation that batch is lighter than a stock-verl batch (its long first draws were
aborted, their regenerations are new draws), so the yardstick is biased against isolation. This runs
adaptive TailSieve on the streams of ``controller_v2_eval.py`` next to the same controller with an
**exact reference** in place of the yardstick: the mean stock-verl makespan at that step over ``--mc``
independent streams of the same prompt pool. That reference is unbiased but, unlike the yardstick,
does not follow the step's own luck; no rollout layer has it. Two controllers that trust the perf model
over measurements are run too: one that stays at its probe, one that probes m = R − 1 and stays there;
and the shipped controller with its probe range widened from m = 1..R/2 to 1..R − 1.
``--pinned Q,M`` also pins that split (inner loop off) and prints, per step, makespan / yardstick and
makespan / exact reference for it and for stock verl: the yardstick's bias and both references' noise.

Ratios are to best-static out of sample (both on the regeneration draws best-static was not chosen on),
read from a ``controller_v2_eval.py --regeneration-draws`` JSON of the same cells and seeds:

    python scripts/experiments/reference_noise.py --best-static-from scripts/results/controller_vs_stock_verl/controller_v2_64x8_probe.json \
        --seeds 16 --out reference.json

Recorded results: scripts/results/exact_reference_vs_yardstick/; every table and its command: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from controller_v2_eval import cell_setup  # scripts/experiments/ is this script's import path
from tailsieve_verl.core.simulation import sim
from tailsieve_verl.core.tailsieve.controller import HierarchicalController
from tailsieve_verl.core.tailsieve.fluid import ConsumedBatch


class _Variant(HierarchicalController):
    """A controller variant built like the runner's shipped one; ``stock_s``: the step's exact reference."""

    def __init__(self, like: HierarchicalController, perf, stock_s: np.ndarray):
        super().__init__(like.config, like.n_replicas, like.batch_size, perf, like.per_sample)
        self.stock_s = stock_s


class ExactReference(_Variant):
    """The controller with the mean stock-verl makespan of each step in place of its yardstick."""

    def yardstick_s(self, consumed, prompt_len: float) -> float:
        return float(self.stock_s[self.state.steps - 1])  # observe() has counted the step already


class ProbeAnySplit(_Variant):
    """The controller probing the split the perf model ranks best among m = 1..R − 1, not 1..R/2."""

    def _probe_range(self) -> range:
        return range(1, self.n_replicas)


VARIANTS = {  # name -> (controller overrides, controller class, built from the shipped one; None = the shipped one)
    "adaptive": ({}, None),
    "adaptive, exact reference": ({}, ExactReference),
    "stay at the probe": ({"switch_threshold": 0.5}, None),
    "probe m = R-1, stay": ({"switch_threshold": 0.5, "probe_tail_replicas": "R-1"}, None),
    "probe best m < R": ({}, ProbeAnySplit),
}


def run(job: dict) -> dict:
    cfg, pool, perf = cell_setup(job, policies=("verl",))
    others = [sim.StaticRunner(replace(cfg, seed=10_000 + 100 * job["seed"] + k), pool, perf, "verl")
              for k in range(job["mc"])]  # independent stock-verl streams of the same pool
    for t in range(cfg.steps):
        for r in others:
            r.step(t, keep=False)
    stock_s = np.mean([[x.makespan_s for x in r.result.records] for r in others], axis=0)
    runners = sim.build_runners(cfg, pool, perf)
    if job["pinned"]:
        q, m = job["pinned"]
        pinned = sim.TailSieveRunner(cfg, pool, perf, replace(cfg.controller, fixed_tail_replicas=m, q_init=q,
                                                              inner_loop=False), "pinned")
        runners.append(pinned)
    for name, (override, controller) in VARIANTS.items():
        override = {k: cfg.n_replicas - 1 if v == "R-1" else v for k, v in override.items()}
        for k in range(job["draws"]):
            runner = sim.adaptive_runner(replace(cfg, regeneration_draws=k), pool, perf, f"{name}|{k}",
                                         replace(cfg.controller, **override))
            if controller:
                runner.cycle.controller = controller(runner.cycle.controller, perf, stock_s)
            runners.append(runner)
    for t in range(cfg.steps):
        for r in runners:
            r.step(t, keep=False)
    results = {r.name: r.finish() for r in runners}
    base = results["verl"].mean_makespan_s
    out = {"cell": job["cell"], "seed": job["seed"], "speedup": {k: base / v.mean_makespan_s for k, v in results.items()}}
    if job["pinned"]:
        def yardstick(lengths: tuple[int, ...]) -> float:
            batch = ConsumedBatch(np.asarray(lengths, dtype=np.int64), np.full(len(lengths) // job["n"], job["n"]))
            return pinned.cycle.controller.yardstick_s(batch, pool.spec.prompt_len)

        out["pinned"] = {name: [[round(float(v), 3) for v in (x.makespan_s, yardstick(x.consumed_lengths), stock_s[t])]
                                for t, x in enumerate(results[name].records) if t >= 2]  # past the first carry
                         for name in ("verl", "pinned")}
    return out


def print_pinned(rows: list[dict], cells: list[str], split: str) -> None:
    print(f"\npinned ({split}), inner loop off, steps 2..: mean (std over steps) of makespan / yardstick, "
          "makespan / exact reference, yardstick / exact reference")
    for cell in cells:
        for name in ("verl", "pinned"):
            a = np.array([step for r in rows if r["cell"] == cell for step in r["pinned"][name]])
            ratios = (a[:, 0] / a[:, 1], a[:, 0] / a[:, 2], a[:, 1] / a[:, 2])
            print(f"{cell:<13} {'stock verl' if name == 'verl' else split:<10}"
                  + "".join(f"  {x.mean():.3f} ({x.std():.3f})" for x in ratios))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="dense-weak,dense-real,dense-strong,moe-weak,moe-real,moe-strong")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--draws", type=int, default=3, help="sets of regeneration draws; draws 1.. are scored")
    ap.add_argument("--mc", type=int, default=8, help="stock-verl streams averaged into the exact reference")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--pinned", default="", help="Q,M: also measure the yardstick on this pinned split")
    ap.add_argument("--best-static-from", required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--table-only", default="", help="print the table of a saved JSON and exit")
    args = ap.parse_args()
    if args.draws < 2:
        ap.error("--draws must be >= 2: draw 0 is the one best-static was chosen on")
    cells = args.cells.split(",")
    if args.table_only:
        rows = json.loads(Path(args.table_only).read_text())
    else:
        pinned = tuple(int(x) for x in args.pinned.split(",")) if args.pinned else None
        jobs = [dict(cell=c, seed=s, steps=args.steps, batch=args.batch, n=args.n, pool=args.pool, draws=args.draws,
                     mc=args.mc, pinned=pinned) for c in cells for s in range(args.seed0, args.seed0 + args.seeds)]
        with ProcessPoolExecutor(args.jobs) as ex:
            rows = list(ex.map(run, jobs))
    earlier = {(r["cell"], r["seed"]): r["speedup"] for r in json.loads(Path(args.best_static_from).read_text())}
    missing = sorted({(r["cell"], r["seed"]) for r in rows} - set(earlier))
    if missing:
        raise SystemExit(f"{args.best_static_from} lacks best-static for {missing}; run controller_v2_eval.py "
                         "with --regeneration-draws on these cells and seeds first")
    print(f"{args.batch}×{args.n}, {args.steps} steps; per variant: speedup vs stock verl over draws 1..{args.draws - 1}, "
          "[adaptive / best-static out of sample ± standard error]")
    for cell in cells:
        cr = [r for r in rows if r["cell"] == cell]
        best = np.array([np.mean([earlier[cell, r["seed"]][f"best-static (regen {k})"] for k in range(1, args.draws)])
                         for r in cr])
        line = f"{cell:<13} best-static {best.mean():.3f}"
        for name in VARIANTS:
            v = np.array([[r["speedup"][f"{name}|{k}"] for k in range(1, args.draws)] for r in cr]).mean(axis=1)
            ratio = v / best
            line += f" | {name}: {v.mean():.3f} [{ratio.mean():.3f} ± {ratio.std(ddof=1) / np.sqrt(len(ratio)):.3f}]"
        print(line, flush=True)
    if all("pinned" in r for r in rows):
        print_pinned(rows, cells, args.pinned or "pinned")
    if args.out and not args.table_only:
        Path(args.out).write_text(json.dumps(rows))  # compact: the pinned steps make it long


if __name__ == "__main__":
    main()
