"""The engine flags (vLLM's words) of every command that evaluates replicas, and their one-line errors."""

from __future__ import annotations

import json

import pytest

from tailsieve_verl.cli import build_parser, main
from tailsieve_verl.cli.engine_args import engine_config_from_args
from tailsieve_verl.core.engine.engine import EngineConfig, SpeculativeConfig
from tailsieve_verl.core.engine.perf import LinearPerf

PERF = LinearPerf(0.01, 1e-5)
SMALL = ["--steps", "2", "--batch", "8", "--n", "4", "--replicas", "2", "--pool-size", "64", "--no-plots",
         "--policies", "verl,uniform,tailsieve-fixed"]


def engine(*flags: str) -> EngineConfig:
    return engine_config_from_args(build_parser().parse_args(["simulate", *flags]), PERF)


def test_no_flag_binds_nothing():
    assert engine() == EngineConfig()


def test_flags_in_vllms_words():
    cfg = engine("--max-num-seqs", "64", "--num-gpu-blocks", "900", "--block-size", "32",
                 "--max-num-batched-tokens", "2048", "--num-speculative-tokens", "3", "--spec-acceptance", "0.9,0.7",
                 "--spec-schedule", "1-16:3,17-64:1", "--spec-draft-cost", "0.04", "--spec-acceptance-half-life", "9e4")
    assert (cfg.max_num_seqs, cfg.num_gpu_blocks, cfg.block_size, cfg.max_num_batched_tokens) == (64, 900, 32, 2048)
    assert cfg.prefill_s_per_token == pytest.approx(1e-5)  # the budget brings prefill in, priced by the perf model
    assert cfg.speculative == SpeculativeConfig(3, (0.9, 0.7), ((1, 16, 3), (17, 64, 1)), 9e4, 0.04)


def test_verl_defaults_with_an_override():
    cfg = engine("--engine-defaults", "qwen3-8b", "--max-num-seqs", "128")
    assert cfg == EngineConfig.verl_defaults("qwen3-8b", PERF, max_num_seqs=128)
    assert engine("--spec-schedule", "1-8:2", "--spec-acceptance", "0.8").speculative.num_speculative_tokens == 2


def test_simulate_runs_under_an_engine_and_it_changes_the_makespans(tmp_path, capsys):
    plain = tmp_path / "plain"
    assert main(["simulate", *SMALL, "--out", str(plain), "--json"]) == 0
    assert main(["simulate", *SMALL, "--out", str(tmp_path / "tight"), "--json", "--max-num-seqs", "2",
                 "--num-gpu-blocks", "4000"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    before, after = (r["policies"]["verl"]["mean_makespan_s"] for r in out)
    assert after > 1.5 * before  # 2 running at a time out of 16 per replica


@pytest.mark.parametrize("command", [
    ["route", "--trace", "t.jsonl", "-R", "2"], ["plan", "--trace", "t.jsonl"], ["study"],
    ["bench", "--preset", "real", "-R", "2", "--url", "http://x"], ["closed-loop", "--url", "http://x", "--calibration", "c.json"]])
def test_every_replica_consumer_takes_the_same_engine_flags(command):
    args = build_parser().parse_args([*command, "--engine-defaults", "qwen3-8b", "--max-num-seqs", "128",
                                      "--num-gpu-blocks", "900"])
    assert engine_config_from_args(args, PERF) == EngineConfig.verl_defaults("qwen3-8b", PERF, max_num_seqs=128,
                                                                             num_gpu_blocks=900)


def test_route_runs_under_the_engine(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"prompt_id": f"p{i}", "lengths": [200 + 50 * i] * 4}) + "\n" for i in range(4)))
    base = ["route", "--trace", str(trace), "-R", "2", "--policy", "uniform", "--json"]
    assert main(base) == 0 and main([*base, "--num-gpu-blocks", "40", "--block-size", "16"]) == 0
    free, tight = (json.loads(line)["makespan_s"] for line in capsys.readouterr().out.splitlines())
    assert tight > 1.2 * free  # 640 KV tokens hold about one 500-token request of eight: preemption and queueing


