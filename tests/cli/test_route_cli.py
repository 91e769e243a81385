"""`tailsieve route`: JSON contract, readable table, and clear errors."""

from __future__ import annotations

import argparse
import json

import pytest

from tailsieve_verl.cli import route as route_cli
from tailsieve_verl.core.errors import TailSieveError
from tailsieve_verl.core.routing.policies import POLICIES
from tailsieve_verl.core.data.trace import write_trace
from tailsieve_verl.core.data.workload import generate_trace


@pytest.fixture()
def trace_path(tmp_path):
    path = tmp_path / "step.jsonl"
    write_trace(generate_trace("strong", 10, 4, seed=2), path)
    return path


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    route_cli.register(parser.add_subparsers())
    args = parser.parse_args(["route", *argv])
    return args.func(args)


@pytest.mark.parametrize("policy", POLICIES)
def test_json_contract(trace_path, capsys, policy):
    extra = ["--k", "2"] if policy.startswith("topk") else []
    assert _run("--trace", str(trace_path), "--replicas", "3", "--policy", policy, "--json", "--time-limit", "2",
                *extra) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["makespan_s"], float)
    assert len(out["assignment"]) == 10
    if out["group_atomic"]:
        assert all(0 <= r < 3 for r in out["assignment"])
    else:  # per group, the replica of each of its 4 samples
        assert all(len(rs) == 4 and all(0 <= r < 3 for r in rs) for rs in out["assignment"])
    assert len(out["replica_times_s"]) == 3 and out["makespan_s"] == max(out["replica_times_s"])
    assert out["policy"] == policy
    if policy == "exact":
        assert out["lower_bound_s"] <= out["makespan_s"]


def test_linear_model_and_cap(trace_path, capsys):
    assert _run("--trace", str(trace_path), "-R", "2", "--perf-model", "linear:a=0.01,c=0.0001", "--policy",
                "uniform", "--max-num-seqs", "2", "--json") == 0
    capped = json.loads(capsys.readouterr().out)["makespan_s"]
    assert _run("--trace", str(trace_path), "-R", "2", "--perf-model", "linear:a=0.01,c=0.0001", "--policy",
                "uniform", "--json") == 0
    assert capped > json.loads(capsys.readouterr().out)["makespan_s"]


def test_readable_table(trace_path, capsys):
    assert _run("--trace", str(trace_path), "-R", "3", "--policy", "topk-balanced", "--k", "1",
                "--tail-replicas", "1") == 0
    out = capsys.readouterr().out
    assert "makespan" in out and "tail" in out and "bulk" in out and "k=1" in out


@pytest.mark.parametrize("argv, needle", [
    (["-R", "3", "--policy", "topk", "--k", "11"], "--k must be between 0 and the number of groups (10)"),
    (["-R", "3", "--policy", "topk", "--k", "2", "--tail-replicas", "3"], "--tail-replicas must be between 1"),
    (["-R", "0"], "--replicas must be an integer >= 1"),
    (["-R", "2", "--perf-model", "table:nope"], "unknown calibration"),
    (["-R", "2", "--policy", "exact", "--time-limit", "0"], "--time-limit must be a finite number of seconds > 0"),
    (["-R", "2", "--policy", "best-k", "--time-limit", "nan"], "--time-limit must be a finite number of seconds > 0"),
])
def test_errors_are_tailsieve_errors(trace_path, argv, needle):
    with pytest.raises(TailSieveError) as err:
        _run("--trace", str(trace_path), *argv)
    assert needle in str(err.value)


def test_missing_trace(tmp_path):
    with pytest.raises(TailSieveError, match="no such file"):
        _run("--trace", str(tmp_path / "absent.jsonl"), "-R", "2")


def test_tailsieve_command_reports_one_error_line(trace_path, capsys):
    from tailsieve_verl.cli import main

    assert main(["route", "--trace", str(trace_path), "-R", "4", "--policy", "topk", "--k", "2",
                 "--tail-replicas", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tailsieve route: error: --tail-replicas must be between 1 and")
    assert main(["route", "--trace", str(trace_path), "-R", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "best-k"


def test_exact_and_best_k_say_over_which_assignments_they_hold(tmp_path, capsys):
    """Issue 59: on this step stock verl's per-sample routing is faster than the exact optimum, which holds
    over whole-group assignments only, so the output must say so and not call the bound one for all."""
    path = tmp_path / "real16.jsonl"
    write_trace(generate_trace("real", 16, 8, seed=3), path)
    common = ("--trace", str(path), "-R", "4", "--engine-defaults", "none", "--time-limit", "5")
    makespan = {}
    for policy in ("verl", "exact"):
        assert _run(*common, "--policy", policy, "--json") == 0
        makespan[policy] = json.loads(capsys.readouterr().out)["makespan_s"]
    assert makespan["verl"] < makespan["exact"]
    assert _run(*common, "--policy", "exact") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("optimal over whole-group assignments (search finished); routing single samples (--policy verl, "
            "clairvoyant-sample) can be faster") in out
    assert _run(*common, "--policy", "best-k") == 0
    assert "lower bound over whole-group assignments" in " ".join(capsys.readouterr().out.split())


def test_route_prices_a_step_on_the_engine_simulate_and_plan_assume():
    from tailsieve_verl.cli import build_parser
    from tailsieve_verl.cli.engine_args import PLANNING_ENGINE

    commands = build_parser()._subparsers._group_actions[0].choices
    defaults = {name: commands[name].get_default("engine_defaults") for name in ("simulate", "plan", "route")}
    assert set(defaults.values()) == {PLANNING_ENGINE}, defaults
