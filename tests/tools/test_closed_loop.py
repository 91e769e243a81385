"""`tailsieve closed-loop` plumbing against the fake endpoint (no timing claims: those come from vLLM)."""

import json
from dataclasses import asdict

import numpy as np
import pytest
from fake_openai_server import FakeOpenAIServer

from tailsieve_verl.cli import main
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import LinearPerf
from tailsieve_verl.core.engine.replica import evaluate_samples
from tailsieve_verl.core.simulation.sim import SimConfig, simulate, step_times
from tailsieve_verl.core.data.trace import Group
from tailsieve_verl.core.data.workload import PromptPool, get_preset
from tailsieve_verl.tools.bench import run_assignment
from tailsieve_verl.tools.closed_loop import ClosedLoopError, closed_loop, predict
from tailsieve_verl.tools.openai_client import OpenAIServer

PERF = LinearPerf(a=0.0002, c=0.0)  # the fake sleeps 0.2 ms per token: the model it follows
SPEC = get_preset("strong", median_len=20, max_response_length=200, prompt_len=4)


def _cal(path, engine=None):
    doc = {"device": "test", "rows": [
        {"model": "tiny", "batch": b, "context": c, "step_ms": 0.2} for b in (1, 8, 64) for c in (4, 512)]}
    if engine is not None:
        doc["engine"] = engine
    path.write_text(json.dumps(doc))
    return path


def test_the_simulator_runs_through_a_given_executor_with_identical_results():
    cfg = SimConfig(steps=6, n_replicas=4, batch_size=8, n=4, seed=2, policies=("verl", "tailsieve"))
    calls = []

    def execute(name, groups, samples):
        calls.append(name)
        return evaluate_samples(groups, samples, cfg.n_replicas, PERF)

    with_hook = simulate(cfg, PromptPool(SPEC, 24, seed=2), PERF, execute=execute)
    plain = simulate(cfg, PromptPool(SPEC, 24, seed=2), PERF)
    assert calls.count("verl") == calls.count("tailsieve") == cfg.steps
    for name in cfg.policies:
        assert np.array_equal(with_hook.policies[name].makespans, plain.policies[name].makespans)


def test_step_times_cut_the_fresh_bulk_groups_at_their_quota_and_wait_for_the_requeued_ones():
    groups = [Group("t", (50,)), Group("a", (10,)), Group("b", (30,)), Group("c", (90,))]
    ev = evaluate_samples(groups, np.array([0, 1, 1, 1]), 2, LinearPerf(a=1.0, c=0.0))
    tail_s, cut = step_times(ev, 1, 0, 2)
    assert tail_s == 50.0 and cut.cutoff_s == 30.0 and cut.consumed == (0, 1) and cut.aborted == (2,)  # "c" aborted
    groups = [Group("t", (50,)), Group("r", (90,)), Group("a", (10,)), Group("b", (30,))]  # "r" requeued
    ev = evaluate_samples(groups, np.array([0, 1, 1, 1]), 2, LinearPerf(a=1.0, c=0.0))
    tail_s, cut = step_times(ev, 1, 1, 1)
    assert cut.cutoff_s == 10.0 and cut.bulk_end_s == 90.0 and cut.consumed == (0, 1) and cut.aborted == (2,)


def test_a_measured_run_is_an_evaluation_with_every_sample():
    groups = [Group("a", (30, 5)), Group("b", (10, 20))]
    with FakeOpenAIServer(seconds_per_token=0.0005) as fake:
        run = run_assignment([OpenAIServer(fake.url)], groups, np.array([0, 1, 1, 0]), 2)
    ev = run.evaluation(groups, np.array([0, 1, 1, 0]))
    assert len(run.sample_finish_s) == 4 and all(t > 0 for t in run.sample_finish_s)
    assert ev.group_finish_s.tolist() == list(run.group_finish_s)
    assert ev.response_finish_s[0][0] > ev.response_finish_s[0][1]  # 30 tokens take longer than 5
    assert ev.makespan_s == run.makespan_s