@pytest.mark.parametrize("flags, needle", [
    (["--max-num-seqs", "0"], "expected an integer in 1.."),
    (["--spec-acceptance", "0.5,1.2", "--num-speculative-tokens", "2"], "every acceptance must be in [0, 1]"),
    (["--spec-schedule", "1-8"], "lacks its :K"),
    (["--spec-schedule", "one-8:2"], "expected B1-B2:K entries"),
    (["--num-speculative-tokens", "2"], "needs --spec-acceptance"),
    (["--spec-acceptance", "0.8"], "need --num-speculative-tokens"),
    (["--spec-schedule", "2-8:1", "--spec-acceptance", "0.8"], "must start at batch 1"),
    (["--num-speculative-tokens", "1", "--spec-schedule", "1-8:2", "--spec-acceptance", "0.8"], "must be in 0..1"),
    (["--num-gpu-blocks", "3"], "KV blocks but the replica has 3"),
])
def test_bad_engine_flags_are_one_line(tmp_path, capsys, flags, needle):
    try:
        status = main(["simulate", *SMALL, "--out", str(tmp_path), *flags])
    except SystemExit as e:  # argparse's own usage error
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


SPEC = ["--steps", "3", "--batch", "16", "--n", "4", "--replicas", "4", "--pool-size", "64", "--no-plots"]


