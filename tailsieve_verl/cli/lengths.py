"""verl's length caps as flags, in verl's words (``--max-response-length``: ``data.max_response_length``,
``--max-prompt-length``: ``data.max_prompt_length``), shared by ``simulate``, ``plan`` and ``study``:
generation stops at the response cap, and a longer prompt is cut to the prompt cap. A bundled preset
has no prompt lengths of its own (0 tokens), so there the prompt cap is every prompt's length."""

from __future__ import annotations

import argparse

from ..core.data.trace import Trace
from ..core.data.workload import WorkloadSpec, cap_trace, get_preset


def add_length_cap_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("length caps (verl's data.max_response_length / data.max_prompt_length)")
    g.add_argument("--max-response-length", type=int, metavar="TOKENS",
                   help="response cap: a longer generation stops there (default: a preset's 16384, a trace's own "
                        "lengths)")
    g.add_argument("--max-prompt-length", type=int, metavar="TOKENS",
                   help="prompt cap: a longer logged prompt is cut to it; a preset's prompts (0 tokens without "
                        "it) are this long")


def preset(name: str, args: argparse.Namespace) -> WorkloadSpec:
    """The bundled preset ``name`` under the caps the flags give."""
    return get_preset(name, max_response_length=args.max_response_length, prompt_len=args.max_prompt_length)


def capped(trace: Trace, args: argparse.Namespace) -> Trace:
    """A logged trace under the caps the flags give."""
    return cap_trace(trace, args.max_response_length, args.max_prompt_length)
