"""`tailsieve` command line. Each subcommand lives in its own module with a ``register(subparsers)``
function that adds its parser and sets ``func``; bad input surfaces as one clear error line."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `tailsieve --help` lists them.
SUBCOMMANDS = ("simulate", "route", "study", "plan", "trace", "compare", "calibrate", "bench")


class CLIError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tailsieve",
        description="TailSieve for verl: simulate, plan, route, trace, compare, calibrate and benchmark "
                    "partial-rollout-guided tail routing.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..core.errors import TailSieveError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (CLIError, TailSieveError, FileNotFoundError) as e:
        print(f"tailsieve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
