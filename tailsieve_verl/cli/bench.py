"""`tailsieve bench`: run the stock-verl, group round-robin (`uniform`), TailSieve and oracle assignments of one
rollout step for real on vLLM OpenAI servers (forced response lengths) and print measured makespans and
speedups next to the simulator's prediction with a calibration measured on the same server."""

from __future__ import annotations

import argparse
import sys

from ..core.errors import TailSieveError
from ..core.engine.perf import Calibration, TablePerf
from ..core.data.trace import MAX_TOKENS, read_trace
from ..core.data.workload import generate_trace
from .calibrate import int_list, progress_bar
from .checks import output_file, write_report
from .engine_args import add_engine_args, engine_config_from_args, prediction_engine


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="measure stock verl vs TailSieve (and group routing, oracle) on real vLLM servers",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="one rollout step: JSONL/Parquet groups or a verl rollout dump")
    source.add_argument("--preset", help="a synthetic workload preset (weak, real, strong) instead of a trace")
    p.add_argument("--groups", type=int, default=16, help="prompt groups B of a --preset step")
    p.add_argument("--group-size", type=int, default=4, help="responses n per group of a --preset step")
    p.add_argument("--seed", type=int, default=0, help="seed of a --preset step")
    p.add_argument("--replicas", "-R", type=int, required=True, help="replicas R of the step")
    p.add_argument("--url", action="append", required=True,
                   help="vLLM OpenAI server; repeat for up to R servers (replicas run concurrently), fewer "
                        "servers run their replicas one after another")
    p.add_argument("--model", help="served model name (default: the server's only model)")
    p.add_argument("--calibration", help="calibration JSON measured on the same server (default: measure one "
                                         "now, covering the concurrency the step needs, and save it next to --out "
                                         "as OUT.calibration.json)")
    p.add_argument("--policies", default="verl,uniform,tailsieve,oracle",
                   help="comma list from verl,uniform,tailsieve,oracle; verl (stock verl) is the baseline and required")
    p.add_argument("--group-atomic", action="store_true",
                   help="TailSieve's pools route whole groups round-robin instead of per sample")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every policy")
    p.add_argument("--q", type=int, help="TailSieve carried groups (with --m; default: the simulator's best split)")
    p.add_argument("--m", type=int, help="TailSieve tail replicas (with --q)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply every response length (fit a small server)")
    p.add_argument("--max-len", type=int, help="clip response lengths after scaling")
    p.add_argument("--oracle-time-limit", type=float, default=10.0, help="seconds for the exact oracle search")
    p.add_argument("--calibration-prompt-lens", type=int_list, default=(16, 448),
                   help="prompt lengths of a calibration measured here")
    p.add_argument("--out", default="bench.json", help="report JSON file to write")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    add_engine_args(p)  # override what the calibration measured of the servers' engine, for the prediction
    p.set_defaults(func=run)


def _calibration_batches(groups, max_num_seqs: int | None) -> tuple[int, ...]:
    """Powers of two up to the largest per-replica concurrency any assignment can reach."""
    need = sum(g.n for g in groups)
    if max_num_seqs:
        need = min(need, max_num_seqs)
    batches, b = [1], 2
    while b < need:
        batches.append(b)
        b *= 2
    batches.append(max(need, 2))
    return tuple(sorted(set(batches)))


def run(args: argparse.Namespace) -> int:
    from ..tools.bench import bench, check_lengths, scale_groups
    from ..tools.calibrate import SweepPlan, calibrate, write_calibration
    from ..tools.openai_client import OpenAIServer

    if (args.q is None) != (args.m is None):
        raise TailSieveError("give --q and --m together (or neither, to let the simulator pick the split)")
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    inputs = [("--trace", args.trace), ("--calibration", args.calibration)]
    out = output_file(args.out, "--out", inputs=inputs)
    if not args.calibration:
        output_file(out.with_name(out.stem + ".calibration.json"), "--out (its calibration)", inputs=inputs)
    if args.trace:
        trace = read_trace(args.trace)
    else:
        trace = generate_trace(args.preset, args.groups, args.group_size, seed=args.seed)
    longest = max(g.max_len for g in trace.groups) * args.length_scale
    if longest > MAX_TOKENS and (args.max_len is None or args.max_len > MAX_TOKENS):
        raise TailSieveError(f"--length-scale {args.length_scale:g} makes the longest response {longest:.0f} tokens, "
                             f"above the {MAX_TOKENS:,}-token limit; lower it or set --max-len")
    groups = scale_groups(trace.groups, args.length_scale, args.max_len)
    given_cal = Calibration.load(args.calibration) if args.calibration else None  # before any server is contacted
    servers = [OpenAIServer(url, args.model) for url in args.url]
    for server in servers:
        check_lengths(groups, server.max_model_len)
    if given_cal is not None:
        cal = given_cal
    else:
        plan = SweepPlan(batches=_calibration_batches(groups, engine_config_from_args(args, None).max_num_seqs),
                         prompt_lens=tuple(args.calibration_prompt_lens))
        with progress_bar("calibrate", plan.repeats * len(plan.points), quiet=args.json) as advance:
            doc = calibrate(servers[0], plan, on_sample=lambda done, total, batch, context, step_s: advance(
                f"batch {batch} ctx {context:.0f}"))
        cal = write_calibration(doc, out.with_name(out.stem + ".calibration.json"))
    perf = TablePerf(cal)
    engine, note = prediction_engine(args, cal, perf)
    if note:
        print(note, file=sys.stderr)
    runs = args.repeats * len(policies) + ("tailsieve" in policies)
    with progress_bar("bench", runs, quiet=args.json) as advance:
        report = bench(groups, servers, args.replicas, perf, policies=policies, repeats=args.repeats,
                       split=None if args.q is None else (args.q, args.m), engine=engine,
                       oracle_time_limit_s=args.oracle_time_limit, group_atomic=args.group_atomic,
                       on_run=lambda d, t, name, s: advance(f"{name}: {s:.2f}s"))
    report["trace"] = str(args.trace) if args.trace else f"preset:{args.preset}:B={args.groups}:n={args.group_size}:seed={args.seed}"
    report["max_len"] = args.max_len
    report["length_scale"] = args.length_scale
    report["calibration"] = cal.source
    return write_report(report, out, args.json, print_report)


def print_report(report: dict) -> None:
    print(f"{report['n_groups']} groups / {report['n_responses']} responses on R={report['n_replicas']} "
          f"({report['replicas_per_server_run']}; {len(report['servers'])} server(s)), {report['repeats']} repeats, "
          f"model {report['perf_model']}")
    sel = report.get("tailsieve_selection")
    if sel:
        print(f"tailsieve: q={sel['q']} carried groups on m={sel['m']} tail replicas (selected by a real "
              f"partial-rollout cutoff)")
    head = f"{'policy':<10} {'predicted s':>11} {'measured s':>11} {'range s':>15} {'pred err':>9} " \
           f"{'pred speedup':>12} {'meas speedup':>12} {'meas/pred':>9}   (speedups vs stock verl)"
    print(head)
    for row in report["policies"]:
        lo, hi = row["measured_makespan_range_s"]
        print(f"{row['policy']:<10} {row['predicted_makespan_s']:>11.2f} {row['measured_makespan_s']:>11.2f} "
              f"{f'{lo:.2f}–{hi:.2f}':>15} {row['prediction_error']:>+8.1%} {row['predicted_speedup']:>11.3f}x "
              f"{row['measured_speedup']:>11.3f}x {row['measured_over_predicted_speedup']:>8.1%}")
