"""Offline study: gap bookkeeping is consistent with the policies and the oracle; CLI writes JSON
and a PNG; bad settings give one clear error."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from tailsieve_verl.cli import study as study_cli
from tailsieve_verl.core.routing.oracle import brute_force
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.routing.study import STUDY_POLICIES, StudyConfig, StudyError, _instance_source, run_study
from tailsieve_verl.core.data.trace import Group, Trace, write_trace
from tailsieve_verl.core.data.workload import generate_trace


def test_small_study_is_consistent():
    config = StudyConfig(instances=4, trajectories=24, group_size=2, replicas=3, workload="strong", time_limit_s=0.3)
    result = run_study(config)
    assert len(result.instances) == 4
    for r in result.instances:
        assert r.lower_bound_s <= r.optimum_s * (1 + 1e-9)
        for p in STUDY_POLICIES:
            assert r.gap(p) >= -1e-12
        # best-k's family contains fixed-10% (k = 10 %, m = 1) and the balanced boundary (k = 0).
        assert r.gap("best-k") <= r.gap("fixed-10%") + 1e-9
        assert r.gap("best-k") <= r.gap("uniform-oracle") + 1e-9
        assert 0 <= r.best_k <= 12 and 0 <= r.best_m <= 2
    summary = result.summary()
    assert set(summary["policies"]) == set(STUDY_POLICIES)
    assert 0 <= summary["policies"]["best-k"]["share_within_1pct"] <= 1
    assert json.loads(json.dumps(result.to_json()))["config"]["instances"] == 4


def test_optimum_is_proven_on_small_instances():
    config = StudyConfig(instances=3, trajectories=8, group_size=1, replicas=2, workload="real", time_limit_s=5.0)
    result = run_study(config)
    perf = parse_perf_model(config.perf_model)
    draw = _instance_source(config)
    for i, r in enumerate(result.instances):
        groups = draw(i, np.random.default_rng([config.seed, i]))
        _, optimum = brute_force(groups, 2, perf)
        assert r.optimal
        assert r.optimum_s == pytest.approx(optimum, rel=1e-9)


def test_study_is_reproducible():
    config = StudyConfig(instances=2, trajectories=20, group_size=4, replicas=2, time_limit_s=0.2)
    a, b = run_study(config), run_study(config)
    assert [r.makespan_s for r in a.instances] == [r.makespan_s for r in b.instances]


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    study_cli.register(parser.add_subparsers())
    return parser.parse_args(["study", "--out", str(tmp_path), *extra])


def test_cli_writes_json_and_cdf_png(tmp_path, capsys):
    args = _args(tmp_path, "-N", "3", "-T", "30", "--group-size", "3", "-R", "3", "--time-limit", "0.2")
    assert args.func(args) == 0
    report = json.loads((tmp_path / "study.json").read_text())
    assert len(report["instances"]) == 3 and report["config"]["group_size"] == 3
    assert (tmp_path / "study_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "best-k" in out and "random-uniform" in out and "paper best-k" in out
    assert "table:h200-dense (qwen3-1.7b rows)" in out


def test_cli_json_summary_and_trace_workload(tmp_path, capsys):
    trace_path = tmp_path / "obs.jsonl"
    write_trace(generate_trace("real", 40, 4, seed=1), trace_path)
    args = _args(tmp_path, "-N", "2", "-T", "20", "--group-size", "2", "-R", "2", "--workload", str(trace_path),
                 "--time-limit", "0.2", "--json", "--no-plots")
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["oracle"]["instances"] == 2
    assert (tmp_path / "study.json").exists() and not (tmp_path / "study_cdf.png").exists()


@pytest.mark.parametrize("config, needle", [
    (StudyConfig(instances=0), "--instances must be >= 1"),
    (StudyConfig(trajectories=10, group_size=3), "must be a multiple of --group-size"),
    (StudyConfig(trajectories=2, group_size=4), "need 1 <= --group-size <= --trajectories"),
    (StudyConfig(replicas=1), "--replicas >= 2"),
    (StudyConfig(time_limit_s=0), "--time-limit must be > 0"),
    (StudyConfig(workload="huge"), "neither a preset"),
])
def test_bad_study_settings(config, needle):
    with pytest.raises(StudyError, match=needle):
        run_study(config)


def test_trace_too_small_for_an_instance(tmp_path):
    path = tmp_path / "tiny.jsonl"
    write_trace(Trace((Group("a", (5, 6)), Group("b", (7,)))), path)
    with pytest.raises(StudyError, match="has 2 prompts; an instance needs 100"):
        run_study(StudyConfig(workload=str(path)))