def test_closed_loop_report_measures_every_step_next_to_its_prediction():
    cfg = SimConfig(steps=4, n_replicas=3, batch_size=6, n=2, seed=1, policies=("verl", "tailsieve"))
    seen = []
    with FakeOpenAIServer(seconds_per_token=0.0002) as fake:
        report = closed_loop(cfg, PromptPool(SPEC, 18, seed=1), [OpenAIServer(fake.url)], PERF, warmup=1,
                             on_step=lambda *args: seen.append(args[:2]))
        requests = len(fake.bodies)
    assert sorted(seen) == sorted((p, s) for p in cfg.policies for s in range(cfg.steps))
    assert len(report["steps"]) == 2 * cfg.steps
    assert requests >= 2 * cfg.steps * cfg.batch_size * cfg.n  # every sample ran (TailSieve also its aborted ones)
    for name in cfg.policies:
        assert report["policies"][name]["lost"] == report["policies"][name]["duplicated"] == 0
    ts = report["policies"]["tailsieve"]
    for key in ("measured_speedup", "predicted_speedup", "simulated_speedup", "share_of_predicted_gain"):
        assert key in ts and report[key] == ts[key]
    errors = [abs(r["prediction_error"]) for r in report["steps"]]
    assert report["median_prediction_error"] == pytest.approx(float(np.median(errors)))
    assert report["worst_prediction_error"] == max(errors)
    assert all(r["measured_makespan_s"] > 0 and r["predicted_makespan_s"] > 0 for r in report["steps"])


def test_a_recorded_run_is_scored_again_under_another_model():
    cfg = SimConfig(steps=3, n_replicas=2, batch_size=4, n=2, seed=3, policies=("verl", "tailsieve"))
    with FakeOpenAIServer(seconds_per_token=0.0002) as fake:
        report = closed_loop(cfg, PromptPool(SPEC, 12, seed=3), [OpenAIServer(fake.url)], PERF)
    first = [r["predicted_makespan_s"] for r in report["steps"]]
    again = predict(json.loads(json.dumps(report)), PERF)  # as read back from its JSON
    assert [r["predicted_makespan_s"] for r in again["steps"]] == first
    slower = predict(json.loads(json.dumps(report)), LinearPerf(a=0.0004, c=0.0))
    assert [r["predicted_makespan_s"] for r in slower["steps"]] == pytest.approx([2 * x for x in first])
    assert slower["perf_model"] != report["perf_model"] or slower["median_prediction_error"] != 0


def test_a_recorded_run_is_scored_again_under_the_servers_engine():
    cfg = SimConfig(steps=2, n_replicas=2, batch_size=4, n=2, seed=3, policies=("verl", "tailsieve"))
    with FakeOpenAIServer(seconds_per_token=0.0002) as fake:
        report = closed_loop(cfg, PromptPool(SPEC, 12, seed=3), [OpenAIServer(fake.url)], PERF)
    first = [r["predicted_makespan_s"] for r in report["steps"]]
    roomy = predict(json.loads(json.dumps(report)), PERF, EngineConfig(num_gpu_blocks=10 ** 6, block_size=16))
    assert [r["predicted_makespan_s"] for r in roomy["steps"]] == first
    serial = predict(json.loads(json.dumps(report)), PERF, EngineConfig(max_num_seqs=1))
    assert all(s > f for s, f in zip((r["predicted_makespan_s"] for r in serial["steps"]), first))
    assert serial["engine"]["max_num_seqs"] == 1


def test_closed_loop_refuses_clairvoyant_policies_and_a_missing_baseline():
    pool = PromptPool(SPEC, 18)
    with pytest.raises(ClosedLoopError, match="must include verl"):
        closed_loop(SimConfig(steps=2, n_replicas=2, batch_size=4, n=2, policies=("tailsieve",)), pool,
                    [OpenAIServer.__new__(OpenAIServer)], PERF)
    with pytest.raises(ClosedLoopError, match="come from"):
        closed_loop(SimConfig(steps=2, n_replicas=2, batch_size=4, n=2, policies=("verl", "clairvoyant-group")),
                    pool, [OpenAIServer.__new__(OpenAIServer)], PERF)


