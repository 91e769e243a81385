"""Argument checks shared by every subcommand: each bad value stops with one error line (exit 2)
before any work starts, and no command writes over a file it reads.

* Numbers: every ``int``/``float`` flag of every subcommand gets its range from :data:`NUMBER_RULES`
  (one table, applied by :func:`apply_number_rules` when the ``tailsieve`` parser is built). Floats
  must be finite; upper bounds sit far above any real cluster or run and only stop a typo from
  allocating unbounded memory or running for ever. A numeric flag without a rule fails a test.
* Paths: :func:`output_file` and :func:`output_dir` refuse a directory where a file is meant (and
  the reverse) and any output that is also an input; :func:`perf_model_file` names the calibration
  file a ``--perf-model`` spec reads, so that it counts as an input too.
* Help: :class:`HelpFormatter` prints each default once (never ``(default: None)``, nor a second
  default after one the help text already states) and names the rows the default model uses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..core.errors import TailSieveError
from ..core.engine.perf import BUNDLED_TABLES, DEFAULT_PERF_MODEL, KNOWN_SPECS
from ..core.data.trace import MAX_TOKENS

MAX_REPLICAS = 4096  # rollout replicas (R, m): far above any cluster verl runs on
MAX_GROUPS = 100_000  # prompt groups of one step (B, k, q)
MAX_GROUP_SIZE = 4096  # responses per prompt group (n)
MAX_COUNT = 1_000_000  # steps, instances, trajectories, seeds, repeats, concurrency limits (max_num_seqs)
MAX_SECONDS = 7 * 24 * 3600.0  # any time budget or timeout
MAX_SEED = 2**32 - 1


class CLIError(TailSieveError):
    """A user-facing error of the command line: printed as one line, exit status 2."""


@dataclass(frozen=True)
class IntRule:
    lo: int
    hi: int

    def __call__(self, text: str) -> int:
        try:
            value = int(text, 10)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected an integer in {self.lo}..{self.hi:,}, got {text!r}") from None
        if not self.lo <= value <= self.hi:
            raise argparse.ArgumentTypeError(f"expected an integer in {self.lo}..{self.hi:,}, got {text}")
        return value

    def __repr__(self) -> str:  # argparse names the type in some messages
        return "int"


@dataclass(frozen=True)
class FloatRule:
    lo: float
    hi: float
    lo_open: bool = True  # lo itself is excluded (e.g. a time budget must be > 0)

    def __call__(self, text: str) -> float:
        bound = f"{'>' if self.lo_open else '>='} {self.lo:g} and <= {self.hi:g}"
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text}")
        if value < self.lo or (self.lo_open and value == self.lo) or value > self.hi:
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text}")
        return value

    def __repr__(self) -> str:
        return "float"


# (subcommand, dest) first, then dest alone. Lower bounds that depend on other flags (k <= groups,
# m < R, ...) stay with the command, which names both flags.
NUMBER_RULES: dict[str | tuple[str, str], IntRule | FloatRule] = {
    "replicas": IntRule(1, MAX_REPLICAS),
    "tail_replicas": IntRule(0, MAX_REPLICAS),
    "fixed_tail_replicas": IntRule(1, MAX_REPLICAS),
    "m": IntRule(0, MAX_REPLICAS),
    "batch": IntRule(1, MAX_GROUPS),
    "groups": IntRule(1, MAX_GROUPS),
    "k": IntRule(0, MAX_GROUPS),
    "q": IntRule(0, MAX_GROUPS),
    "n": IntRule(1, MAX_GROUP_SIZE),
    "group_size": IntRule(1, MAX_GROUP_SIZE),
    "pool_size": IntRule(1, 10 * MAX_GROUPS),
    "steps": IntRule(1, MAX_COUNT),
    "seeds": IntRule(1, 10_000),
    "instances": IntRule(1, MAX_COUNT),
    "trajectories": IntRule(1, MAX_COUNT),
    "repeats": IntRule(1, 10_000),
    "seed": IntRule(0, MAX_SEED),
    "max_num_seqs": IntRule(1, MAX_COUNT),
    "max_len": IntRule(1, MAX_TOKENS),
    "decode_short": IntRule(1, MAX_TOKENS),
    "decode_long": IntRule(1, MAX_TOKENS),
    "prefill_batch": IntRule(1, MAX_COUNT),
    "temperature": FloatRule(0.0, 10.0, lo_open=False),
    "skip_steps": IntRule(0, 10**12),
    "warmup": IntRule(0, MAX_COUNT),
    "median_len": FloatRule(1.0, float(MAX_TOKENS), lo_open=False),
    "prompt_len": IntRule(0, MAX_TOKENS),
    "max_response_length": IntRule(1, MAX_TOKENS),
    "jobs": IntRule(1, 256),
    "max_prompt_length": IntRule(1, MAX_TOKENS),
    ("trace", "step"): IntRule(0, 10**12),
    "time_limit": FloatRule(0.0, MAX_SECONDS),
    "oracle_time_limit": FloatRule(0.0, MAX_SECONDS),
    "timeout": FloatRule(0.0, MAX_SECONDS),
    "length_scale": FloatRule(0.0, 1e6),
}


def number_rule(command: str, dest: str) -> IntRule | FloatRule | None:
    return NUMBER_RULES.get((command, dest), NUMBER_RULES.get(dest))


def apply_number_rules(command: str, parser: argparse.ArgumentParser) -> None:
    """Give every plain ``int``/``float`` option of ``parser`` its checked type from the table (a flag
    without a rule keeps its plain type; tests/cli fails on it)."""
    for action in parser._actions:
        rule = number_rule(command, action.dest) if action.type in (int, float) else None
        if rule is not None and isinstance(rule, IntRule) == (action.type is int):
            action.type = rule


# ---------------------------------------------------------------------------------------------- help

PERF_MODEL_HELP = f"performance model: {KNOWN_SPECS}"
COMMON_HELP = {
    "replicas": "rollout replicas R",
    "perf_model": PERF_MODEL_HELP,
    "seed": "random seed (integer >= 0)",
    "steps": "training steps to simulate",
}


def default_perf_model_label(spec: str = DEFAULT_PERF_MODEL) -> str:
    """``table:h200-dense (qwen3-1.7b rows)``: which rows a bundled table without ``:MODEL`` uses."""
    kind, _, body = spec.partition(":")
    if kind in ("table", "fitted") and body in BUNDLED_TABLES:
        return f"{spec} ({BUNDLED_TABLES[body][1]} rows)"
    return spec


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; each default shown once and never as ``None``/``False``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default in (None, False, argparse.SUPPRESS) or action.default == [] or "default" in text
                or not action.option_strings):
            return text
        if action.dest == "perf_model" and isinstance(action.default, str):
            return f"{text} (default: {default_perf_model_label(action.default)})".replace("%", "%%")
        return f"{text} (default: %(default)s)"


def finish_parser(command: str, parser: argparse.ArgumentParser) -> None:
    """Shared help text, formatter and number rules for one subcommand's parser."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if action.dest in COMMON_HELP and (action.help is None or action.dest == "perf_model"):
            action.help = COMMON_HELP[action.dest]
    apply_number_rules(command, parser)


