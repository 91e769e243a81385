"""Read the metric logs verl 0.9.1's trackers write and compare runs (a TailSieve recipe next to
stock verl's).

Formats, as written by ``verl/utils/tracking.py`` (``trainer.logger``):

* ``file``: ``FileLogger`` writes ``$VERL_FILE_LOGGER_PATH``, else
  ``$VERL_FILE_LOGGER_ROOT/<project_name>/<experiment_name>.jsonl`` (root defaults to the working
  directory), one ``{"step": N, "data": {metric: value, ...}}`` object per ``Tracking.log`` call.
* ``console``: ``LocalLogger`` prints ``step:N - key:value - key:value`` (numbers only, values
  through ``pprint.pformat``, so numpy scalars may read ``np.float64(1.5)``) inside verl's
  TaskRunner Ray actor, so the driver's stdout shows Ray's ``(TaskRunnerV1 pid=N)`` prefix; save
  the run's stdout.
* ``tensorboard``: ``SummaryWriter`` event files under ``$TENSORBOARD_DIR``, else
  ``tensorboard_log/<project_name>/<experiment_name>/``; one scalar per metric and step.
* ``wandb`` and ``mlflow``: read in ``tracker_logs`` (an offline W&B run folder or
  ``wandb://ENTITY/PROJECT/RUN_ID``; an MLflow store with the run: ``sqlite:///mlflow.db#RUN``).

The metrics compared are verl's own: ``timing_s/gen`` (the V1 trainer times the replay-buffer
sample, i.e. the whole rollout, as "gen"), ``timing_s/step``, ``critic/score/mean`` (reward before
KL) and ``response_length/mean``. Runs are compared over the steps they all logged. Next to them, the
held-out scores verl's ``_validate`` logs (``val-core/<data_source>/<variable>/<metric>``, e.g.
``val-core/tailsieve_math/reward/mean@1``): each run's first and last validation (``trainer.val_before_train``
logs one at step 0, ``trainer.test_freq`` the later ones), which need not fall on common steps.
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..core.errors import TailSieveError, needs_package
from .speedup_interval import SpeedupInterval, paired_speedup

GEN_TIME = "timing_s/gen"
STEP_TIME = "timing_s/step"
REWARD = "critic/score/mean"
RESPONSE_LENGTH = "response_length/mean"
COMPARED = (GEN_TIME, STEP_TIME, REWARD, RESPONSE_LENGTH)
VALIDATION_PREFIX = "val-core/"

# verl's TaskRunner is a Ray actor, so its console lines reach the driver's stdout with Ray's
# "(TaskRunnerV1 pid=123, ip=...)" prefix, often colour-coded.
_CONSOLE_LINE = re.compile(r"^(?:\([^)]*pid=\d+[^)]*\)\s+)?step:(\d+)( - .*)?$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")


class CompareError(TailSieveError):
    """A run's logs are missing or unreadable, or the runs cannot be compared."""


@dataclass
class RunLog:
    """All scalar metrics of one run: ``series[key][step] = value``.

    A metric written again for a step it already has (a run resumed from a checkpoint logs the
    steps after the checkpoint a second time) keeps the **last** write, in file order (tensorboard:
    the newest event file); those steps are listed in ``repeated_steps`` so the caller can say so."""

    name: str
    source: str
    fmt: str
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    repeated_steps: set[int] = field(default_factory=set)

    def add(self, step: int, key: str, value: float) -> None:
        values = self.series.setdefault(key, {})
        if int(step) in values:
            self.repeated_steps.add(int(step))
        values[int(step)] = float(value)

    @property
    def steps(self) -> list[int]:
        return sorted({s for values in self.series.values() for s in values})

    def values(self, key: str, steps: Sequence[int]) -> np.ndarray:
        """The metric at ``steps`` (NaN where it was not logged)."""
        values = self.series.get(key, {})
        return np.array([values.get(s, math.nan) for s in steps], dtype=float)


