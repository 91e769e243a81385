"""`tailsieve` command line. Each subcommand lives in its own module with a ``register(subparsers)``
function that adds its parser and sets ``func``. Bad input of any kind (a flag, a file, a spec)
surfaces as one error line on stderr and exit status 2, with every input file left as it was; an
unexpected failure prints one line too (exit 1), and ``TAILSIEVE_DEBUG=1`` shows its traceback."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .checks import CLIError, finish_parser

__all__ = ["CLIError", "build_parser", "main"]

# Subcommand modules, in the order `tailsieve --help` lists them.
SUBCOMMANDS = ("simulate", "route", "study", "plan", "trace", "compare", "calibrate", "bench", "closed-loop",
               "verify-cost")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tailsieve",
        description="TailSieve for verl: simulate, plan, route, trace, compare, calibrate and benchmark "
                    "partial-rollout-guided tail routing.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name.replace('-', '_')}").register(sub)
        finish_parser(name, sub.choices[name])
    return parser


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


def _os_error(e: OSError) -> str:
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    return f"{where}: {e.strerror}" if where and e.strerror else str(e)


def main(argv: list[str] | None = None) -> int:
    from ..core.errors import TailSieveError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    prefix = f"tailsieve {args.command}"
    try:
        return int(args.func(args) or 0)
    except TailSieveError as e:  # CLIError and every core error: bad input, said with its fix
        print(f"{prefix}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # unreadable or unwritable paths, a full disk, a broken pipe
        print(f"{prefix}: error: {_one_line(_os_error(e))}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{prefix}: error: out of memory; the input or the flags ask for more than this machine holds "
              "(check lengths, --batch, --n, --replicas)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug, not bad input: one line unless asked for the traceback
        if os.environ.get("TAILSIEVE_DEBUG"):
            raise
        print(f"{prefix}: internal error: {type(e).__name__}: {_one_line(e)[:500]} (a bug: please report it; "
              "TAILSIEVE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
