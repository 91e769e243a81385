"""`tailsieve compare RUN RUN [RUN...]`: compare verl training runs from their tracker logs.

Each RUN is what verl's trackers (trainer.logger) wrote for one run:
  file         the file logger's JSONL (VERL_FILE_LOGGER_PATH, else
               VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl), one {"step": N, "data": {KEY: VALUE}}
               per line
  tensorboard  a tensorboard_log/<project>/<experiment>/ directory (or one events.out.tfevents.* file)
  wandb        an offline run folder (wandb/offline-run-*/) or wandb://ENTITY/PROJECT/RUN_ID
  mlflow       STORE#RUN: sqlite:///mlflow.db#PROJECT/EXPERIMENT, file:mlruns#RUN_ID, or an
               mlruns/<experiment id>/<run id> folder
  console      a saved stdout with verl's "step:N - KEY:VALUE - ..." lines
or a directory holding one of them. The keys read: timing_s/gen and timing_s/step (every compared step
must log a positive, finite time), critic/score/mean (reward), response_length/mean, val-core/*
(held-out scores) and each --metric KEY (logged by at least one run).
The baseline is the first stock-verl run (one without tailsieve/* metrics), else the first run,
or --baseline NAME; it is listed first. Means are over the steps every run logged.
Each speedup (baseline mean / run mean, generation and step time) comes with a paired bootstrap
interval over those steps: "faster" or "slower" when the interval excludes 1, else "not resolved",
with the number of further steps that would resolve the observed difference at its observed noise.
A step logged twice (a run resumed from a checkpoint repeats the steps after it) keeps its last
record, in file order; a warning line on stderr names the run and the steps."""

from __future__ import annotations

import argparse
import json
import math
import sys

