"""TailSieve against the strongest stock configuration: stock verl with speculation on every replica (issue 22).

For each cell (setup × tail preset × batch shape × engine) and seed, one 30-step `core.simulation.sim` run of the
stock configurations — verl (no speculation), verl-spec (one depth on every replica, the best of k = 1..6
in hindsight), verl-dynsd (vLLM's documented batch-size schedule), verl-dynsd-best (the best schedule of
a small grid in hindsight) — and TailSieve routing-only (adaptive), tailsieve-spec (tail pool at k = 6,
pinned at m = 1 and at m = R/2, bulk pool on vLLM's schedule; q adapts), tailsieve-dynsd (vLLM's
schedule on every replica, m free), tailsieve-auto (the split of tailsieve-spec or a fallback to stock
verl with speculation, chosen online: `core.tailsieve.fallback`), and on the best stock configuration's engine
(picked in hindsight per seed, as `tailsieve plan` picks from a logged trace) "tailsieve on best stock"
(adaptive TailSieve, that engine on every replica: what routing adds on top of it) and clairvoyant-split
(lengths known: the ceiling of a tail split over it, `core.simulation.sim.ClairvoyantSplitRunner`). Speculation: `core.simulation.sim.DEFAULT_SPECULATION` (MTP-like assumptions:
conditional acceptance 0.85, 0.8, 0.75, draft cost 1/28 of a step per draft token), with
`--half-life` an acceptance decay with context. Prints, per cell, every policy's speedup vs stock verl
and vs the best stock configuration of the same seed (mean, worst seed), which stock configuration was
best, and TailSieve's max_deferral_steps.

    python scripts/experiments/strongest_stock.py [--seeds 8] [--jobs 2] [--shape 64x8] [--engine none|verl]
    python scripts/experiments/strongest_stock.py --shape 256x16 --engine verl --cells dense-real,moe-real --seeds 4
    python scripts/experiments/strongest_stock.py --fallback-only --seeds 4 --jobs 1   # stock + tailsieve-spec/-auto

`--engine verl` runs every replica with verl 0.9.1's rollout defaults on one H200 (`EngineConfig.verl_defaults`:
max_num_seqs 256, 8192-token chunked prefill, KV cache at gpu_memory_utilization 0.5) for the cell's model
shape; `--cap` sets the workload's response cap (16k by default). Results: scripts/results/strongest_stock/
(docs/results.md names every file and its command).
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

from tailsieve_verl.core.simulation import sim
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.data.workload import PromptPool, get_preset

SETUPS = {"dense": ("table:h200-dense", 8, "qwen3-1.7b"), "dense8b": ("table:h200-dense:qwen3-8b", 8, "qwen3-8b"),
          "moe": ("table:h200-moe", 4, "qwen3-30b-a3b")}
POLICIES = ("verl", "verl-spec", "verl-dynsd", "verl-dynsd-best", "tailsieve", "tailsieve-spec", "tailsieve-dynsd",
            "tailsieve-auto")
STOCK_AND_FALLBACK = ("verl", "verl-spec", "verl-dynsd", "verl-dynsd-best", "tailsieve-spec", "tailsieve-auto")
STOCK = sim.STOCK_POLICIES


def run(job: dict) -> dict:
    setup, preset = job["cell"].split("-")
    perf_name, n_replicas, model = SETUPS[setup]
    perf = parse_perf_model(perf_name)
    engine = EngineConfig.verl_defaults(model, perf) if job["engine"] == "verl" else EngineConfig()
    shift = job.get("acceptance_shift", 0.0)
    speculation = replace(sim.DEFAULT_SPECULATION, acceptance_half_life=job["half_life"],
                          acceptance=tuple(min(1.0, max(0.0, a + shift)) for a in sim.DEFAULT_SPECULATION.acceptance))
    cfg = sim.SimConfig(steps=job["steps"], n_replicas=n_replicas, batch_size=job["batch"], n=job["n"], seed=job["seed"],
                        policies=STOCK_AND_FALLBACK if job["fallback_only"] else POLICIES, fixed_tail_replicas=n_replicas // 2, engine=engine, speculation=speculation)
    pool = PromptPool(get_preset(preset, max_response_length=job["cap"], **prompt_share_fields(job.get("prompt_share"))),
                      job["pool"], seed=job["seed"])
    runners = sim.build_runners(cfg, pool, perf)
    if not job["fallback_only"]:
        one = sim.build_runners(replace(cfg, fixed_tail_replicas=1, policies=("tailsieve-spec",)), pool, perf)[0]
        one.name = one.result.name = "tailsieve-spec m=1"
        runners.append(one)
    t0 = time.time()
    for t in range(cfg.steps):
        for r in runners:
            r.step(t, keep=False)
    results = {r.name: r.finish() for r in runners}
    best_stock = min(STOCK, key=lambda name: results[name].mean_makespan_s)
    # on the best stock configuration's engine (a hindsight pick, as a plan makes from a logged trace):
    # TailSieve's routing on every replica, m free — what routing adds on top of it — and the ceiling of a
    # split over it (lengths known)
    best = replace(cfg, engine=engine if best_stock == "verl" else sim.stock_engines(cfg)[results[best_stock].choice])
    on_best = [sim.adaptive_runner(best, pool, perf, "tailsieve on best stock"), sim.ClairvoyantSplitRunner(best, pool, perf)]
    for t in range(cfg.steps):
        for r in on_best:
            r.step(t, keep=False)
    results.update({r.name: r.finish() for r in on_best})
    means = {name: r.mean_makespan_s for name, r in results.items()}
    return {"cell": job["cell"], "seed": job["seed"], "shape": f"{job['batch']}x{job['n']}", "engine": job["engine"],
            "cap": job["cap"], "half_life": job["half_life"], "acceptance_shift": shift,
            "prompt_share": job.get("prompt_share"), "steps": job["steps"], "wall_s": time.time() - t0, "mean_makespan_s": means,
            "speedup_vs_verl": {k: means["verl"] / v for k, v in means.items()},
            "best_stock": best_stock, "speedup_vs_best_stock": {k: means[best_stock] / v for k, v in means.items()},
            "choice": {k: r.choice for k, r in results.items() if r.choice},
            "max_deferral_steps": {k: r.max_deferral_steps for k, r in results.items()},
            "lost_dup_stale": sum(r.lost + r.duplicated + r.stale for r in results.values()),
            "final_m": {k: r.records[-1].next_m for k, r in results.items() if k.startswith("tailsieve")},
            "variant": job["variant"]}


def prompt_share_fields(share: float | None) -> dict:
    """A workload whose prompt identity explains ``share`` of the length variance, sampling the rest
    (checkpoint and interaction shares kept); {} keeps the preset's 64.8 %."""
    if share is None:
        return {}
    base = get_preset("real")
    sampling = 1.0 - share - base.checkpoint_share - base.interaction_share
    if sampling < 0:
        raise SystemExit(f"--prompt-share {share} leaves no room for the checkpoint and interaction shares "
                         f"({base.checkpoint_share + base.interaction_share:.3f}); use at most "
                         f"{1 - base.checkpoint_share - base.interaction_share:.3f}")
    return {"prompt_share": share, "sampling_share": sampling}


