"""`tailsieve compare` on logs written by verl 0.9.1's own trackers (verl.utils.tracking.Tracking
with the file, console and tensorboard backends), for a baseline and a faster run."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from tailsieve_verl.cli import compare as compare_cli
from tailsieve_verl.tools.run_logs import (
    GEN_TIME,
    REWARD,
    RESPONSE_LENGTH,
    STEP_TIME,
    CompareError,
    RunLog,
    compare_runs,
    read_run,
)

STEPS = 6
RNG = np.random.default_rng(7)
RUNS = {
    "samepath": {"gen": RNG.uniform(100, 140, STEPS), "other": 30.0, "reward": RNG.uniform(0.3, 0.6, STEPS),
                 "length": RNG.uniform(900, 1300, STEPS)},
    "tailsieve": {"gen": RNG.uniform(60, 90, STEPS), "other": 30.0, "reward": RNG.uniform(0.3, 0.6, STEPS),
                  "length": RNG.uniform(900, 1300, STEPS)},
}


def step_metrics(spec: dict, i: int) -> dict:
    gen = np.float64(spec["gen"][i])  # numpy scalars, as verl's metric reductions produce
    return {
        GEN_TIME: gen,
        STEP_TIME: gen + spec["other"],
        REWARD: np.float32(spec["reward"][i]),
        RESPONSE_LENGTH: float(spec["length"][i]),
        "tailsieve/q": i,
        "timing_s/update_actor": 12.5,
    }


@pytest.fixture(scope="module")
def verl_logs(tmp_path_factory):
    """Run verl's Tracking for both runs with every local backend; console stdout saved to a file."""
    import contextlib
    import io
    import os

    from verl.utils.tracking import Tracking

    root = tmp_path_factory.mktemp("logs")
    saved = {k: os.environ.get(k) for k in ("VERL_FILE_LOGGER_ROOT", "TENSORBOARD_DIR", "VERL_FILE_LOGGER_PATH")}
    os.environ.pop("VERL_FILE_LOGGER_PATH", None)
    os.environ["VERL_FILE_LOGGER_ROOT"] = str(root / "file")
    try:
        for name, spec in RUNS.items():
            os.environ["TENSORBOARD_DIR"] = str(root / "tensorboard_log" / "tailsieve" / name)
            console = io.StringIO()
            with contextlib.redirect_stdout(console):
                tracker = Tracking("tailsieve", name, default_backend=["file", "console", "tensorboard"])
                for i in range(STEPS):
                    tracker.log(step_metrics(spec, i), step=i + 1)
                tracker.finish()
            (root / f"{name}.log").write_text(console.getvalue(), encoding="utf-8")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return root


def expected(name: str, steps: slice = slice(None)) -> dict:
    spec = RUNS[name]
    return {"gen": spec["gen"][steps].mean(), "step": (spec["gen"][steps] + spec["other"]).mean(),
            "reward": spec["reward"][steps].astype(np.float32).mean(), "length": spec["length"][steps].mean()}


@pytest.mark.parametrize("fmt", ["file", "console", "tensorboard"])
def test_each_tracker_format_gives_the_logged_means(verl_logs, fmt):
    paths = {
        "file": [verl_logs / "file" / "tailsieve" / f"{n}.jsonl" for n in RUNS],
        "console": [verl_logs / f"{n}.log" for n in RUNS],
        "tensorboard": [verl_logs / "tensorboard_log" / "tailsieve" / n for n in RUNS],
    }[fmt]
    runs = [read_run(p) for p in paths]
    assert [r.fmt for r in runs] == [fmt, fmt]
    assert [r.name for r in runs] == list(RUNS)
    steps, (base, fast) = compare_runs(runs, extra_keys=["tailsieve/q"])
    assert steps == list(range(1, STEPS + 1))
    tol = 1e-5 if fmt == "tensorboard" else 1e-9  # tensorboard stores float32
    for summary, name in ((base, "samepath"), (fast, "tailsieve")):
        want = expected(name)
        assert summary.gen_s == pytest.approx(want["gen"], rel=tol)
        assert summary.step_s == pytest.approx(want["step"], rel=tol)
        assert summary.reward == pytest.approx(want["reward"], rel=1e-5)
        assert summary.response_length == pytest.approx(want["length"], rel=tol)
        assert summary.extra["tailsieve/q"] == pytest.approx(np.mean(range(STEPS)))
    assert base.gen_speedup == pytest.approx(1.0)
    assert fast.gen_speedup == pytest.approx(expected("samepath")["gen"] / expected("tailsieve")["gen"], rel=tol)
    assert fast.step_speedup == pytest.approx(expected("samepath")["step"] / expected("tailsieve")["step"], rel=tol)
    assert fast.gen_speedup > fast.step_speedup > 1.0


