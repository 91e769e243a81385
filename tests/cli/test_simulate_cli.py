from __future__ import annotations

import argparse
import json

import pytest

from tailsieve_verl.cli import plan as plan_cli
from tailsieve_verl.cli import simulate as simulate_cli
from tailsieve_verl.core.errors import TailSieveError
from tailsieve_verl.core.data.trace import Group, write_trace
from tailsieve_verl.core.data.workload import generate_trace


def _parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tailsieve")
    module.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


SMALL = ["--steps", "3", "--batch", "8", "--n", "2", "--replicas", "4", "--pool-size", "64"]


def test_simulate_json_and_plots(tmp_path, capsys):
    args = _parse(simulate_cli, ["simulate", *SMALL, "--workload", "strong", "--out", str(tmp_path), "--json"])
    assert simulate_cli.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["policies"]) == {"verl", "uniform", "tailsieve-fixed", "tailsieve", "clairvoyant-group",
                                       "clairvoyant-sample", "verl-tp"}  # verl-tp: the default shape prices widths
    assert set(report["speedup_vs_verl"]) == set(report["policies"]) and report["speedup_vs_verl"]["verl"] == 1.0
    assert all(isinstance(p["mean_makespan_s"], float) for p in report["policies"].values())
    assert report["speedup_vs_uniform"]["uniform"] == 1.0
    assert json.loads((tmp_path / "simulate.json").read_text()) == report
    for name in ("makespan_per_step.png", "controller_trajectories.png", "gantt_step.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_simulate_table_from_observed_prompts(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    write_trace([Group(f"q{i}", (100 + 40 * i, 80, 3000 if i % 7 == 0 else 90)) for i in range(40)], prompts)
    args = _parse(simulate_cli, ["simulate", *SMALL, "--prompts", str(prompts), "--policies",
                                 "verl,uniform,tailsieve,verl-redraw", "--out", str(tmp_path / "out"), "--no-plots"])
    assert simulate_cli.run(args) == 0
    out = capsys.readouterr().out
    assert "tailsieve" in out and "uniform" in out and "vs stock verl" in out
    assert "verl-redraw is stock verl with its own length draws" in out  # the noise floor is explained
    assert not list((tmp_path / "out").glob("*.png"))


@pytest.mark.parametrize("extra, match", [(["--replicas", "1"], "2 replicas"), (["--policies", "magic"], "unknown"),
                                          (["--perf-model", "nope"], "performance model")])
def test_simulate_bad_input_is_one_clear_error(tmp_path, extra, match):
    args = _parse(simulate_cli, ["simulate", *SMALL, "--out", str(tmp_path), *extra])
    with pytest.raises(TailSieveError, match=match):
        simulate_cli.run(args)


def test_plan_cli(tmp_path, capsys):
    trace = tmp_path / "uniform_run.jsonl"
    write_trace(generate_trace("strong", 64, 4, seed=1), trace)
    args = _parse(plan_cli, ["plan", "--trace", str(trace), "--replicas", "4", "--batch", "16", "--steps", "4",
                             "--seeds", "2", "--json"])
    assert plan_cli.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["band"][0] <= report["predicted_speedup"] <= report["band"][1]
    assert report["prompts"] == 64
    assert (report["fixed_q"] == 0) == (report["fixed_m"] == 0)
    plan_cli.run(_parse(plan_cli, ["plan", "--trace", str(trace), "--replicas", "4", "--batch", "16", "--steps", "4",
                                   "--seeds", "2"]))
    out = capsys.readouterr().out
    pinned = f"++tailsieve.mode=fixed ++tailsieve.q0={report['fixed_q']} ++tailsieve.tail_replicas={report['fixed_m']}"
    assert "best fixed split: " in out and (report["fixed_m"] == 0 or pinned in out)
    assert report["fixed_m"] == 0 or "out of sample" in out
    assert out.startswith("assumed: B=16 (--batch), n=4 (the trace's median samples per group), R=4 (--replicas), "
                          "response cap ")
    assert "engine: verl 0.9.1's rollout defaults for qwen3-1.7b on one H200 (--engine-defaults auto)" in out
    assert report["assumed"]["engine_defaults"] == "qwen3-1.7b"
    # 256 draws of the strong preset: a P90/P50 of 4.09, nearer real's 3.6 than strong's 6.0 in log space
    assert report["lengths"]["p90_p50"] == pytest.approx(4.09, abs=0.01) and report["lengths"]["closest_preset"] == "real"


def test_plan_takes_the_batch_from_one_logged_step_and_says_what_it_assumed(tmp_path, capsys):
    """A trace of one step (every group the same size) is planned at its own batch and n; a pool of several
    steps at min(64, groups/2), said in the first line, before the simulation."""
    step = tmp_path / "step.jsonl"
    write_trace(generate_trace("real", 24, 4, seed=1), step)
    argv = ["--replicas", "4", "--steps", "3", "--seeds", "1", "--engine-defaults", "none"]
    assert plan_cli.run(_parse(plan_cli, ["plan", "--trace", str(step), *argv])) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("assumed: B=24 (the trace's groups: it holds one step), n=4 (the trace's median")
    assert "engine: no limit binds (--engine-defaults none)" in first
    pool = tmp_path / "pool.jsonl"
    write_trace([Group(f"p{i}", (300 + i,) * (4 * (1 + i % 2))) for i in range(40)], pool)
    assert plan_cli.run(_parse(plan_cli, ["plan", "--trace", str(pool), *argv])) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("assumed: B=20 (assumed min(64, groups/2): the trace holds several steps; give --batch)")


PLAN_SPEC = ["plan", "--workload", "real", "--pool-size", "96", "--n", "4", "--replicas", "4", "--batch", "16",
             "--steps", "6", "--seeds", "2", "--spec-acceptance", "0.99", "--spec-draft-cost", "0"]


def test_plan_cli_chooses_the_engines_with_speculation(capsys):
    """--spec-acceptance: the plan names the best stock configuration, every TailSieve candidate against it, and
    the choice with its per-pool engines and overrides; here (acceptance 0.99, no draft cost) the fallback."""
    assert plan_cli.run(_parse(plan_cli, [*PLAN_SPEC, "--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    stock, choice = report["best_stock"], report["choice"]
    assert (stock["name"], stock["label"], stock["speedup_vs_best_stock"]) == ("verl-spec", "k=6", 1.0)
    assert set(report["speedup_vs_best_stock"]) == {"tailsieve", "tailsieve-spec", "tailsieve-dynsd"}
    assert [c["name"] for c in report["candidates"]] == list(report["speedup_vs_best_stock"])
    assert choice["fallback"] and choice["name"] == "verl-spec" and choice["engines"] == {"tail": "k=6", "bulk": "k=6"}
    stock_mtp = ("actor_rollout_ref.model.mtp.enable=true actor_rollout_ref.model.mtp.enable_rollout=true "
                 "actor_rollout_ref.model.mtp.num_speculative_tokens=6")
    assert report["overrides"] == choice["overrides"] == stock_mtp
    spec = report["candidates"][1]
    assert "++tailsieve.tail.num_speculative_tokens=6" in spec["overrides"] and "++tailsieve.bulk.spec_schedule=" in spec["overrides"]
    assert report["recommendation"].startswith("recommendation: fall back to stock verl (verl-spec k=6)")

    assert plan_cli.run(_parse(plan_cli, PLAN_SPEC)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("assumed: B=16 (--batch), n=4 (--n), R=4 (--replicas), response cap 16384 (the preset's)")
    assert out[1].startswith("response lengths: P90/P50 ") and out[2].startswith("presets (P90/P50, mean/P50, ")
    assert out[3].startswith("trace preset:real: 96 prompt groups")
    assert any(line.startswith("best stock configuration: verl-spec (k=6), ") for line in out)
    assert any(line.startswith("choice: fall back to the best stock configuration, verl-spec (k=6)") for line in out)
    assert out[-1].endswith(stock_mtp)


@pytest.mark.parametrize("extra, match", [(["--num-speculative-tokens", "3"], "needs --spec-acceptance"),
                                          (["--spec-draft-cost", "0.1"], "need --num-speculative-tokens")])
def test_plan_speculation_flags_without_acceptance_are_one_clear_error(tmp_path, extra, match):
    trace = tmp_path / "run.jsonl"
    write_trace(generate_trace("real", 64, 4, seed=1), trace)
    args = _parse(plan_cli, ["plan", "--trace", str(trace), "--replicas", "4", "--batch", "16", *extra])
    with pytest.raises(TailSieveError, match=match):
        plan_cli.run(args)