def table(rows: list[dict]) -> str:
    names = list(rows[0]["speedup_vs_verl"])
    out = [f"{rows[0]['shape']}, engine {rows[0]['engine']}, cap {rows[0]['cap']}, acceptance half-life "
           f"{rows[0]['half_life']}, acceptance shift {rows[0].get('acceptance_shift', 0.0):+g}, prompt share "
           f"{rows[0].get('prompt_share') or 0.648}, {len({r['seed'] for r in rows})} seeds, {rows[0].get('steps', 30)} "
           "steps; mean over seeds [worst seed]"]
    for cell in dict.fromkeys(r["cell"] for r in rows):
        cr = [r for r in rows if r["cell"] == cell]
        out.append(f"\n{cell}: best stock per seed {dict(sorted(_count(r['best_stock'] for r in cr).items()))}; "
                   f"verl-spec k {dict(sorted(_count(r['choice']['verl-spec'] for r in cr).items()))}; "
                   f"verl-dynsd-best {dict(sorted(_count(r['choice']['verl-dynsd-best'] for r in cr).items()))}")
        autos = [r["choice"]["tailsieve-auto"] for r in cr if "tailsieve-auto" in r["choice"]]
        if autos:
            out.append(f"  tailsieve-auto per seed: {'; '.join(autos)}")
        ceilings = [r["choice"]["clairvoyant-split"] for r in cr if "clairvoyant-split" in r["choice"]]
        if ceilings:
            out.append(f"  clairvoyant-split (on the best stock engine) per seed: {'; '.join(ceilings)}")
        out.append(f"  {'policy':<26}{'vs stock verl':>22}{'vs best stock':>22}{'max deferral':>14}{'final m':>10}")
        for name in names:
            a = np.array([r["speedup_vs_verl"][name] for r in cr])
            b = np.array([r["speedup_vs_best_stock"][name] for r in cr])
            m = [r["final_m"].get(name) for r in cr]
            out.append(f"  {name:<26}{a.mean():>13.3f} [{a.min():.3f}]{b.mean():>13.3f} [{b.min():.3f}]"
                       f"{max(r['max_deferral_steps'][name] for r in cr):>14}"
                       f"{('-' if m[0] is None else f'{np.mean(m):.1f}'):>10}")
    out.append(f"\nlost + duplicated + stale prompts over all runs: {sum(r['lost_dup_stale'] for r in rows)}; "
               f"wall per (cell, seed): mean {np.mean([r['wall_s'] for r in rows]):.1f} s")
    return "\n".join(out)


