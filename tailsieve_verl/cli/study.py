"""`tailsieve study`: offline optimality-gap study of best-k, fixed 10 % isolation and random
uniform routing against the exact / best-known optimum, as in §2.2 of the paper "TailSieve:
Partial-Rollout-Guided Tail Routing for LLM Rollouts". Writes study.json and study_cdf.png into
--out (a directory, as for `tailsieve simulate`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..core.engine.perf import DEFAULT_PERF_MODEL, parse_perf_model
from ..core.routing.study import PAPER_RESULT, STUDY_POLICIES, StudyConfig, StudyResult, run_study
from ..core.data.workload import PRESETS
from .checks import default_perf_model_label, output_dir, perf_model_file
from .engine_args import add_engine_args, engine_config_from_args
from .lengths import add_length_cap_args

REPORT, PLOT = "study.json", "study_cdf.png"

DEFAULTS = StudyConfig()


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "study", help="optimality-gap study of routing policies over many instances",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--instances", "-N", type=int, default=DEFAULTS.instances, help="instances N")
    p.add_argument("--trajectories", "-T", type=int, default=DEFAULTS.trajectories, help="responses per instance T")
    p.add_argument("--group-size", type=int, default=DEFAULTS.group_size,
                   help="responses per atomic prompt group (1: route every trajectory on its own)")
    p.add_argument("--replicas", "-R", type=int, default=DEFAULTS.replicas, help="replicas R")
    p.add_argument("--perf-model", default=DEFAULT_PERF_MODEL)
    p.add_argument("--workload", default=DEFAULTS.workload,
                   help="preset weak|real|strong, or a JSONL/Parquet trace or rollout-dump directory to draw prompts from")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed of the workload draw and random routing")
    p.add_argument("--time-limit", type=float, default=DEFAULTS.time_limit_s,
                   help="exact search budget per instance (s); unfinished searches report a proven bound")
    p.add_argument("--out", default="tailsieve_out", help=f"directory for {REPORT} and the CDF plot {PLOT}")
    p.add_argument("--no-plots", action="store_true", help="skip the CDF plot")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    add_length_cap_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = StudyConfig(instances=args.instances, trajectories=args.trajectories, group_size=args.group_size,
                         replicas=args.replicas, perf_model=args.perf_model, workload=args.workload,
                         seed=args.seed, time_limit_s=args.time_limit, max_response_length=args.max_response_length,
                         max_prompt_length=args.max_prompt_length,
                         engine=engine_config_from_args(args, parse_perf_model(args.perf_model)))
    config.validate()
    workload_file = args.workload if args.workload not in PRESETS and os.path.exists(args.workload) else None
    out = output_dir(args.out, "--out", (REPORT, PLOT),
                     inputs=[("--workload", workload_file), ("--perf-model file", perf_model_file(args.perf_model))])
    progress = None if args.json or not sys.stderr.isatty() else _progress
    result = run_study(config, progress)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / REPORT]
    with open(out / REPORT, "w", encoding="utf-8") as f:
        json.dump(result.to_json(), f, indent=1)
    if not args.no_plots:
        from ..viz.study import plot_gap_cdf

        plot_gap_cdf(result, out / PLOT)
        written.append(out / PLOT)
    if args.json:
        print(json.dumps(result.summary()))
    else:
        _print_summary(result, written)
    return 0


def _progress(done: int, total: int) -> None:
    print(f"\r  instance {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)


def _print_summary(result: StudyResult, written: list[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = result.config
    summary = result.summary()
    table = Table(title=f"{c.instances} instances × {c.trajectories} trajectories (groups of {c.group_size}), "
                        f"R={c.replicas}, workload {c.workload}, {default_perf_model_label(c.perf_model)}")
    for column in ("policy", "median gap", "P90 gap", "worst gap", "within 1 %"):
        table.add_column(column, justify="right")
    def row(name: str, s: dict, style: str | None = None) -> None:
        table.add_row(name, f"{100 * s['median_gap']:.2f} %", f"{100 * s['p90_gap']:.2f} %",
                      f"{100 * s['worst_gap']:.2f} %", f"{100 * s['share_within_1pct']:.0f} %", style=style)

    for p in STUDY_POLICIES:
        row(p, summary["policies"][p])
    row("best-k vs proven bound", summary["policies"]["best-k"]["to_lower_bound"], style="italic")
    table.add_row("paper best-k", "", "", f"<= {100 * PAPER_RESULT['best-k worst gap']:.0f} %",
                  f"{100 * PAPER_RESULT['best-k share within 1%']:.0f} %", style="dim")
    console = Console()
    console.print(table)
    o = summary["oracle"]
    console.print(f"optimum proven on {o['proven_optimal']}/{o['instances']} instances; best-known optimum within "
                  f"{100 * o['worst_optimum_to_bound_gap']:.2f} % of a proven lower bound everywhere "
                  f"(median {100 * o['median_optimum_to_bound_gap']:.2f} %); {result.elapsed_s:.1f} s")
    console.print("gaps are to the best-known optimum (a lower estimate of the true gap); 'vs proven bound' is an "
                  "upper estimate")
    console.print("wrote " + " and ".join(str(p) for p in written))