# ---------------------------------------------------------------------------------------------- readers


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def read_file_logger(path: Path) -> RunLog:
    run = RunLog(path.stem, str(path), "file")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CompareError(f"{path}:{lineno}: not UTF-8 text (a binary file?); expected verl's file logger "
                                   '(one {"step": N, "data": {...}} per line)') from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CompareError(f"{path}:{lineno}: not valid JSON ({e.msg}); expected verl's file logger "
                                   '(one {"step": N, "data": {...}} per line)') from None
            except (ValueError, RecursionError) as e:
                raise CompareError(f"{path}:{lineno}: not usable JSON ({str(e).splitlines()[0]})") from None
            if not isinstance(record, dict) or "step" not in record or not isinstance(record.get("data"), dict):
                raise CompareError(f"{path}:{lineno}: not a verl file-logger line; expected "
                                   '{"step": N, "data": {...}}')
            step = record["step"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise CompareError(f"{path}:{lineno}: step = {step!r} is not a non-negative integer")
            for key, value in record["data"].items():
                number = _number(value)
                if number is not None:
                    run.add(step, key, number)
    return run


def _console_value(text: str) -> float | None:
    text = text.strip()
    scalar = _NUMPY_SCALAR.match(text)
    if scalar:
        text = scalar.group(1)
    if text in ("nan", "inf", "-inf"):
        return float(text)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return _number(value)


def read_console_log(path: Path) -> RunLog:
    run = RunLog(path.stem, str(path), "console")
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            match = _CONSOLE_LINE.match(_ANSI.sub("", line).rstrip("\n"))
            if not match:
                continue
            step = int(match.group(1))
            for item in (match.group(2) or "").split(" - ")[1:]:
                key, sep, value = item.rpartition(":")
                number = _console_value(value) if sep else None
                if key and number is not None:
                    run.add(step, key, number)
    return run


def read_tensorboard(directory: Path) -> RunLog:
    with needs_package("tensorboard", f"{directory}: reading tensorboard event files"):
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    run = RunLog(directory.name, str(directory), "tensorboard")
    files = sorted(directory.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    for file in files:
        try:
            for event in EventFileLoader(str(file)).Load():
                if not event.HasField("summary"):
                    continue
                for value in event.summary.value:
                    kind = value.WhichOneof("value")
                    if kind == "simple_value":
                        run.add(event.step, value.tag, value.simple_value)
                    elif kind == "tensor":
                        array = tensor_util.make_ndarray(value.tensor)
                        if array.size == 1 and np.issubdtype(array.dtype, np.number):
                            run.add(event.step, value.tag, float(array.reshape(-1)[0]))
        except Exception as e:  # tensorboard raises its own DataLossError, protobuf DecodeError, ...
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CompareError(f"{file}: not a readable tensorboard event file ({reason})") from None
    return run


def _looks_like_file_logger(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        record = json.loads(first)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return False
    return isinstance(record, dict) and "step" in record and isinstance(record.get("data"), dict)


def read_run(path: str | os.PathLike, name: str | None = None) -> RunLog:
    """One run's metrics from a file-logger JSONL, a saved console log, a tensorboard event file, a
    W&B run (offline folder, ``.wandb`` file or ``wandb://ENTITY/PROJECT/RUN_ID``), an MLflow run
    (``STORE#RUN``, see ``tracker_logs.mlflow_store``) or a directory holding exactly one of these
    (file logger, then tensorboard, W&B, MLflow, console)."""
    from . import tracker_logs

    text = os.fspath(path)
    if text.startswith(tracker_logs.WANDB_URL):
        return _named(tracker_logs.read_wandb_online(text), text, name)
    if not os.path.exists(text) and (text.startswith(tracker_logs.MLFLOW_SCHEMES) or "#" in text):
        return _named(tracker_logs.read_mlflow(text), text, name)
    path = Path(path)
    if not path.exists():
        raise CompareError(f"{path}: no such file or directory")
    if not path.is_file() and not path.is_dir():
        raise CompareError(f"{path}: not a regular file or directory; give a verl log file or log directory")
    if path.is_file():
        if "tfevents" in path.name:
            run = read_tensorboard(path.parent)
        elif path.suffix == ".wandb":
            run = tracker_logs.read_wandb_file(path)
        elif path.suffix == ".db":
            run = tracker_logs.read_mlflow(text)
        elif path.suffix == ".jsonl" or _looks_like_file_logger(path):
            run = read_file_logger(path)
        else:
            run = read_console_log(path)
    else:
        jsonl = [p for p in sorted(path.rglob("*.jsonl")) if _looks_like_file_logger(p)]
        if len(jsonl) > 1:
            raise CompareError(f"{path}: several verl file-logger files ({', '.join(str(p) for p in jsonl[:4])}); "
                               "pass the one of the run you mean")
        if jsonl:
            run = read_file_logger(jsonl[0])
        elif any(path.rglob("events.out.tfevents.*")):
            run = read_tensorboard(path)
        elif wandb_file := tracker_logs.wandb_run_file(path):
            run = tracker_logs.read_wandb_file(wandb_file, wandb_file.parent)
        elif tracker_logs.is_mlflow_run_folder(path) or tracker_logs.is_mlflow_store(path):
            run = tracker_logs.read_mlflow(text)
        else:
            logs = [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in (".log", ".txt", ".out")]
            runs = [r for r in (read_console_log(p) for p in logs) if r.series]
            if len(runs) != 1:
                raise CompareError(f"{path}: found {'no' if not runs else 'several'} verl logs; expected one file-logger "
                                   "JSONL (trainer.logger has 'file'), tensorboard event files, a W&B run folder "
                                   "(run-*.wandb), an MLflow mlruns folder, or one saved console log")
            run = runs[0]
    return _named(run, path, name)


def _named(run: RunLog, path: str | os.PathLike, name: str | None) -> RunLog:
    if not run.series:
        raise CompareError(f"{path}: no metrics found in verl's {run.fmt} format (step lines / records with numbers)")
    if name:
        run.name = name
    return run


# ---------------------------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class RunSummary:
    name: str
    fmt: str
    steps: int
    gen_s: float
    step_s: float
    reward: float
    response_length: float
    gen_speedup: float  # baseline mean gen time / this run's
    step_speedup: float
    extra: dict[str, float] = field(default_factory=dict)
    # held-out scores: metric (without "val-core/") -> [first step, its value, last step, its value]
    validation: dict[str, list] = field(default_factory=dict)
    # the speedups' paired bootstrap intervals against the baseline (None for the baseline itself)
    gen_interval: SpeedupInterval | None = None
    step_interval: SpeedupInterval | None = None

    def to_json(self) -> dict:
        return {k: (v.to_json() if isinstance(v, SpeedupInterval) else
                    None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.__dict__.items()}


def parse_step_range(text: str | None) -> tuple[int | None, int | None]:
    """``A:B`` (inclusive; either side may be empty) → bounds."""
    if not text:
        return None, None
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo) if lo else None, int(hi) if hi else None) if sep else (int(lo), int(lo))
    except ValueError:
        raise CompareError(f"--steps {text!r}: expected A:B, A: or :B with integer steps") from None
    return bounds


def validation_scores(run: RunLog) -> dict[str, list]:
    """Each ``val-core/*`` metric's first and last logged validation: [step, value, step, value]."""
    scores = {}
    for key, values in sorted(run.series.items()):
        if key.startswith(VALIDATION_PREFIX) and values:
            first, last = min(values), max(values)
            scores[key[len(VALIDATION_PREFIX):]] = [first, values[first], last, values[last]]
    return scores


def common_steps(runs: Sequence[RunLog], skip: int = 0, step_range: tuple[int | None, int | None] = (None, None)) -> list[int]:
    """Steps logged with a generation time by every run, after skipping each run's first ``skip``."""
    lo, hi = step_range
    shared: set[int] | None = None
    for run in runs:
        steps = sorted(run.series.get(GEN_TIME, {}) or run.steps)[skip:]
        steps = {s for s in steps if (lo is None or s >= lo) and (hi is None or s <= hi)}
        shared = steps if shared is None else shared & steps
    if not shared:
        raise CompareError("the runs share no logged step (after --skip-steps/--steps); compare runs of the same "
                           "length or widen the window")
    return sorted(shared)


def check_times(runs: Sequence[RunLog], steps: Sequence[int]) -> None:
    """Refuse a generation or step time that no real step takes (NaN, infinite, zero or negative):
    it would turn into a speedup of "n/a" or a ratio that one broken record drives."""
    for run in runs:
        for key in (GEN_TIME, STEP_TIME):
            values = run.series.get(key, {})
            for step in steps:
                value = values.get(step)
                if value is not None and not (math.isfinite(value) and value > 0):
                    raise CompareError(f"{run.source}: step {step} logs {key} = {value!r}, not a positive finite "
                                       "time (a broken log?); leave the step out with --steps or --skip-steps")


def check_metrics(runs: Sequence[RunLog], keys: Iterable[str]) -> None:
    """Refuse a ``--metric`` that no run logged (a typo would be a column of n/a), naming close keys."""
    logged = sorted({key for run in runs for key in run.series})
    for key in keys:
        if key not in logged:
            close = difflib.get_close_matches(key, logged, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; the runs log e.g. {', '.join(logged[:3])}"
            raise CompareError(f"--metric {key!r}: no run logs this metric{hint}")


def _mean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else math.nan


def is_stock_verl(run: RunLog) -> bool:
    """A run without any ``tailsieve/*`` metric: verl's own trainer and router (the baseline)."""
    return not any(key.startswith("tailsieve/") for key in run.series)


def default_baseline(runs: Sequence[RunLog]) -> int:
    """The first stock-verl run, else the first run: speedups are measured against stock verl."""
    return next((i for i, run in enumerate(runs) if is_stock_verl(run)), 0)


def compare_runs(runs: Sequence[RunLog], baseline: int = 0, skip: int = 0,
                 step_range: tuple[int | None, int | None] = (None, None),
                 extra_keys: Iterable[str] = (), confidence: float = 0.95) -> tuple[list[int], list[RunSummary]]:
    """Means over the common steps and speedups against ``runs[baseline]``, each speedup with its
    paired bootstrap interval on those steps (``speedup_interval.paired_speedup``)."""
    if not 0 < confidence < 1:
        raise CompareError(f"--confidence {confidence}: must lie strictly between 0 and 1 (e.g. 0.95)")
    if len(runs) < 2:
        raise CompareError("give at least two runs (a baseline and a run to compare with it)")
    if not 0 <= baseline < len(runs):
        raise CompareError(f"baseline index {baseline} out of range for {len(runs)} runs")
    for run in runs:
        if GEN_TIME not in run.series:
            raise CompareError(f"{run.source}: no '{GEN_TIME}' metric; is this a verl PPO/GRPO training log?")
    extra_keys = list(extra_keys)
    check_metrics(runs, extra_keys)
    steps = common_steps(runs, skip, step_range)
    check_times(runs, steps)
    means = [{key: _mean(run.values(key, steps)) for key in (*COMPARED, *extra_keys)} for run in runs]
    base = means[baseline]
    summaries = []
    for i, (run, m) in enumerate(zip(runs, means)):
        gen, step = ((None, None) if i == baseline else
                     (paired_speedup(runs[baseline].values(key, steps), run.values(key, steps), confidence)
                      for key in (GEN_TIME, STEP_TIME)))
        summaries.append(RunSummary(
            name=run.name, fmt=run.fmt, steps=len(steps), gen_s=m[GEN_TIME], step_s=m[STEP_TIME],
            reward=m[REWARD], response_length=m[RESPONSE_LENGTH],
            gen_speedup=base[GEN_TIME] / m[GEN_TIME] if m[GEN_TIME] > 0 else math.nan,
            step_speedup=base[STEP_TIME] / m[STEP_TIME] if m[STEP_TIME] > 0 else math.nan,
            extra={key: m[key] for key in extra_keys}, validation=validation_scores(run),
            gen_interval=gen, step_interval=step,
        ))
    return steps, summaries
