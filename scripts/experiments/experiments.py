"""Closed-loop experiments reproducing the seed's shapes with the simulator (core.simulation.sim).

Sections (``--only`` picks some; all print Markdown tables and write ``OUT/experiments.json`` and
plots under ``OUT``):

* ``tails`` — weak / real / strong tails × step sizes (``--scales``) × every simulator policy on the
  dense H200 calibration (8 replicas) and the MoE one (4 replicas); speedups vs stock verl first,
  then vs uniform group routing (the paper's baseline, 1.21–1.67× routing-only there).
* ``convergence`` — controller trajectories from the minimum and maximum q (fixed split) and from
  uniform and tail-heavy m (full controller), on the same prompt stream.
* ``ablation`` — the full controller against versions with one component removed (vs stock verl).
* ``bias`` — length bias in steady state (pooled KS vs its noise) and the composition transition
  after q is raised / lowered (mean consumed-length shift per step, averaged over seeds).
* ``plan`` — the planner's prediction from a logged uniform run vs the simulated outcome.

    python scripts/experiments/experiments.py [--out experiments_out] [--only tails,bias] [--steps 40] [--seeds 3]

Recorded results: scripts/results/stock_verl_vs_group_routing/ (--only tails); every table and its command: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from tailsieve_verl.core.tailsieve.bias import LengthBiasMonitor
from tailsieve_verl.core.tailsieve.controller import ControllerConfig, Decision
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.simulation.planner import plan_from_trace
from tailsieve_verl.core.simulation.sim import POLICIES, SimConfig, TailSieveRunner, simulate
from tailsieve_verl.core.data.trace import Trace
from tailsieve_verl.core.data.workload import PromptPool, get_preset

SEED_ROUTING_ONLY = (1.214, 1.670)  # the seed's routing-only TailSieve speedups over uniform (range)
SETUPS = {"dense": ("table:h200-dense", 8), "moe": ("table:h200-moe", 4)}
SECTIONS = ("tails", "convergence", "ablation", "bias", "plan")


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _tails_run(job: tuple) -> tuple:
    setup, workload, (batch, n), seed, args = job
    spec, replicas = SETUPS[setup]
    cfg = SimConfig(steps=args.steps, n_replicas=replicas, batch_size=batch, n=n, seed=seed,
                    oracle_time_limit_s=args.oracle_time_limit,
                    **({"policies": tuple(args.policies.split(","))} if args.policies else {}))
    pool = PromptPool(workload, max(args.pool, 4 * batch), seed=seed)
    result = simulate(cfg, pool, parse_perf_model(spec), workload)
    window = slice(args.steps // 4, None)  # after the controller's first moves
    return job[:4], {name: {"makespan_s": float(r.makespans[window].mean()),
                            "final_qm": (r.records[-1].next_q, r.records[-1].next_m),
                            "wasted_fraction": r.wasted_fraction}
                     for name, r in result.policies.items()}


def tails(args) -> dict:
    """Setups × tails × scales × every simulator policy; speedups vs stock verl first."""
    from multiprocessing import Pool

    scales = [tuple(int(x) for x in s.split("x")) for s in args.scales.split(",")]
    # seed-major, so a run stopped early still has every cell at a similar number of seeds
    jobs = [(setup, workload, scale, seed, args) for scale in scales for seed in range(args.seeds)
            for setup in SETUPS for workload in ("weak", "real", "strong")]
    runs = {}
    if args.from_runs:  # re-tabulate saved run logs (also partial ones; a later log's policies win)
        for path in args.from_runs.split(","):
            for line in Path(path).read_text(encoding="utf-8").splitlines():
                record = json.loads(line)
                setup, workload, scale, seed = record["key"]
                runs.setdefault((setup, workload, tuple(scale), seed), {}).update(record["policies"])
    else:
        with Pool(args.workers) as workers, open(Path(args.out) / "tails_runs.jsonl", "w", encoding="utf-8") as log:
            for key, run in workers.imap_unordered(_tails_run, jobs):  # each run logged as it lands
                runs[key] = run
                log.write(json.dumps({"key": list(key), "policies": run}, default=float) + "\n")
                log.flush()
    out, rows = {}, []
    for setup in SETUPS:
        for batch, n in scales:
            for workload in ("weak", "real", "strong"):
                per_seed = [runs[k] for k in sorted(runs) if k[:3] == (setup, workload, (batch, n))]
                if not per_seed:
                    continue
                key = f"{setup}/{batch}x{n}/{workload}"
                for run in per_seed:  # speedups from the same seed's window means (same prompt stream)
                    for name in run:
                        run[name]["vs_verl"] = run["verl"]["makespan_s"] / run[name]["makespan_s"]
                        run[name]["vs_uniform"] = (run["uniform"]["makespan_s"] / run[name]["makespan_s"]
                                                   if "uniform" in run else float("nan"))
                names = [p for p in POLICIES if all(p in run for run in per_seed)]
                out[key] = {name: {field: [run[name][field] for run in per_seed]
                                   for field in per_seed[0][name]} for name in names}
                for name, v in out[key].items():
                    rows.append([setup, f"{batch}×{n}", workload, len(per_seed), name, f"{np.mean(v['makespan_s']):.1f}",
                                 f"{np.mean(v['vs_verl']):.3f}", f"{min(v['vs_verl']):.3f}",
                                 f"{np.mean(v['vs_uniform']):.3f}",
                                 " ".join(f"({q},{m})" for q, m in v["final_qm"]) if name.startswith("tailsieve") else "",
                                 f"{100 * np.mean(v['wasted_fraction']):.1f} %"])
    print(f"\n### Tails × policies ({args.steps} steps, mean over steps ≥ {args.steps // 4}; "
          "speedups vs stock verl, worst seed, and vs uniform group routing)\n")
    print(_table(["setup", "B×n", "workload", "seeds", "policy", "makespan s", "vs stock verl", "worst seed", "vs group RR",
                  "final (q,m) per seed", "wasted tokens"], rows))
    print(f"\npaper routing-only TailSieve: {SEED_ROUTING_ONLY[0]}–{SEED_ROUTING_ONLY[1]}× over uniform group routing")
    return out


def convergence(args) -> dict:
    spec, replicas = SETUPS["moe"]
    perf = parse_perf_model(spec)
    q_max = args.batch // 2
    starts = {
        "fixed 2:2, q from 1": ("tailsieve-fixed", ControllerConfig(q_init=1)),
        f"fixed 2:2, q from {q_max}": ("tailsieve-fixed", ControllerConfig(q_init=q_max)),
        "full, from uniform (0,0)": ("tailsieve", ControllerConfig()),
        f"full, from tail-heavy m={replicas - 1}": ("tailsieve", ControllerConfig(m_init=replicas - 1, q_init=q_max // 2)),
    }
    out, rows = {}, []
    for label, (policy, ctl) in starts.items():
        cfg = SimConfig(steps=args.steps, n_replicas=replicas, batch_size=args.batch, n=args.n, seed=0,
                        policies=(policy,), fixed_tail_replicas=2, controller=ctl)
        result = simulate(cfg, PromptPool("real", args.pool, seed=0), perf, "real")
        r = result.policies[policy]
        qs, ms = [x.q for x in r.records], [x.m for x in r.records]
        out[label] = {"q": qs, "m": ms, "makespan_s": r.makespans.tolist()}
        tail = slice(-max(3, args.steps // 4), None)
        q0, m0 = (ctl.q_init, 2) if policy == "tailsieve-fixed" else (ctl.q_init, ctl.m_init)
        rows.append([label, f"{q0}→{int(np.median(qs[tail]))}", f"{m0}→{int(np.median(ms[tail]))}",
                     f"{min(qs[tail])}–{max(qs[tail])}", f"{r.makespans[tail].mean():.1f}"])
    print(f"\n### Convergence (MoE, {replicas} replicas, real tails, B={args.batch}×{args.n}, same prompt stream)\n")
    print(_table(["start", "q start→median of last quarter", "m start→median", "q range last quarter",
                  "makespan last quarter (s)"], rows))
    _plot_convergence(out, Path(args.out) / "convergence.png")
    return out


def _plot_convergence(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_q, ax_m) = plt.subplots(2, 1, figsize=(7, 5), dpi=120, sharex=True)
    for label, v in out.items():
        ax_q.step(range(len(v["q"])), v["q"], where="post", label=label)
        ax_m.step(range(len(v["m"])), v["m"], where="post", label=label)
    ax_q.set_ylabel("q")
    ax_m.set_ylabel("m (tail replicas)")
    ax_m.set_xlabel("step")
    ax_q.legend(fontsize=7)
    ax_q.set_title("Controller convergence from four starting points (MoE, real tails)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def ablation(args) -> dict:
    base = ControllerConfig()
    variants = {
        "full controller": base,
        "no inner loop (q frozen after m moves)": replace(base, inner_loop=False),
        "no smoothing": replace(base, smoothing=1.0),
        "perf model only (no measured surface)": replace(base, measured_surface=False),
        "no damping (full q jump, unbounded)": replace(base, q_gain=1.0, max_q_step=args.batch),
        "no feasibility check": replace(base, check_feasibility=False),
        "no settle period": replace(base, settle_steps=0),
        "no switch threshold": replace(base, switch_threshold=0.0),
        "no candidate over-collection (abort exactly q)": replace(base, candidate_factor=1.0),
    }
    out, rows = {}, []
    for setup in ("dense", "moe"):
        spec, replicas = SETUPS[setup]
        perf = parse_perf_model(spec)
        for label, ctl in variants.items():
            speed, moves = [], []
            for seed in range(args.seeds):
                cfg = SimConfig(steps=args.steps, n_replicas=replicas, batch_size=args.batch, n=args.n, seed=seed,
                                policies=("verl", "tailsieve"), controller=ctl)
                result = simulate(cfg, PromptPool("real", args.pool, seed=seed), perf, "real")
                speed.append(result.speedup_vs("verl", slice(args.steps // 4, None))["tailsieve"])
                ms = [x.m for x in result.policies["tailsieve"].records]
                moves.append(sum(a != b for a, b in zip(ms, ms[1:])))
            out[f"{setup}/{label}"] = {"speedup": float(np.mean(speed)), "per_seed": speed, "replica_moves": moves}
            rows.append([setup, label, f"{np.mean(speed):.3f}", f"{min(speed):.3f}", f"{np.mean(moves):.1f}"])
    print(f"\n### Controller ablation (real tails, B={args.batch}×{args.n}, {args.steps} steps, {args.seeds} seeds)\n")
    print(_table(["setup", "variant", "speedup", "worst seed", "replica moves / run"], rows))
    return out


def bias(args) -> dict:
    """Stationary policy (no checkpoint drift); q scripted: steady, raised, steady, lowered, steady."""
    spec = replace(get_preset("real"), checkpoint_share=0.0, interaction_share=0.0,
                   prompt_share=0.648 / 0.909, sampling_share=0.261 / 0.909)
    perf = parse_perf_model("table:h200-dense")
    low, high, phase = 4, 12, 8
    schedule = [low] * phase + [high] * phase + [low] * phase
    steady, shifts = LengthBiasMonitor(), []
    reps = max(8, 8 * args.seeds)
    for seed in range(reps):
        pool = PromptPool(spec, args.pool, seed=seed)
        cfg = SimConfig(steps=len(schedule), n_replicas=8, batch_size=args.batch, n=args.n, seed=seed)
        runner = TailSieveRunner(cfg, pool, perf, ControllerConfig(fixed_tail_replicas=2, q_init=low, inner_loop=False),
                                 "scripted")
        ref_rng = np.random.default_rng([seed, 99])
        per_step = []
        for t, q in enumerate(schedule):
            runner.cycle.decision = Decision(q, 2, "scripted")
            runner.step(t, keep=False)
            consumed = runner.result.records[-1].consumed_lengths
            groups = [consumed[i:i + args.n] for i in range(0, len(consumed), args.n)]
            reference = [g.lengths for g in pool.sample_batch(args.batch, args.n, t, ref_rng)]
            if 3 <= t < phase:  # steady state at q = low
                steady.update(groups, reference)
            per_step.append(np.mean(consumed) / np.mean([x for g in reference for x in g]) - 1.0)
        shifts.append(per_step)
    shift = np.mean(shifts, axis=0)
    noise = np.std(np.array(shifts)[:, 3:phase]) / np.sqrt(reps)
    pooled = steady.pooled()
    rows = [[t, schedule[t], f"{100 * shift[t]:+.1f} %"] for t in range(phase - 2, len(schedule))
            if phase - 2 <= t <= phase + 3 or 2 * phase - 1 <= t <= 2 * phase + 3]
    print(f"\n### Length bias (stationary policy, dense, 8 replicas, m=2, {reps} seeds)\n")
    print(f"steady state q={low}: pooled KS {pooled['ks']:.4f} vs noise {pooled['ks_noise']:.4f} "
          f"(ratio {pooled['ks_ratio']:.2f}); mean-length shift {100 * pooled['mean_shift']:+.2f} %")
    print(f"per-step mean shift noise (steady state, std of the seed mean): ±{100 * noise:.1f} %\n")
    print(_table(["step", "q in force", "consumed mean length vs population"], rows))
    return {"steady": pooled, "schedule": schedule, "mean_shift_per_step": shift.tolist(), "shift_noise": float(noise)}


def plan(args) -> dict:
    perf = parse_perf_model("table:h200-dense")
    pool = PromptPool("strong", 256, seed=5)
    rng = np.random.default_rng(5)
    logged = Trace(tuple(pool.sample_groups(pool.prompt_ids, args.n, 0, rng)), name="logged-uniform-strong")
    t = time.perf_counter()
    p = plan_from_trace(logged, 8, perf, batch_size=args.batch, steps=args.steps, seeds=args.seeds)
    elapsed = time.perf_counter() - t
    # outcome on fresh prompts of the same workload (what the planner could not see)
    actual = []
    for seed in range(args.seeds):
        cfg = SimConfig(steps=args.steps, n_replicas=8, batch_size=args.batch, n=args.n, seed=100 + seed,
                        policies=("verl", "tailsieve"))
        actual.append(simulate(cfg, PromptPool("strong", args.pool, seed=100 + seed), perf).speedup_vs(
            "verl", slice(args.steps // 3, None))["tailsieve"])
    print("\n### Planner (strong tails, dense, 8 replicas)\n")
    print(_table(["predicted speedup", "band (10–90 %)", "start (q, m)", "simulated on unseen prompts", "plan time s"],
                 [[f"{p.speedup:.3f}", f"{p.band[0]:.3f}–{p.band[1]:.3f}", f"({p.initial_q}, {p.initial_m})",
                   f"{np.mean(actual):.3f} (seeds {', '.join(f'{a:.3f}' for a in actual)})", f"{elapsed:.1f}"]]))
    return {"plan": p.to_json(), "actual": actual}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="experiments_out")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated subset of " + ", ".join(SECTIONS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--pool", type=int, default=2048, help="prompts per generated dataset")
    ap.add_argument("--scales", default="64x8,256x16", help="tails: comma-separated BxN step sizes")
    ap.add_argument("--oracle-time-limit", type=float, default=1.0, help="tails: seconds per clairvoyant search")
    ap.add_argument("--workers", type=int, default=2, help="tails: processes running seeds side by side")
    ap.add_argument("--from-runs", help="tails: tabulate these tails_runs.jsonl (comma list) instead of simulating")
    ap.add_argument("--policies", help="tails: simulate only these policies (comma list; must include verl)")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args)}
    for name in args.only.split(","):
        t = time.perf_counter()
        report[name] = globals()[name](args)
        print(f"\n({name}: {time.perf_counter() - t:.0f} s)")
    (Path(args.out) / "experiments.json").write_text(json.dumps(report, indent=1, default=float), encoding="utf-8")


if __name__ == "__main__":
    main()
