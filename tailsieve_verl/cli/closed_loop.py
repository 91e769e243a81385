"""`tailsieve closed-loop`: stock verl's routing and TailSieve's closed loop (selector, controller,
per-prompt record, pools) for many steps on real vLLM OpenAI servers, every step's measured makespan
next to the simulator's prediction for the same lengths and assignment."""

from __future__ import annotations

import argparse
import sys

from ..core.engine.perf import Calibration, TablePerf
from ..core.simulation.sim import SimConfig
from ..core.data.workload import PRESETS, PromptPool, get_preset
from .calibrate import progress_bar
from .checks import CLIError, output_file, write_report
from .engine_args import add_engine_args, prediction_engine

CLOSED_LOOP_POLICIES = "verl,tailsieve"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "closed-loop", help="stock verl vs TailSieve for many steps on real vLLM servers, measured next to predicted",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", action="append", required=True,
                   help="vLLM OpenAI server; repeat for up to R servers (fewer run their replicas one after another)")
    p.add_argument("--model", help="served model name (default: the server's only model)")
    p.add_argument("--calibration", required=True,
                   help="calibration JSON measured on the same server (`tailsieve calibrate`)")
    p.add_argument("--workload", default="strong", choices=sorted(PRESETS), help="workload preset (tail strength)")
    p.add_argument("--median-len", type=float, default=100.0, help="median response length of the workload")
    p.add_argument("--max-len", type=int, default=1000, help="response length cap of the workload")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt length of every group")
    p.add_argument("--pool-size", type=int, default=48,
                   help="prompts in the dataset (smaller than steps × batch: prompts come back every epoch)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the speedups")
    p.add_argument("--replicas", "-R", type=int, default=4)
    p.add_argument("--batch", "-B", type=int, default=16, help="prompt groups per step")
    p.add_argument("--n", type=int, default=4, help="responses per prompt group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=CLOSED_LOOP_POLICIES,
                   help="comma list from verl,uniform,tailsieve,tailsieve-fixed; verl (stock verl) is required")
    p.add_argument("--out", default="closed_loop.json", help="report JSON file to write")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    add_engine_args(p)  # override what the calibration measured of the servers' engine, for the prediction (and the
    # controller's model)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..tools.closed_loop import check_run, closed_loop
    from ..tools.openai_client import OpenAIServer

    out = output_file(args.out, "--out", inputs=[("--calibration", args.calibration)])
    if args.pool_size < 2 * args.batch:
        raise CLIError(f"--pool-size {args.pool_size} is below 2 x --batch ({2 * args.batch}): a prompt is in flight "
                       "at most once, so the dataset needs at least two batches")
    spec = get_preset(args.workload, median_len=args.median_len, max_response_length=args.max_len,
                      prompt_len=args.prompt_len)
    cal = Calibration.load(args.calibration)  # before any server is contacted
    perf = TablePerf(cal)
    engine, note = prediction_engine(args, cal, perf)
    cfg = SimConfig(steps=args.steps, n_replicas=args.replicas, batch_size=args.batch, n=args.n, seed=args.seed,
                    policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()), engine=engine)
    cfg.validate()
    check_run(cfg, args.warmup)
    if note:  # once the input is known good (bad input says one line)
        print(note, file=sys.stderr)
    pool = PromptPool(spec, args.pool_size, seed=args.seed)
    servers = [OpenAIServer(url, args.model) for url in args.url]
    with progress_bar("closed loop", cfg.steps * len(cfg.policies), quiet=args.json) as advance:
        report = closed_loop(cfg, pool, servers, perf, warmup=args.warmup,
                             on_step=lambda name, step, seconds: advance(f"{name} step {step}: {seconds:.2f}s"))
    report["calibration"] = args.calibration
    return write_report(report, out, args.json, print_report)


def print_report(report: dict) -> None:
    cfg = report["config"]
    print(f"{cfg['steps']} steps of B={cfg['batch_size']} x n={cfg['n']} on R={cfg['n_replicas']} replicas, "
          f"workload {report['workload']['name']}, model {report['perf_model']}")
    print(f"{'policy':<16} {'measured s':>10} {'predicted s':>11} {'median |err|':>12} {'meas speedup':>12} "
          f"{'pred speedup':>12} {'share of gain':>13}   (mean makespans after warmup; speedups vs stock verl)")
    for name, s in report["policies"].items():
        share = s.get("share_of_predicted_gain")
        print(f"{name:<16} {s['mean_measured_makespan_s']:>10.2f} {s['mean_predicted_makespan_s']:>11.2f} "
              f"{s['median_prediction_error']:>11.1%} {s.get('measured_speedup', 1.0):>11.3f}x "
              f"{s.get('predicted_speedup', 1.0):>11.3f}x {'' if share is None else f'{share:>12.0%}':>13}")
    print(f"prediction error over every step: median {report['median_prediction_error']:.1%}, "
          f"worst {report['worst_prediction_error']:.1%}")