def test_directories_are_searched_for_the_run_log(verl_logs):
    run = read_run(verl_logs / "file" / "tailsieve" / "samepath.jsonl")
    assert read_run(verl_logs / "tensorboard_log" / "tailsieve" / "samepath").series.keys() == run.series.keys()
    with pytest.raises(CompareError, match="several verl file-logger files"):
        read_run(verl_logs / "file")


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare_cli.register(parser.add_subparsers())
    return parser.parse_args(["compare", *argv])


def test_cli_window_baseline_plot_and_json(verl_logs, tmp_path, capsys):
    files = [str(verl_logs / "file" / "tailsieve" / f"{n}.jsonl") for n in RUNS]
    plot = tmp_path / "cmp.png"
    args = cli_args(*files, "--skip-steps", "1", "--steps", ":5", "--baseline", "tailsieve", "--plot", str(plot),
                    "--json", "--metric", "tailsieve/q")
    assert compare_cli.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["baseline"] == "tailsieve" and out["steps"] == [2, 3, 4, 5]
    samepath = next(r for r in out["runs"] if r["name"] == "samepath")
    want_base, want = expected("tailsieve", slice(1, 5)), expected("samepath", slice(1, 5))
    assert samepath["gen_s"] == pytest.approx(want["gen"])
    assert samepath["gen_speedup"] == pytest.approx(want_base["gen"] / want["gen"])
    assert plot.exists() and plot.stat().st_size > 10_000

    assert compare_cli.run(cli_args(*files, "--names", "base,ts")) == 0
    table = capsys.readouterr().out
    assert "base" in table and "ts" in table and "gen speedup" in table


def test_bad_inputs_are_clear_errors(verl_logs, tmp_path):
    good = str(verl_logs / "file" / "tailsieve" / "samepath.jsonl")
    with pytest.raises(CompareError, match="at least two runs"):
        compare_runs([read_run(good)])
    with pytest.raises(CompareError, match="no such file"):
        read_run(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "data": {"x": 1}}\nnot json\n')
    with pytest.raises(CompareError, match="bad.jsonl:2: not valid JSON"):
        read_run(bad)
    no_gen = tmp_path / "nogen.jsonl"
    no_gen.write_text('{"step": 1, "data": {"critic/score/mean": 0.5}}\n')
    with pytest.raises(CompareError, match="no 'timing_s/gen' metric"):
        compare_runs([read_run(good), read_run(no_gen)])
    with pytest.raises(CompareError, match="share no logged step"):
        compare_runs([read_run(good), read_run(good)], step_range=(100, None))
    with pytest.raises(CompareError, match="--names has 1 names for 2 runs"):
        compare_cli.run(cli_args(good, good, "--names", "a"))
    empty = tmp_path / "empty.log"
    empty.write_text("nothing verl-like here\n")
    with pytest.raises(CompareError, match="no metrics found"):
        read_run(empty)