def test_speculation_policies_report_the_best_stock_configuration(tmp_path, capsys):
    """The --spec-* flags describe the speculation policies' drafts without switching speculation on for
    stock verl; the JSON names the fastest stock configuration and every policy's speedup over it, and the
    recommendation names a stock speculation config with its verl overrides when that is the fastest."""
    assert main(["simulate", *SPEC, "--policies", "verl,verl-spec,verl-dynsd,tailsieve", "--spec-acceptance", "0.95",
                 "--spec-draft-cost", "0.01", "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine"]["speculative"] is None  # stock verl itself runs without speculation
    assert report["speculation"]["acceptance"] == [0.95] and report["speculation"]["draft_cost"] == 0.01
    means = {name: p["mean_makespan_s"] for name, p in report["policies"].items()}
    best = report["best_stock"]
    assert best in ("verl-spec", "verl-dynsd") and means[best] == min(means[n] for n in ("verl", "verl-spec", "verl-dynsd"))
    assert report["speedup_vs_best_stock"][best] == 1.0
    assert report["speedup_vs_best_stock"]["tailsieve"] == pytest.approx(means[best] / means["tailsieve"])
    assert report["policies"]["verl-spec"]["choice"].startswith("k=")
    rec = report["recommendation"]
    assert rec.startswith("recommendation: stock verl with MTP ")
    assert rec.endswith("; speculation's acceptance given by --spec-acceptance")
    assert "actor_rollout_ref.model.mtp.enable=true actor_rollout_ref.model.mtp.enable_rollout=true " \
           "actor_rollout_ref.model.mtp.num_speculative_tokens=" in rec
    if best == "verl-dynsd":
        assert "'+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens_per_batch_size=" \
               "[[1,64,3],[65,128,1],[129,256,0]]'" in rec


def test_speculation_policies_in_the_table(tmp_path, capsys):
    assert main(["simulate", *SPEC, "--policies", "verl,verl-spec,tailsieve-dynsd", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "verl-spec (k=" in out and "best stock configuration: verl-spec (k=" in out
    assert "vs best" in out  # the column (its header may wrap)


@pytest.mark.parametrize("flags, needle", [
    (["--spec-acceptance", "1.5"], "every acceptance must be in [0, 1]"),
    (["--spec-draft-cost", "-1"], "--spec-draft-cost"),
    (["--spec-acceptance", ""], "expected comma-separated acceptances"),
])
def test_bad_speculation_for_the_spec_policies_is_one_line(tmp_path, capsys, flags, needle):
    try:
        status = main(["simulate", *SPEC, "--policies", "verl,verl-spec", "--out", str(tmp_path), *flags])
    except SystemExit as e:
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_per_pool_speculation_flags_set_each_pools_engine(tmp_path, capsys):
    """--tail-*/--bulk-* give TailSieve's pools their own depth or schedule, with the --spec-* drafts; the
    JSON records both engines and tailsieve-spec runs them instead of its defaults."""
    assert main(["simulate", *SPEC, "--policies", "verl,tailsieve-fixed,tailsieve-spec", "--fixed-tail-replicas", "1",
                 "--spec-acceptance", "0.9", "--tail-num-speculative-tokens", "4", "--bulk-spec-schedule", "1-16:2,17-64:0",
                 "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine"]["speculative"] is None
    tail, bulk = report["tail_engine"]["speculative"], report["bulk_engine"]["speculative"]
    assert (tail["num_speculative_tokens"], tail["schedule"], tail["acceptance"]) == (4, [], [0.9])
    assert (bulk["num_speculative_tokens"], bulk["schedule"]) == (2, [[1, 16, 2], [17, 64, 0]])
    assert report["policies"]["tailsieve-spec"]["choice"] == "tail k=4 / bulk 1-16:2,17-64:0"
    # tailsieve-fixed and tailsieve-spec run the same engines on the same split: the same steps
    assert report["policies"]["tailsieve-fixed"]["makespan_s"] == report["policies"]["tailsieve-spec"]["makespan_s"]


def test_bulk_speculation_off_is_k_zero():
    args = build_parser().parse_args(["simulate", "--bulk-num-speculative-tokens", "0", "--tail-spec-schedule", "1-8:5"])
    from tailsieve_verl.cli.engine_args import pool_engines_from_args
    from tailsieve_verl.core.simulation.sim import DEFAULT_SPECULATION
    pools = pool_engines_from_args(args, EngineConfig(max_num_seqs=64), DEFAULT_SPECULATION)
    assert pools["bulk_engine"] == EngineConfig(max_num_seqs=64)
    assert pools["tail_engine"].speculative.num_speculative_tokens == 5
    assert pools["tail_engine"].speculative.schedule == ((1, 8, 5),) and pools["tail_engine"].max_num_seqs == 64


@pytest.mark.parametrize("flags, needle", [
    (["--tail-num-speculative-tokens", "65"], "--tail-num-speculative-tokens: expected an integer in 0..64"),
    (["--bulk-spec-schedule", "1-8"], "lacks its :K"),
    (["--bulk-spec-schedule", "2-8:1"], "--bulk-spec-schedule: the spec schedule must start at batch 1"),
    (["--tail-num-speculative-tokens", "2", "--tail-spec-schedule", "1-8:3"], "--tail-spec-schedule: spec schedule k=3"),
    (["--bulk-num-speculative-tokens", "0", "--bulk-spec-schedule", "1-8:2"], "--bulk-spec-schedule speculates nothing"),
    (["--tail-spec-schedule", "1-8:0"], "--tail-spec-schedule speculates nothing"),
    (["--policies", "verl,verl-spec", "--tail-num-speculative-tokens", "4"], "no policy here has pools"),
])
def test_bad_per_pool_speculation_flags_are_one_line(tmp_path, capsys, flags, needle):
    try:
        status = main(["simulate", *SPEC, "--policies", "verl,tailsieve-spec", "--out", str(tmp_path), *flags])
    except SystemExit as e:
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_record_replaces_aborts_without_a_tailsieve_policy_would_be_ignored_and_is_refused(tmp_path, capsys):
    try:
        status = main(["simulate", "--policies", "verl,clairvoyant-sample", "--record-replaces-aborts",
                       "--out", str(tmp_path), "--steps", "1"])
    except SystemExit as e:
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert "--record-replaces-aborts changes TailSieve's aborts" in err and "\n" not in err


def _calibration_with_speculation(tmp_path, accepted_per_pos=(95, 90, 85), temperature=1.0):
    """A `tailsieve calibrate` file whose server speculated at k = 3: 100 drafts per point."""
    rows = [{"batch": b, "context": 40.0, "k": 3.0, "tokens_per_step": 1 + sum(accepted_per_pos) / 100, "drafts": 100,
             "draft_tokens": 300, "accepted": sum(accepted_per_pos), "accepted_per_pos": list(accepted_per_pos),
             "step_ms": 30.0} for b in (1, 2)]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"plan": {"temperature": temperature},
                                "engine": {"speculative": {"temperature": temperature, "rows": rows}}}))
    return path


def test_spec_acceptance_reads_a_calibrations_measured_acceptance_and_its_k(tmp_path):
    from tailsieve_verl.cli.engine_args import acceptance_source, speculation_from_args
    path = _calibration_with_speculation(tmp_path, (80, 50, 20))
    measured = engine("--spec-acceptance", str(path)).speculative  # the measured k unless one is given
    assert measured.num_speculative_tokens == 3
    assert measured.acceptance == pytest.approx((0.8, 0.625, 0.4))  # conditional: 50 of the 80 that reached position 2
    assert engine("--spec-acceptance", str(path), "--num-speculative-tokens", "1").speculative.num_speculative_tokens == 1
    spec = speculation_from_args(build_parser().parse_args(["simulate", "--policies", "verl,verl-spec",
                                                            "--spec-acceptance", str(path)]))
    assert spec.acceptance == measured.acceptance and spec.num_speculative_tokens == 3
    assert acceptance_source(spec) == f"measured by tailsieve calibrate at T=1 ({path}, k=3)"
    given = speculation_from_args(build_parser().parse_args(["simulate", "--spec-acceptance", "0.7"]))
    assert acceptance_source(given) == "given by --spec-acceptance" and given.acceptance == (0.7,)
    assert acceptance_source(speculation_from_args(build_parser().parse_args(["simulate"]))) is None  # assumed


def test_no_speculation_is_recommended_on_the_assumed_acceptance(tmp_path, capsys):
    """Without a stated acceptance the speculation policies still run (the simulator's assumption), but
    the recommendation refuses them and says how to measure one; a measured one is recommended, named."""
    assert main(["simulate", *SPEC, "--policies", "verl,verl-spec", "--out", str(tmp_path / "a"), "--json"]) == 0
    assumed = json.loads(capsys.readouterr().out)
    assert assumed["policies"]["verl-spec"]["mean_makespan_s"] < assumed["policies"]["verl"]["mean_makespan_s"]
    rec = assumed["recommendation"]
    assert rec.startswith("recommendation: stay with stock verl") and "mtp" not in rec
    assert rec.endswith("speculation not recommended: its acceptance is assumed (0.85,0.8,0.75 per draft position, "
                        "public MTP figures not measured at your temperature; verl's MTP guide measured rollout "
                        "throughput -50 % with MTP); measure it with `tailsieve calibrate --temperature T` on a "
                        "speculating vLLM server and pass --spec-acceptance CAL.json")
    path = _calibration_with_speculation(tmp_path)
    assert main(["simulate", *SPEC, "--policies", "verl,verl-spec", "--spec-acceptance", str(path),
                 "--out", str(tmp_path / "m"), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["speculation"]["acceptance_source"] == f"measured by tailsieve calibrate at T=1 ({path}, k=3)"
    rec = measured["recommendation"]
    assert rec.startswith("recommendation: stock verl with MTP k=")
    assert rec.endswith(f"; speculation's acceptance measured by tailsieve calibrate at T=1 ({path}, k=3)")


@pytest.mark.parametrize("content, needle", [
    (None, "cannot read the calibration"),
    ({"engine": {"num_gpu_blocks": 10}}, "measured no speculation: run `tailsieve calibrate --temperature T`"),
    ({"engine": {"speculative": {"rows": [{"batch": 1, "drafts": 0}]}}}, "record no drafts"),
])
def test_a_calibration_without_measured_speculation_is_one_line(tmp_path, capsys, content, needle):
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(json.dumps(content))
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", *SPEC, "--policies", "verl,verl-spec", "--spec-acceptance", str(path), "--out", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert needle in err and str(path) in err