# The sensitivities of issue 22, point 4, one at a time around the defaults: acceptance ±0.1 per position,
# acceptance decay with context (half-life ~85k tokens: position 1 falls from ~0.93 to ~0.72 at long contexts),
# and the share of length variance prompt identity explains (the paper's 0.648 is the default).
SENSITIVITY = {"acceptance +0.1": {"acceptance_shift": 0.1}, "acceptance -0.1": {"acceptance_shift": -0.1},
               "half-life 85k": {"half_life": 85000.0}, "prompt share 0.2": {"prompt_share": 0.2},
               "prompt share 0.5": {"prompt_share": 0.5}, "prompt share 0.87": {"prompt_share": 0.87}}


def sensitivity_table(rows: list[dict]) -> str:
    """One line per (sensitivity, cell): the best stock configuration and TailSieve's speedups over it."""
    out = [f"{rows[0]['shape']}, engine {rows[0]['engine']}, cap {rows[0]['cap']}, {len({r['seed'] for r in rows})} "
           f"seeds, {rows[0]['steps']} steps; speedup vs the best stock configuration of the same seed, mean [worst seed]",
           f"{'sensitivity':<18}{'cell':<14}{'best stock':<18}{'vs verl':>8}{'tailsieve-spec':>18}{'tailsieve-auto':>18}"
           f"{'auto split steps':>18}{'clairvoyant-split':>20}"]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        for cell in dict.fromkeys(r["cell"] for r in rows if r["variant"] == variant):
            cr = [r for r in rows if r["variant"] == variant and r["cell"] == cell]
            best = max(_count(r["best_stock"] for r in cr).items(), key=lambda kv: kv[1])[0]
            vs_verl = np.mean([1 / r["speedup_vs_best_stock"]["verl"] for r in cr])
            cols = []
            for name in ("tailsieve-spec", "tailsieve-auto", "clairvoyant-split"):
                x = np.array([r["speedup_vs_best_stock"].get(name, np.nan) for r in cr])
                cols.append(f"{x.mean():.3f} [{x.min():.3f}]")
            split = np.mean([int(r["choice"]["tailsieve-auto"].split(" on ")[1].split(" of ")[0]) for r in cr])
            out.append(f"{variant:<18}{cell:<14}{best:<18}{vs_verl:>8.2f}{cols[0]:>18}{cols[1]:>18}{split:>18.1f}"
                       f"{cols[2]:>20}")
    out.append(f"max deferral steps over all runs: {max(max(r['max_deferral_steps'].values()) for r in rows)}; "
               f"lost + duplicated + stale: {sum(r['lost_dup_stale'] for r in rows)}")
    return "\n".join(out)


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="dense-weak,dense-real,dense-strong,moe-weak,moe-real,moe-strong")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1 (to extend a table)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--shape", default="64x8", help="B x n")
    ap.add_argument("--engine", default="none", choices=["none", "verl"])
    ap.add_argument("--cap", type=int, default=16384, help="response length cap of the workload")
    ap.add_argument("--half-life", type=float, default=None, help="acceptance half-life in context tokens")
    ap.add_argument("--acceptance-shift", type=float, default=0.0,
                    help="added to every draft position's acceptance (clipped to [0, 1]): the ±0.1 sensitivity")
    ap.add_argument("--prompt-share", type=float, default=None,
                    help="share of length variance prompt identity explains (default the preset's 0.648)")
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--fallback-only", action="store_true",
                    help="run only the stock configurations, tailsieve-spec, tailsieve-auto and the two runs on the "
                         "best stock engine (about half the time)")
    ap.add_argument("--sensitivity", action="store_true",
                    help="run every sensitivity of SENSITIVITY (acceptance ±0.1, decay, prompt share) instead of the "
                         "defaults, with --fallback-only's policies; one line per (sensitivity, cell)")
    ap.add_argument("--out", default="", help="stem: writes STEM.json and STEM.txt")
    ap.add_argument("--render", default="", metavar="ROWS",
                    help="run nothing: print (and with --out write) the table of saved rows, a STEM.json or the "
                         "STEM.partial.jsonl of a run stopped early (the (cell, seed) runs that finished)")
    args = ap.parse_args()
    if args.render:
        render(Path(args.render), args.out)
        return
    batch, n = (int(x) for x in args.shape.split("x"))
    base = dict(steps=args.steps, batch=batch, n=n, pool=args.pool, engine=args.engine, cap=args.cap,
                half_life=args.half_life, fallback_only=args.fallback_only or args.sensitivity,
                acceptance_shift=args.acceptance_shift, prompt_share=args.prompt_share, variant="default")
    variants = ({name: {**base, **changes, "variant": name} for name, changes in SENSITIVITY.items()}
                if args.sensitivity else {"default": base})
    jobs = [dict(v, cell=c, seed=s) for v in variants.values() for c in args.cells.split(",")
            for s in range(args.first_seed, args.first_seed + args.seeds)]
    t0 = time.time()
    partial = Path(args.out + ".partial.jsonl") if args.out else None  # each finished (cell, seed) as it lands
    rows = []
    with ProcessPoolExecutor(args.jobs) as ex:
        for row in ex.map(run, jobs):
            rows.append(row)
            if partial:
                with partial.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    text = ((sensitivity_table(rows) if args.sensitivity else table(rows)) + f"\ntotal wall {time.time() - t0:.0f} s with --jobs {args.jobs}\n"
            f"command: python scripts/experiments/strongest_stock.py {' '.join(sys.argv[1:])}")
    write(rows, text, args.out)
    if partial:
        partial.unlink(missing_ok=True)


def render(path: Path, out: str) -> None:
    """The table of rows saved by an earlier run (a JSON list, or JSON lines as the partial file has)."""
    raw = path.read_text()
    rows = json.loads(raw) if path.suffix == ".json" else [json.loads(line) for line in raw.splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path}: no rows")
    sensitivity = any(r.get("variant", "default") != "default" for r in rows)
    text = ((sensitivity_table(rows) if sensitivity else table(rows))
            + f"\nrendered from {path.name}: the {len(rows)} (cell, seed) runs it holds\n"
            f"command: python scripts/experiments/strongest_stock.py {' '.join(sys.argv[1:])}")
    write(rows, text, out)


def write(rows: list[dict], text: str, out: str) -> None:
    print(text)
    if out:
        Path(out + ".json").write_text(json.dumps(rows, indent=1))
        Path(out + ".txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
