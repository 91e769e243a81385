"""`tailsieve route`: route one rollout step's groups with a policy and report the makespan."""

from __future__ import annotations

import argparse
import json

import numpy as np

from ..core.perf import DEFAULT_PERF_MODEL, parse_perf_model
from ..core.policies import POLICIES, Routing, route
from ..core.trace import read_trace


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "route", help="route a trace's groups across replicas with a policy (known lengths)",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", required=True, help="JSONL/Parquet trace or a verl rollout dump")
    p.add_argument("--replicas", "-R", type=int, required=True, help="number of replicas R")
    p.add_argument("--perf-model", default=DEFAULT_PERF_MODEL, help="linear:a=A,c=C | table:NAME[:MODEL] | fitted:...")
    p.add_argument("--policy", choices=POLICIES, default="best-k", help="routing policy")
    p.add_argument("--k", type=int, help="topk/topk-balanced: groups with the largest max length sent to the tail pool")
    p.add_argument("--tail-replicas", type=int,
                   help="tail-pool replicas m (topk default 1; best-k searches m when unset)")
    p.add_argument("--max-num-seqs", type=int, help="per-replica concurrency cap (default: none)")
    p.add_argument("--time-limit", type=float, default=10.0, help="exact: search budget in seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def routing_json(routing: Routing, group_ids: list[str]) -> dict:
    """The machine-readable result: makespan, assignment (trace order) and per-replica times."""
    return {
        "policy": routing.policy,
        "makespan_s": routing.makespan_s,
        "assignment": [int(r) for r in routing.assignment],
        "replica_times_s": [float(t) for t in routing.evaluation.replica_times_s],
        "group_finish_s": {pid: float(t) for pid, t in zip(group_ids, routing.evaluation.group_finish_s)},
        "k": routing.k,
        "tail_replicas": routing.tail_replicas,
        "optimal": routing.optimal,
        "lower_bound_s": routing.lower_bound_s,
    }


def run(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    perf = parse_perf_model(args.perf_model)
    routing = route(args.policy, trace.groups, args.replicas, perf, k=args.k, tail_replicas=args.tail_replicas,
                    max_num_seqs=args.max_num_seqs, time_limit_s=args.time_limit)
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
    for r in range(args.replicas):
        members = np.flatnonzero(routing.assignment == r)
        lengths = [v for i in members for v in trace[i].lengths]
        pool = "tail" if r < m else ("bulk" if m else "-")
        style = "bold" if times[r] == routing.makespan_s else None
        table.add_row(str(r), pool, str(len(members)), str(len(lengths)), str(sum(lengths)),
                      str(max(lengths, default=0)), f"{times[r]:.3f}", style=style)
    console = Console()
    console.print(table)
    line = f"makespan {routing.makespan_s:.3f} s"
    if routing.k is not None:
        line += f"  (k={routing.k}, tail replicas m={routing.tail_replicas})"
    if routing.policy == "exact":
        line += ("  optimal (search finished)" if routing.optimal else
                 f"  best found; proven lower bound {routing.lower_bound_s:.3f} s "
                 f"(gap {100 * routing.gap_to_bound:.2f} %, raise --time-limit to close it)")
    console.print(line)
