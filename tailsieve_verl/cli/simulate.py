"""`tailsieve simulate`: closed-loop comparison of stock verl's per-sample routing, group round-robin
(the `uniform` policy), TailSieve (fixed and adaptive allocation) and length-knowing references over
many training steps, on a bundled workload preset or your own prompts' observed lengths, with a
measured H200 performance model."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..core.engine.perf import DEFAULT_PERF_MODEL, parse_perf_model
from ..core.simulation.sim import (ALL_POLICIES, POLICIES, POOL_ENGINE_POLICIES, SPEC_POLICIES, STOCK_SPEC_POLICIES,
                                   STOCK_TP, SimConfig, SimResult, simulate)
from ..core.data.trace import read_trace
from ..core.data.workload import PRESETS, PromptPool
from .checks import output_dir, perf_model_file
from .checks import CLIError
from .engine_args import (PLANNING_ENGINE, add_engine_args, add_pool_speculation_args, add_width_arg,
                          engine_config_from_args, pool_engines_from_args, speculation_from_args, stock_widths)
from .lengths import add_length_cap_args, capped, preset
from .recommend import from_simulation

DEFAULTS = SimConfig()
DEFAULT_WORKLOAD = "real"
MAIN_JOB_BATCH, MAIN_JOB_N = 512, 16  # the main job: a DAPO-sized step (512 prompts × 16 samples) under verl's
#   rollout defaults (--engine-defaults auto)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="closed-loop multi-step simulation: stock verl vs TailSieve vs clairvoyant references",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = p.add_mutually_exclusive_group()  # as in plan: one source of lengths, never one silently ignored
    source.add_argument("--workload", default=None, choices=sorted(PRESETS),
                        help=f"bundled workload preset (tail strength; default: {DEFAULT_WORKLOAD})")
    source.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                        help='instead of a preset: observed lengths per prompt, lines {"prompt_id": str, '
                             '"lengths": [int, ...]}')
    p.add_argument("--pool-size", type=int, default=2048, help="prompts in a generated workload's dataset")
    p.add_argument("--steps", type=int, default=DEFAULTS.steps)
    p.add_argument("--replicas", "-R", type=int, default=DEFAULTS.n_replicas)
    add_width_arg(p)
    p.add_argument("--batch", "-B", type=int, default=MAIN_JOB_BATCH, help="prompt groups per step")
    p.add_argument("--n", type=int, default=MAIN_JOB_N, help="responses per prompt group")
    p.add_argument("--perf-model", default=DEFAULT_PERF_MODEL, help="performance model spec, e.g. table:h200-moe")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)
    p.add_argument("--policies", default=None,
                   help="comma-separated subset of " + ", ".join(ALL_POLICIES) + " (default: " + ",".join(POLICIES)
                        + f", and {STOCK_TP}, stock verl at the best single width of the GPUs in hindsight, where a "
                        "bundled model shape prices the widths; best-static, the best fixed (q, m) "
                        "in hindsight, runs a grid of TailSieve runs: opt-in; verl-redraw, stock verl with its own length "
                        "draws, shows the run's noise floor; " + ", ".join(SPEC_POLICIES) + ": speculative decoding, "
                        "opt-in, as the --spec-* flags describe it: stock verl at the best depth in hindsight, with "
                        "vLLM's documented batch-size schedule, with the best schedule of a grid in hindsight; TailSieve "
                        "with a deep tail pool and the schedule in the bulk pool, with the schedule everywhere, and "
                        "tailsieve-auto: the split of tailsieve-spec or stock verl with speculation, chosen online)")
    p.add_argument("--fixed-tail-replicas", type=int, default=None,
                   help="tail replicas of tailsieve-fixed (default replicas // 2)")
    p.add_argument("--record-replaces-aborts", action="store_true",
                   help="TailSieve aborts only for the fresh prompts its per-prompt length record cannot predict "
                        "(+tailsieve.record_replaces_aborts=true)")
    p.add_argument("--group-atomic", action="store_true",
                   help="TailSieve pools route whole groups round-robin (the paper's setting) instead of "
                        "spreading each group's samples by least in flight like stock verl")
    p.add_argument("--oracle-time-limit", type=float, default=DEFAULTS.oracle_time_limit_s,
                   help="CPU seconds per step for each clairvoyant (k, m) search")
    p.add_argument("--out", default="tailsieve_out", help="directory for plots and simulate.json")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="processes running the policies side by side (the same results; default: 2, or 1 on one CPU)")
    add_length_cap_args(p)
    add_engine_args(p, defaults=PLANNING_ENGINE)
    add_pool_speculation_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    perf = parse_perf_model(args.perf_model)
    policies = tuple(p.strip() for p in (args.policies or ",".join(POLICIES)).split(",") if p.strip())
    spec_policies = any(p in SPEC_POLICIES for p in policies)
    engine, speculation = engine_config_from_args(args, perf, spec_policies), speculation_from_args(args)
    widths = stock_widths(args, perf, engine)
    if args.policies is None and len(widths) > 1:
        policies += (STOCK_TP,)
    pool_engines = pool_engines_from_args(args, engine, speculation)
    if any(pool_engines.values()) and not set(policies) & set(POOL_ENGINE_POLICIES):
        raise CLIError(f"--tail-*/--bulk-* speculation flags set TailSieve's pool engines, but no policy here has "
                       f"pools: add one of {', '.join(POOL_ENGINE_POLICIES)} to --policies")
    if args.record_replaces_aborts and not any(p.startswith("tailsieve") or p == "best-static" for p in policies):
        raise CLIError("--record-replaces-aborts changes TailSieve's aborts, but no TailSieve policy runs here: add "
                       "tailsieve to --policies")
    config = SimConfig(steps=args.steps, n_replicas=args.replicas, batch_size=args.batch, n=args.n, seed=args.seed,
                       policies=policies, record_replaces_aborts=args.record_replaces_aborts,
                       fixed_tail_replicas=args.fixed_tail_replicas, group_atomic=args.group_atomic,
                       oracle_time_limit_s=args.oracle_time_limit, engine=engine, speculation=speculation,
                       stock_widths=tuple(e for t, e in widths.items() if t != engine.width), **pool_engines)
    config.validate()
    output_dir(args.out, "--out", ("simulate.json", "makespan_per_step.png", "controller_trajectories.png",
                                   "gantt_step.png"),
               inputs=[("--prompts file", args.prompts), ("--perf-model file", perf_model_file(args.perf_model))])
    if args.prompts:
        trace = capped(read_trace(args.prompts), args)
        pool, workload = PromptPool.from_trace(trace, seed=args.seed), f"prompts:{args.prompts}"
    else:
        workload = args.workload or DEFAULT_WORKLOAD
        pool = PromptPool(preset(workload, args), args.pool_size, seed=args.seed)
    result = _run_with_progress(config, pool, perf, workload, show=not args.json, jobs=args.jobs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = result.to_json()
    report["recommendation"] = from_simulation(result, args.perf_model)
    (out / "simulate.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    plots = []
    if not args.no_plots:
        from ..viz.simulate import write_plots

        plots = write_plots(result, out)
    if args.json:
        print(json.dumps(report))
    else:
        _print_summary(result, out, plots)
        print(report["recommendation"])
    return 0


def _run_with_progress(config: SimConfig, pool: PromptPool, perf, workload: str, show: bool, jobs: int) -> SimResult:
    if not show:
        return simulate(config, pool, perf, workload, jobs=jobs)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("simulating"), BarColumn(), TextColumn("{task.completed}/{task.total} policy-steps"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("sim", total=config.steps * len(config.policies))
        return simulate(config, pool, perf, workload, progress=lambda done, total: progress.update(task, completed=done),
                        jobs=jobs)


def _print_summary(result: SimResult, out: Path, plots: list) -> None:
    from rich.console import Console
    from rich.table import Table

    c = result.config
    vs_verl, vs_uniform = result.speedup_vs("verl"), result.speedup_vs("uniform")
    best_stock = result.best_stock
    # against the best stock configuration: a column of its own where stock speculation ran, or a wider width won
    vs_best = (result.speedup_vs(best_stock) if any(p in STOCK_SPEC_POLICIES for p in result.policies)
               or best_stock == STOCK_TP else None)
    table = Table(title=f"{c.steps} steps, workload {result.workload}, R={c.n_replicas}"
                        f"{f' × TP{c.engine.width}' if c.engine.width > 1 else ''}, B={c.batch_size}×{c.n}, {result.perf}")
    table.add_column("policy", no_wrap=True)
    bias = result.length_bias()
    for column in ("mean makespan", "vs stock verl") + (("vs best stock",) if vs_best is not None else ()) + (
            "vs group RR", "final q", "final m", "wasted tokens",
                   "lost / dup / stale", "max deferral", "mean length", "length KS / noise"):
        table.add_column(column, justify="right")
    for name, r in result.policies.items():
        last = r.records[-1]
        tailsieve = name.startswith("tailsieve")
        table.add_row(name + (f" ({r.choice})" if r.choice else ""), f"{r.mean_makespan_s:.2f} s",
                      f"{vs_verl[name]:.3f}×" if name in vs_verl else "-",
                      *([f"{vs_best[name]:.3f}×" if name in vs_best else "-"] if vs_best is not None else []),
                      f"{vs_uniform[name]:.3f}×" if name in vs_uniform else "-",
                      str(last.next_q) if tailsieve else "-", str(last.next_m) if tailsieve else "-",
                      f"{100 * r.wasted_fraction:.1f} %", f"{r.lost} / {r.duplicated} / {r.stale}",
                      f"{r.max_deferral_steps} step{'s' if r.max_deferral_steps != 1 else ''}",
                      f"{r.consumed_lengths.mean():.0f}",
                      f"{bias[name][0]:.3f} / {bias[name][1]:.3f}" if name in bias else "-")
    console = Console(width=max(Console().width, 175))  # a pipe reports 80 columns: keep rows on one line
    console.print(table)
    if any(name.startswith("clairvoyant") for name in result.policies):
        console.print("clairvoyant-* know each step's lengths and route one step at a time: references, not "
                      "deployable. TailSieve defers a long group by at most one step (max deferral), so a "
                      "TailSieve speedup above them is a bug until shown otherwise.")
    if STOCK_TP in result.policies:
        console.print(width_line(result), soft_wrap=True)
    if best_stock and best_stock not in ("verl", STOCK_TP):
        console.print(f"best stock configuration: {best_stock} ({result.policies[best_stock].choice}); verl-spec and "
                      "verl-dynsd-best are picked in hindsight, which flatters stock verl.")
    for warning in result.warnings():
        console.print(f"[bold yellow]warning:[/] {warning}")
    if "verl-redraw" in vs_verl:
        console.print(f"verl-redraw is stock verl with its own length draws: {vs_verl['verl-redraw']:.3f}× is how far "
                      "one run of this length can be off by sampling alone; the other policies share their draws.")
    console.print(f"wrote {out / 'simulate.json'}" + "".join(f", {p}" for p in plots))


def width_line(result: SimResult) -> str:
    """Stock verl at each single width of the run's GPUs against the run's own, and the strongest: the baseline."""
    c, tp = result.config, result.policies[STOCK_TP]
    own = result.policies["verl"].mean_makespan_s if "verl" in result.policies else None
    gpus = c.n_replicas * c.engine.width
    runs = ", ".join(f"TP{t} × {gpus // t} {own / r.mean_makespan_s:.3f}×" if own else f"TP{t} × {gpus // t}"
                     for t, r in sorted(tp.alternatives.items()))
    best = int(tp.choice.removeprefix("tp="))
    if best == c.engine.width:
        return f"stock verl at each single width of {gpus} GPUs ({STOCK_TP}): {runs}; the strongest, TP{best}, is " \
               "stock verl as run"
    baseline = ", the baseline (vs best stock)" if result.best_stock == STOCK_TP else ""
    tailsieve = ("it leaves one replica: no TailSieve split" if gpus // best < 2 else
                 f"TailSieve on it: rerun with --tensor-parallel-size {best} --replicas {gpus // best}")
    return f"stock verl at each single width of {gpus} GPUs ({STOCK_TP}): {runs}; the strongest is TP{best}{baseline}; " \
           f"{tailsieve}"
