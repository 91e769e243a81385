"""`tailsieve verify-cost PATH[:MODEL]`: a measured speculative verify cost next to the engine model.

PATH is the JSON `scripts/gpu/verify_cost.py` writes on a GPU. For every measured (batch, context, k):
the decode step, the verify step of k + 1 query tokens per request, the engine model's first-order
price T(b·(k+1), 0) + T(b, c) − T(b, 0) on the same file's decode rows and its relative error, and the
one-layer draft step as a fraction of the decode step (the engine model's draft cost per draft token).
Pass the same file to --spec-verify-table to price verify steps with the measurement."""

from __future__ import annotations

import argparse
import json

from ..core.engine.perf import parse_perf_model
from ..core.engine.verify_cost import VerifyTable, format_report


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify-cost", help="a measured verify cost (scripts/gpu/verify_cost.py) next to the first-order model",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", metavar="PATH[:MODEL]", help="scripts/gpu/verify_cost.py's JSON (:MODEL picks one shape)")
    p.add_argument("--decode-table", metavar="SPEC",
                   help="also give this perf model's decode step and first-order verify price (what the engine "
                        "model charges with it), e.g. table:h200-dense or table:h200-moe")
    p.add_argument("--json", action="store_true", help="print the report as JSON rows instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    table = VerifyTable.load(args.table)
    rows = table.report(parse_perf_model(args.decode_table) if args.decode_table else None)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{table.source}: {table.model}, verify measured at k = {', '.join(map(str, sorted(table.verify)))}")
        print(format_report(rows))
    return 0