def test_cli_closed_loop_writes_the_report(tmp_path, capsys):
    out = tmp_path / "closed_loop.json"
    cal = _cal(tmp_path / "cal.json")
    with FakeOpenAIServer(seconds_per_token=0.0002, max_model_len=2048) as fake:
        code = main(["closed-loop", "--url", fake.url, "--calibration", str(cal), "--steps", "3", "--warmup", "1",
                     "-R", "2", "-B", "4", "--n", "2", "--pool-size", "12", "--median-len", "10", "--max-len", "60",
                     "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "share of gain" in printed and str(out) in printed
    report = json.loads(out.read_text())
    assert report["config"]["steps"] == 3 and report["calibration"] == str(cal)


def _closed_loop_engine(tmp_path, capsys, engine_section, *flags) -> tuple[dict, str]:
    """The engine a CLI closed loop predicted with (its report's "engine") for a calibration with this
    engine section (None: a file from before calibrate measured it), and what it said on stderr."""
    out = tmp_path / "closed_loop.json"
    cal = _cal(tmp_path / "cal.json", engine_section)
    with FakeOpenAIServer(seconds_per_token=0.0002, max_model_len=2048) as fake:
        code = main(["closed-loop", "--url", fake.url, "--calibration", str(cal), "--steps", "2", "--warmup", "1",
                     "-R", "2", "-B", "4", "--n", "2", "--pool-size", "8", "--median-len", "10", "--max-len", "40",
                     "--policies", "verl", "--out", str(out), "--json", *flags])
    assert code == 0
    return json.loads(out.read_text())["engine"], capsys.readouterr().err


MEASURED_ENGINE = {"num_gpu_blocks": 1024, "block_size": 128, "prefill_s_per_token": 0.000234}


def test_cli_closed_loop_predicts_with_the_engine_its_calibration_measured(tmp_path, capsys):
    engine, err = _closed_loop_engine(tmp_path, capsys, MEASURED_ENGINE)
    assert (engine["num_gpu_blocks"], engine["block_size"], engine["prefill_s_per_token"]) == (1023, 128, 0.000234)
    assert engine["max_num_seqs"] is None and err == ""


def test_cli_closed_loop_engine_flags_override_what_the_calibration_measured(tmp_path, capsys):
    engine, _ = _closed_loop_engine(tmp_path, capsys, MEASURED_ENGINE, "--max-num-seqs", "4", "--block-size", "16")
    assert (engine["max_num_seqs"], engine["block_size"]) == (4, 16)
    assert (engine["num_gpu_blocks"], engine["prefill_s_per_token"]) == (1023, 0.000234)


def test_cli_closed_loop_without_engine_facts_predicts_with_the_flags_alone_and_says_so(tmp_path, capsys):
    engine, err = _closed_loop_engine(tmp_path, capsys, None, "--num-gpu-blocks", "64")
    assert engine == asdict(EngineConfig(num_gpu_blocks=64))
    assert len(err.strip().splitlines()) == 1 and "no engine section" in err


def test_cli_closed_loop_refuses_a_missing_calibration_before_any_server(tmp_path, capsys):
    code = main(["closed-loop", "--url", "http://127.0.0.1:9", "--calibration", str(tmp_path / "none.json"),
                 "--out", str(tmp_path / "o.json")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.json" in err[0]


def test_the_recorded_kv_pressure_run_rescored_by_the_engine_model():
    """kv_pressure_rescore.py's ``old`` engine reproduces the run's own recorded predictions; the server's
    engine (8 blocks of 128 tokens) preempts on the run's steps and predicts its worst step slower."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("kv_rescore", root / "scripts/experiments/kv_pressure_rescore.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from tailsieve_verl.core.engine.perf import Calibration, TablePerf

    perf = TablePerf(Calibration.load(str(root / script.CALIBRATION)))
    recorded = json.loads((root / script.RUN).read_text())
    engines = script.engines(perf)
    old = predict(json.loads(json.dumps(recorded)), perf, engines["old"])
    assert [r["predicted_makespan_s"] for r in old["steps"]] == pytest.approx(
        [r["predicted_makespan_s"] for r in recorded["steps"]], rel=1e-9)
    new = predict(json.loads(json.dumps(recorded)), perf, engines["new"])
    assert script.engine_events(recorded, engines["new"], perf)["preemptions"] > 0
    worst = max(range(len(old["steps"])), key=lambda i: abs(old["steps"][i]["prediction_error"]))
    assert new["steps"][worst]["predicted_makespan_s"] > old["steps"][worst]["predicted_makespan_s"]