def test_console_parser_reads_numpy_reprs_and_nan(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("(TaskRunner pid=1) noise\n"
                   "(TaskRunnerV1 pid=4242) step:1 - timing_s/gen:np.float64(12.5) - critic/score/mean:nan - "
                   "response_length/mean:300\n"
                   "\x1b[36m(TaskRunnerV1 pid=4242, ip=127.0.0.1)\x1b[0m step:2 - timing_s/gen:10.0 - "
                   "critic/score/mean:0.25 - response_length/mean:np.int64(500)\n"
                   "(raylet) step:3 - timing_s/gen:1.0\n")
    run = read_run(log)
    assert run.series[GEN_TIME] == {1: 12.5, 2: 10.0}
    assert math.isnan(run.series[REWARD][1]) and run.series[REWARD][2] == 0.25
    assert run.series[RESPONSE_LENGTH] == {1: 300.0, 2: 500.0}


def test_stock_verl_run_is_the_default_baseline_and_listed_first(capsys):
    from tailsieve_verl.cli.compare import _print_table
    from tailsieve_verl.tools.run_logs import RunLog, default_baseline

    tailsieve, stock = RunLog("ts", "a", "file"), RunLog("verl", "b", "file")
    for step in (1, 2, 3):
        tailsieve.add(step, GEN_TIME, 8.0)
        tailsieve.add(step, STEP_TIME, 10.0)
        tailsieve.add(step, "tailsieve/q", 2.0)
        stock.add(step, GEN_TIME, 10.0)
        stock.add(step, STEP_TIME, 12.0)
    runs = [tailsieve, stock]
    assert default_baseline(runs) == 1
    assert default_baseline([tailsieve]) == 0
    steps, summaries = compare_runs(runs, default_baseline(runs))
    assert summaries[0].gen_speedup == pytest.approx(10.0 / 8.0)
    _print_table(summaries, 1, steps, [])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert rows[0].split("│")[1].strip() == "verl"


def test_validation_scores_are_shown_first_and_last_next_to_the_generation_time(tmp_path, capsys):
    """Issue 31: an A/B of the recipes reports each arm's held-out score, as verl's _validate logs it
    (val_before_train at step 0, then every test_freq steps), beside the generation time."""
    from verl.utils.tracking import Tracking

    key = "val-core/tailsieve_math/reward/mean@1"
    paths = []
    for name, scores in (("verl", {0: 0.25, 2: 0.5}), ("tailsieve", {0: 0.25, 2: 0.375})):
        path = tmp_path / f"{name}.jsonl"
        os_env = {"VERL_FILE_LOGGER_PATH": str(path)}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in os_env.items():
                mp.setenv(k, v)
            tracker = Tracking("tailsieve", name, default_backend=["file"])
            tracker.log({key: scores[0]}, step=0)
            for step in (1, 2):
                tracker.log({GEN_TIME: 10.0 if name == "verl" else 8.0, STEP_TIME: 12.0}, step=step)
            tracker.log({key: scores[2]}, step=2)
            tracker.finish()
        paths.append(str(path))
    steps, summaries = compare_runs([read_run(p) for p in paths])
    assert steps == [1, 2]  # the step-0 validation is not a training step
    assert summaries[1].validation == {"tailsieve_math/reward/mean@1": [0, 0.25, 2, 0.375]}
    compare_cli.run(argparse.Namespace(runs=paths, names=None, baseline=None, skip_steps=0, steps=None, metric=[],
                                       plot=None, json=False, confidence=0.95))
    out = capsys.readouterr().out
    assert "val tailsieve_math/reward/mean@1" in out
    assert "0.250 (step 0) -> 0.500 (step 2)" in out and "0.250 (step 0) -> 0.375 (step 2)" in out


def test_a_broken_time_is_refused_only_on_a_compared_step(tmp_path):
    """A NaN or non-positive time would print "n/a" or a speedup one record drives; outside the
    compared window (--skip-steps) it changes nothing and is kept out of the way."""
    good, broken = RunLog("verl", "a", "file"), RunLog("ts", "b", "file")
    for step in (1, 2, 3):
        good.add(step, GEN_TIME, 10.0)
        broken.add(step, GEN_TIME, -3.0 if step == 1 else 8.0)
    with pytest.raises(CompareError, match="b: step 1 logs timing_s/gen = -3.0"):
        compare_runs([good, broken])
    steps, summaries = compare_runs([good, broken], skip=1)
    assert steps == [2, 3] and summaries[1].gen_speedup == pytest.approx(10.0 / 8.0)
