"""Stock verl at every single tensor-parallel width of the user's GPUs in `tailsieve simulate` and `tailsieve plan`:
the strongest is the baseline, `plan` switches stock verl to it (and prices TailSieve on it) where it wins, and an
impossible width is refused before any work."""

from __future__ import annotations

import argparse
import json

import pytest

from tailsieve_verl.cli import plan as plan_cli
from tailsieve_verl.cli import simulate as simulate_cli
from tailsieve_verl.core.data.workload import PromptPool, get_preset
from tailsieve_verl.core.engine.engine import EngineConfig, EngineConfigError, single_widths
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.simulation import sim

TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"
SHORT = ["--workload", "real", "--n", "16", "--max-response-length", "4096", "--steps", "3", "--seeds", "2",
         "--jobs", "1"]


def _run(module, argv: list[str], capsys) -> list[str]:
    parser = argparse.ArgumentParser(prog="tailsieve")
    module.register(parser.add_subparsers(dest="command"))
    assert module.run(parser.parse_args(argv)) == 0
    return capsys.readouterr().out.strip().splitlines()


def test_plan_switches_stock_verl_to_the_width_that_wins_and_prices_tailsieve_on_it(capsys):
    """The MoE on 8 GPUs (its 4 KV heads allow TP1, TP2, TP4): a one-GPU replica keeps little KV cache beside the
    weights, so a wider stock layout wins; the plan names it, gives the overrides that switch to it (max_num_seqs
    at 256 a GPU with it) and measures TailSieve on top of that same width."""
    argv = ["plan", *SHORT, "--pool-size", "64", "--batch", "32", "--perf-model", "table:h200-moe"]
    lines = _run(plan_cli, argv, capsys)
    report = json.loads(_run(plan_cli, [*argv, "--json"], capsys)[-1])
    widths = report["single_widths"]
    speedups = {int(t): x for t, x in widths["stock_speedup_by_width"].items()}
    assert sorted(speedups) == [1, 2, 4] and speedups[1] == 1.0
    best = max(speedups, key=speedups.get)
    assert best > 1 and widths["best_width"] == best and min(widths["best_per_seed"]) > 1
    switch = f"{TP_KEY}={best} actor_rollout_ref.rollout.max_num_seqs={256 * best}"
    assert lines[-1] == report["recommendation"]
    assert lines[-1].startswith(f"recommendation: stock verl at TP{best} is fastest for this workload, "
                                f"{speedups[best]:.3f}× stock verl") and lines[-1].endswith(f"command: {switch}")
    on_best = widths["tailsieve_at_best_vs_stock_there"]
    assert on_best is not None and len(widths["tailsieve_at_best_per_seed"]) == 2
    line = next(line for line in lines if line.startswith(f"TailSieve on TP{best}: {on_best:.3f}× stock verl at TP{best}"))
    at_width = report["predicted_speedup"] / speedups[best]  # TailSieve at the plan's width against the strongest
    assert line.endswith(f"TailSieve at TP1: {at_width:.3f}× stock verl at TP{best}")


def test_tp1_stays_the_baseline_where_it_wins(tmp_path, capsys):
    """The small dense model on short responses: every wider layout pays its all-reduces and floor for little, so
    stock verl at width 1 is the strongest; simulate and plan both say so, and neither recommends a switch."""
    plan_lines = _run(plan_cli, ["plan", *SHORT, "--pool-size", "256", "--batch", "128"], capsys)
    width_line = next(line for line in plan_lines if line.startswith("stock verl at each single width"))
    assert width_line.endswith("the strongest: TP1, as planned")
    assert TP_KEY not in plan_lines[-1]
    lines = _run(simulate_cli, ["simulate", "--workload", "real", "--n", "16", "--batch", "128",
                                "--max-response-length", "4096", "--steps", "3", "--oracle-time-limit", "0.05",
                                "--jobs", "1", "--out", str(tmp_path), "--no-plots"], capsys)
    report = json.loads((tmp_path / "simulate.json").read_text())
    assert "verl-tp" in report["policies"] and report["best_stock"] == "verl"
    assert any(line.startswith("stock verl at each single width of 8 GPUs (verl-tp): TP1 × 8 1.000×, TP2 × 4 ")
               and line.endswith("the strongest, TP1, is stock verl as run") for line in lines)
    assert TP_KEY not in lines[-1]


