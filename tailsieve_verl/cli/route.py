"""`tailsieve route`: route one rollout step's groups with a policy and report the makespan."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ..core.kinds import Pool
from ..core.engine.perf import DEFAULT_PERF_MODEL, parse_perf_model
from ..core.routing.policies import POLICIES, Routing, route
from ..core.data.trace import read_trace
from .engine_args import PLANNING_ENGINE, add_engine_args, engine_config_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "route", help="route a trace's groups across replicas with a policy (known lengths)",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", required=True, help="JSONL/Parquet trace or a verl rollout dump")
    p.add_argument("--replicas", "-R", type=int, required=True, help="number of replicas R")
    p.add_argument("--perf-model", default=DEFAULT_PERF_MODEL, help="linear:a=A,c=C | table:NAME[:MODEL] | fitted:...")
    p.add_argument("--policy", choices=list(POLICIES), default="best-k", metavar="POLICY",
                   help="routing policy: " + "; ".join(f"{p.name} = {p.summary}" for p in POLICIES.values()))
    p.add_argument("--k", type=int, help="topk/topk-balanced: groups with the largest max length sent to the tail pool")
    p.add_argument("--tail-replicas", type=int,
                   help="tail-pool replicas m (topk default 1; best-k searches m when unset)")
    p.add_argument("--time-limit", type=float, default=10.0,
                   help="budget in seconds of every search (exact, best-k, clairvoyant-sample); the best found is "
                        "reported when it runs out")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_engine_args(p, defaults=PLANNING_ENGINE)
    p.set_defaults(func=run)


def routing_json(routing: Routing, group_ids: list[str]) -> dict:
    """The machine-readable result: makespan, assignment (trace order) and per-replica times."""
    return {
        "policy": routing.policy,
        "makespan_s": routing.makespan_s,
        # replica per group when groups stay whole, else per group the replica of each sample
        "assignment": ([int(r) for r in routing.assignment] if routing.group_atomic else
                       [[int(r) for r in routing.sample_assignment[start:start + len(finish)]]
                        for start, finish in zip(routing.evaluation.group_starts.tolist(),
                                                 routing.evaluation.response_finish_s)]),
        "group_atomic": routing.group_atomic,
        "replica_times_s": [float(t) for t in routing.evaluation.replica_times_s],
        "group_finish_s": {pid: float(t) for pid, t in zip(group_ids, routing.evaluation.group_finish_s)},
        "k": routing.k,
        "tail_replicas": routing.tail_replicas,
        "optimal": routing.optimal,
        "complete": routing.complete,
        "lower_bound_s": routing.lower_bound_s,
        "gap_to_bound": routing.gap_to_bound,
    }


def run(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    perf = parse_perf_model(args.perf_model)
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    routing = route(args.policy, trace.groups, args.replicas, perf, k=args.k, tail_replicas=args.tail_replicas,
                    engine=engine_config_from_args(args, perf), time_limit_s=args.time_limit, progress=progress)
    if args.json:
        print(json.dumps(routing_json(routing, [g.prompt_id for g in trace])))
        return 0
    _print_table(routing, trace, args, perf.name)
    return 0


def _print_table(routing: Routing, trace, args: argparse.Namespace, perf_name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    m = routing.tail_replicas or 0
    table = Table(title=f"{routing.policy} on {len(trace)} groups, R={args.replicas}, {perf_name}")
    for column in ("replica", "pool", "groups", "responses", "tokens", "max len", "completion s"):
        table.add_column(column, justify="right")
    times = routing.evaluation.replica_times_s
    flat = np.fromiter((v for g in trace for v in g.lengths), dtype=np.int64)
    group_of_sample = np.repeat(np.arange(len(trace)), [g.n for g in trace])
    for r in range(args.replicas):
        on_r = routing.sample_assignment == r
        lengths = flat[on_r].tolist()
        pool = str(Pool.TAIL if r < m else Pool.BULK) if m else "-"
        style = "bold" if times[r] == routing.makespan_s else None
        table.add_row(str(r), pool, str(len(np.unique(group_of_sample[on_r]))), str(len(lengths)), str(sum(lengths)),
                      str(max(lengths, default=0)), f"{times[r]:.3f}", style=style)
    console = Console()
    console.print(table)
    line = f"makespan {routing.makespan_s:.3f} s"
    if routing.k is not None:
        line += f"  (k={routing.k}, tail replicas m={routing.tail_replicas})"
    if not routing.complete:
        line += "  (search cut short by --time-limit: best found)"
    over = "whole-group" if routing.group_atomic else "per-sample"  # a bound holds only over its own assignments
    if routing.gap_to_bound is not None and routing.policy != "exact":
        line += (f"  lower bound over {over} assignments {routing.lower_bound_s:.3f} s "
                 f"(gap {100 * routing.gap_to_bound:.2f} %)")
    if routing.policy == "exact":
        line += ("  optimal over whole-group assignments (search finished)" if routing.optimal else
                 f"  best found; proven lower bound over whole-group assignments {routing.lower_bound_s:.3f} s "
                 f"(gap {100 * routing.gap_to_bound:.2f} %, raise --time-limit to close it)")
    if routing.group_atomic and routing.gap_to_bound is not None:
        line += "; routing single samples (--policy verl, clairvoyant-sample) can be faster"
    console.print(line)