# ---------------------------------------------------------------------------------------------- paths

def _same(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def is_inside(path: str | os.PathLike, directory: str | os.PathLike) -> bool:
    """``path`` lies in ``directory`` or below it (symlinks resolved)."""
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def perf_model_file(spec: str | None) -> Path | None:
    """The calibration file a ``table:PATH[:MODEL]`` / ``fitted:...`` spec reads, if it names one."""
    if not spec:
        return None
    kind, _, body = str(spec).partition(":")
    if kind not in ("table", "fitted") or not body:
        return None
    for candidate in (body, body.rpartition(":")[0]):
        if candidate and candidate not in BUNDLED_TABLES and os.path.isfile(candidate):
            return Path(candidate)
    return None


def _check_not_input(path: Path, flag: str, inputs: Iterable[tuple[str, object]]) -> None:
    for role, value in inputs:
        if value is None or value == "":
            continue
        if _same(path, Path(value)):
            raise CLIError(f"{flag} {path} is also the {role} this command reads; refusing to overwrite an input, "
                           "write the output somewhere else")


def output_file(value: str | os.PathLike, flag: str, inputs: Iterable[tuple[str, object]] = (),
                suffixes: Iterable[str] | None = None) -> Path:
    """A file this command will write: not a directory, not an input; its parent may be created."""
    if str(value).strip() == "":
        raise CLIError(f"{flag} is empty; give a file path")
    path = Path(value)
    if path.is_dir():
        raise CLIError(f"{flag} {path} is a directory; give a file path")
    if path.exists() and not path.is_file():
        raise CLIError(f"{flag} {path} exists and is not a regular file; give a file path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CLIError(f"{flag} {path}: {parent} is a file, not a directory")
            break
    if suffixes is not None:
        suffixes = tuple(suffixes)
        if path.suffix.lower().lstrip(".") not in suffixes:
            raise CLIError(f"{flag} {path}: unsupported file type {path.suffix or '(none)'!r}; use one of "
                           + ", ".join("." + s for s in suffixes))
    _check_not_input(path, flag, list(inputs))
    return path


def output_dir(value: str | os.PathLike, flag: str, writes: Iterable[str],
               inputs: Iterable[tuple[str, object]] = ()) -> Path:
    """A directory this command writes ``writes`` into: not an existing file, and none of the files
    it writes is an input."""
    if str(value).strip() == "":
        raise CLIError(f"{flag} is empty; give a directory")
    path = Path(value)
    writes = list(writes)
    if path.exists() and not path.is_dir():
        raise CLIError(f"{flag} {path} is a file; {flag} is a directory (this command writes "
                       f"{', '.join(writes)} into it): give a directory path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CLIError(f"{flag} {path}: {parent} is a file, not a directory")
            break
    inputs = list(inputs)
    for name in writes:
        _check_not_input(path / name, f"{flag} {path} (its {name})", inputs)
    return path


IMAGE_SUFFIXES = ("png", "pdf", "svg", "jpg", "jpeg")


def write_report(report: dict, out: Path, as_json: bool, print_table) -> int:
    """Write ``report`` to ``out``; print it as JSON, or as ``print_table``'s table and the path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
        print(f"wrote {out}")
    return 0