from ..tools.run_logs import CompareError, RunLog, compare_runs, default_baseline, parse_step_range, read_run
from .checks import IMAGE_SUFFIXES, FloatRule, output_file


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="compare verl runs (generation/step time, speedup, reward, response length, validation scores) from their logs",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run log: file-logger JSONL, tensorboard dir, W&B run folder or wandb://ENTITY/PROJECT/RUN_ID, "
                        "MLflow STORE#RUN, console log")
    p.add_argument("--names", help="comma-separated display names, one per run (default: file or directory name)")
    p.add_argument("--baseline", default=None, help="name of the baseline run (default: the first stock-verl run, else the first)")
    p.add_argument("--skip-steps", type=int, default=0, help="drop each run's first K logged steps (warm-up)")
    p.add_argument("--steps", default=None, help="inclusive step window A:B (A: or :B open-ended)")
    p.add_argument("--metric", action="append", default=[], metavar="KEY",
                   help="also average this logged metric (repeatable), e.g. tailsieve/q")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write per-step curves to this image (" + ", ".join("." + s for s in IMAGE_SUFFIXES) + ")")
    p.add_argument("--confidence", type=FloatRule(0.0, 0.9999), default=0.95,
                   help="confidence level of the speedup intervals (default 0.95)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    names = args.names.split(",") if args.names else [None] * len(args.runs)
    if len(names) != len(args.runs):
        raise CompareError(f"--names has {len(names)} names for {len(args.runs)} runs")
    twice = sorted({name for name in names if name and names.count(name) > 1})
    if twice:
        raise CompareError(f"--names gives {', '.join(map(repr, twice))} to more than one run; "
                           "give each run its own name")
    if args.skip_steps < 0:
        raise CompareError("--skip-steps must be >= 0")
    if args.plot:
        output_file(args.plot, "--plot", inputs=[("run log", path) for path in args.runs], suffixes=IMAGE_SUFFIXES)
    runs = [read_run(path, name) for path, name in zip(args.runs, names)]
    check_distinct_names(runs, given=bool(args.names))
    baseline = default_baseline(runs)
    if args.baseline is not None:
        matches = [i for i, r in enumerate(runs) if r.name == args.baseline]
        if len(matches) != 1:
            raise CompareError(f"--baseline {args.baseline!r} matches {len(matches)} runs; names: "
                               f"{', '.join(r.name for r in runs)}")
        baseline = matches[0]
    steps, summaries = compare_runs(runs, baseline, args.skip_steps, parse_step_range(args.steps), args.metric,
                                    args.confidence)
    for run in runs:  # after every check, so that a bad input still reads as one error line
        warn_repeated_steps(run)
    plot = None
    if args.plot:
        from ..viz.compare import plot_compare

        order = [baseline] + [i for i in range(len(runs)) if i != baseline]
        plot = str(plot_compare([runs[i] for i in order], [summaries[i] for i in order], steps, args.plot))
    if args.json:
        print(json.dumps({"baseline": runs[baseline].name, "steps": steps, "confidence": args.confidence,
                          "runs": [s.to_json() for s in summaries], "plot": plot}))
        return 0
    _print_table(summaries, baseline, steps, args.metric)
    _print_intervals(summaries, baseline, args.confidence)
    if plot:
        print(f"plot: {plot}")
    return 0


def check_distinct_names(runs: list[RunLog], given: bool) -> None:
    """Two runs of one name would be two rows no reader can tell apart (and --baseline could not pick)."""
    seen: dict[str, str] = {}
    for run in runs:
        if run.name in seen:
            fix = "give each run its own name in --names" if given else "tell them apart with --names"
            raise CompareError(f"runs {seen[run.name]} and {run.source} are both named {run.name!r}; {fix}")
        seen[run.name] = run.source


def warn_repeated_steps(run: RunLog) -> None:
    """One stderr line when a run logged some steps twice (a resumed run): the last record is kept."""
    if not run.repeated_steps:
        return
    steps = sorted(run.repeated_steps)
    shown = ", ".join(map(str, steps[:8])) + (f", ... ({len(steps)} steps)" if len(steps) > 8 else "")
    print(f"tailsieve compare: warning: {run.source} logs step(s) {shown} more than once (a resumed run?); "
          "keeping the last record of each", file=sys.stderr)


def _validation_cell(score: list | None) -> str:
    """A held-out score's first and last validation, with their steps."""
    if score is None:
        return "n/a"
    first_step, first, last_step, last = score
    return f"{first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})"


def _fmt(value: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def _print_table(summaries, baseline: int, steps: list[int], extra: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"steps {steps[0]}..{steps[-1]} ({len(steps)} common), baseline: {summaries[baseline].name}")
    held_out = sorted({key for s in summaries for key in s.validation})
    for column in ("run", "log", "gen time (s)", "step time (s)", "gen speedup", "step speedup", "reward",
                   "resp. length", *extra, *(f"val {key} (first -> last)" for key in held_out)):
        table.add_column(column, justify="left" if column in ("run", "log") else "right")
    for s in [summaries[baseline]] + [x for i, x in enumerate(summaries) if i != baseline]:  # baseline first
        table.add_row(s.name, s.fmt, _fmt(s.gen_s), _fmt(s.step_s), f"{_fmt(s.gen_speedup, 3)}x",
                      f"{_fmt(s.step_speedup, 3)}x", _fmt(s.reward, 4), _fmt(s.response_length, 1),
                      *(_fmt(s.extra[k], 3) for k in extra), *(_validation_cell(s.validation.get(k)) for k in held_out))
    Console(width=160).print(table)


def _interval_cells(interval) -> tuple[str, str, str, str]:
    """Speedup, interval, verdict, and the paired steps that would resolve the difference."""
    if interval.steps < 2:
        return f"{_fmt(interval.ratio, 3)}x", "n/a", f"{interval.verdict} ({interval.steps} paired step(s))", "n/a"
    if interval.verdict != "not resolved":
        to_resolve = "resolved"
    elif interval.more_steps is None:
        to_resolve = "n/a (no difference)" if interval.ratio == 1 else "n/a"
    else:
        to_resolve = f"~{interval.more_steps} more ({interval.steps_needed} in all)"
    return (f"{_fmt(interval.ratio, 3)}x", f"[{_fmt(interval.low, 3)}, {_fmt(interval.high, 3)}]", interval.verdict,
            to_resolve)


def _print_intervals(summaries, baseline: int, confidence: float) -> None:
    from rich.console import Console
    from rich.table import Table

    level = f"{confidence * 100:.4g}%"
    table = Table(title=f"speedup vs {summaries[baseline].name}: paired bootstrap over the common steps, {level} interval")
    for column in ("run", "time", "speedup", f"{level} interval", "verdict", "steps to resolve"):
        table.add_column(column, justify="left" if column in ("run", "time", "verdict") else "right")
    for s in (x for i, x in enumerate(summaries) if i != baseline):
        table.add_row(s.name, "generation", *_interval_cells(s.gen_interval))
        table.add_row(s.name, "step", *_interval_cells(s.step_interval))
    Console(width=160).print(table)