def test_simulate_recommends_the_strongest_width_with_its_overrides(tmp_path, capsys):
    lines = _run(simulate_cli, ["simulate", "--workload", "real", "--n", "16", "--batch", "32",
                                "--perf-model", "table:h200-dense:qwen3-8b", "--max-response-length", "4096",
                                "--steps", "3", "--policies", "verl,tailsieve,verl-tp", "--jobs", "1",
                                "--out", str(tmp_path), "--no-plots"], capsys)
    report = json.loads((tmp_path / "simulate.json").read_text())
    choice = report["policies"]["verl-tp"]["choice"]
    best = int(choice.removeprefix("tp="))
    assert best > 1 and report["best_stock"] == "verl-tp"
    assert any(line.startswith("stock verl at each single width of 8 GPUs (verl-tp): TP1 × 8 1.000×")
               and f"the strongest is TP{best}, the baseline (vs best stock)" in line for line in lines)
    assert lines[-1].startswith(f"recommendation: stock verl at TP{best} (verl-tp, the best single width in "
                                "hindsight) is fastest for this workload")
    assert lines[-1].endswith(f"{TP_KEY}={best} actor_rollout_ref.rollout.max_num_seqs={256 * best}")


def test_simulate_at_a_width_runs_every_policy_on_replicas_of_that_width(tmp_path, capsys):
    """--tensor-parallel-size T: --replicas counts replicas of T GPUs; stock verl is priced at every width of those
    GPUs, its own width as run (verl's max_num_seqs 256), the others at 256 a GPU."""
    _run(simulate_cli, ["simulate", "--workload", "real", "--n", "8", "--batch", "16", "--replicas", "2",
                        "--tensor-parallel-size", "4", "--perf-model", "table:h200-dense:qwen3-8b", "--steps", "3",
                        "--policies", "verl,tailsieve,verl-tp", "--jobs", "1", "--out", str(tmp_path),
                        "--no-plots"], capsys)
    config = json.loads((tmp_path / "simulate.json").read_text())
    assert config["engine"]["tensor_parallel"]["size"] == 4 and config["engine"]["max_num_seqs"] == 256
    assert {e["tensor_parallel"]["size"]: e["max_num_seqs"] for e in config["stock_widths"]} == {1: 256, 2: 512,
                                                                                                  8: 2048}


def test_single_widths_divide_the_gpus_and_the_kv_heads():
    perf = parse_perf_model("table:h200-moe")
    engine = EngineConfig.verl_defaults("qwen3-30b-a3b", perf)
    assert sorted(single_widths("qwen3-30b-a3b", perf, engine, 8)) == [1, 2, 4]  # 4 KV heads: no TP8
    assert sorted(single_widths("qwen3-30b-a3b", perf, engine, 6)) == [1, 2]
    wide = single_widths("qwen3-30b-a3b", perf, engine, 8)[4]
    assert wide.width == 4 and wide.max_num_seqs == 1024 and wide.num_gpu_blocks > 4 * engine.num_gpu_blocks
    with pytest.raises(EngineConfigError, match="do not hold replicas of width 4"):
        single_widths("qwen3-30b-a3b", perf, wide, 6)


def test_verl_tp_at_its_own_width_is_stock_verl():
    """The runs share their draws and tie-breaks: verl-tp's own-width run is stock verl's, step for step."""
    perf = parse_perf_model("table:h200-dense:qwen3-8b")
    engine = EngineConfig.verl_defaults("qwen3-8b", perf)
    others = tuple(e for t, e in single_widths("qwen3-8b", perf, engine, 4).items() if t != 1)
    cfg = sim.SimConfig(steps=3, n_replicas=4, batch_size=16, n=8, policies=("verl", "verl-tp"), engine=engine,
                        stock_widths=others)
    result = sim.simulate(cfg, PromptPool(get_preset("real", max_response_length=4096), 64, seed=0), perf)
    assert result.policies["verl-tp"].alternatives[1].makespans.tolist() == result.policies["verl"].makespans.tolist()
    with pytest.raises(sim.SimError, match="verl-tp prices stock verl at other single widths"):
        sim.SimConfig(policies=("verl", "verl-tp")).validate()
