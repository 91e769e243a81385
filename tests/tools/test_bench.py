"""`tailsieve bench` logic: assignment building, the partial-rollout selection rule, the split
search, and the run/report plumbing against a local fake endpoint (protocol only; the recorded
speedups come from real vLLM, see scripts/results/)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from fake_openai_server import FakeOpenAIServer

from tailsieve_verl.cli import bench as cli_bench
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import LinearPerf
from tailsieve_verl.core.engine.replica import evaluate_assignment, evaluate_samples, expand_to_samples
from tailsieve_verl.core.data.trace import Group, write_trace
from tailsieve_verl.tools.bench import (BenchError, bench, best_tailsieve_split, carried_at_cutoff, check_lengths,
                                        pooled_assignment, run_assignment, scale_groups)
from tailsieve_verl.tools.openai_client import OpenAIServer

PERF = LinearPerf(a=0.01, c=0.002)


def skewed_groups() -> list[Group]:
    """Eight short groups and one very long one: the case tail isolation exists for."""
    groups = [Group(f"p{i}", (20, 22, 18, 21)) for i in range(8)]
    groups.insert(3, Group("tail", (300, 280, 310, 290)))
    return groups


def test_carried_are_the_groups_still_running_at_the_cutoff():
    finish = [5.0, 9.0, 1.0, 7.0, 3.0]
    assert carried_at_cutoff(finish, 2) == [1, 3]
    assert carried_at_cutoff(finish, 0) == []


def test_pooled_assignment_keeps_pools_apart():
    groups = [Group(f"p{i}", (10, 20)) for i in range(7)]
    whole = pooled_assignment(groups, [1, 4, 5], n_replicas=4, tail_replicas=2, group_atomic=True)
    assert list(whole) == [2, 2, 0, 0, 3, 3, 2, 2, 1, 1, 0, 0, 3, 3]  # group round-robin per pool
    spread = pooled_assignment(groups, [1, 4, 5], n_replicas=4, tail_replicas=2)
    is_tail = np.repeat([i in (1, 4, 5) for i in range(7)], 2)
    assert set(spread[is_tail]) == {0, 1} and set(spread[~is_tail]) == {2, 3}
    assert sorted(np.bincount(spread[is_tail])) == [3, 3] and sorted(np.bincount(spread[~is_tail])[2:]) == [4, 4]
    with pytest.raises(BenchError, match="tail replicas"):
        pooled_assignment(groups[:3], [0], 2, 2)


def test_split_search_isolates_a_dominant_tail_and_beats_uniform():
    groups = skewed_groups()
    uniform_finish = evaluate_assignment(groups, np.arange(len(groups)) % 3, 3, PERF).group_finish_s
    q, m, predicted = best_tailsieve_split(groups, 3, PERF, uniform_finish)
    assert q >= 1 and m >= 1
    assert 3 in carried_at_cutoff(uniform_finish, q)  # the long group is carried
    uniform = evaluate_assignment(groups, np.arange(len(groups)) % 3, 3, PERF).makespan_s
    assert predicted < uniform


def test_split_search_keeps_uniform_when_nothing_is_a_tail():
    groups = [Group(f"p{i}", (50, 50)) for i in range(6)]
    finish = evaluate_assignment(groups, np.arange(6) % 2, 2, PERF).group_finish_s
    assert best_tailsieve_split(groups, 2, PERF, finish)[:2] == (0, 0)


def test_length_scaling_and_context_check():
    groups = scale_groups([Group("a", (100, 7), prompt_len=10)], 0.1, max_len=5)
    assert groups[0].lengths == (5, 1) and groups[0].prompt_len == 10
    check_lengths(groups, 15)
    with pytest.raises(BenchError, match="max-model-len"):
        check_lengths(groups, 14)
    with pytest.raises(BenchError, match="length-scale"):
        scale_groups(groups, 0, None)


def test_replicas_sharing_a_server_run_one_after_another_with_every_response():
    groups = [Group(f"p{i}", (3 + i, 2)) for i in range(5)]
    assignment = np.array([0, 1, 2, 0, 1])
    with FakeOpenAIServer(seconds_per_token=0.001) as fake:
        run = run_assignment([OpenAIServer(fake.url)], groups, expand_to_samples(groups, assignment), 3)
    assert len(run.replica_times_s) == 3 and all(t > 0 for t in run.replica_times_s)
    assert run.makespan_s == max(run.replica_times_s)
    sent = Counter(b["max_tokens"] for b in fake.bodies)
    assert sent == Counter(length for g in groups for length in g.lengths)
    # one prompt per group, shared by its samples; replicas run sequentially in replica order
    prompts = [tuple(b["prompt"]) for b in fake.bodies]
    order_of_groups = []
    for p in prompts:
        if p not in order_of_groups:
            order_of_groups.append(p)
    replica_of_prompt = {p: r for p, r in zip(order_of_groups, [0, 0, 1, 1, 2])}
    assert [replica_of_prompt[p] for p in prompts] == sorted(replica_of_prompt[p] for p in prompts)


def test_bench_report_has_every_policy_with_prediction_and_measurement():
    groups = skewed_groups()
    with FakeOpenAIServer(seconds_per_token=0.0002) as a, FakeOpenAIServer(seconds_per_token=0.0002) as b:
        servers = [OpenAIServer(a.url), OpenAIServer(b.url)]
        calls = []
        report = bench(groups, servers, 2, PERF, repeats=2, oracle_time_limit_s=2.0,
                       on_run=lambda done, total, name, s: calls.append((done, total, name)))
    names = [row["policy"] for row in report["policies"]]
    assert names == ["verl", "uniform", "tailsieve", "oracle"]
    assert calls[-1][0] == calls[-1][1] == 1 + 2 * 4
    assert [c[2] for c in calls[1:5]] == ["verl", "uniform", "tailsieve", "oracle"]
    assert [c[2] for c in calls[5:9]] == ["oracle", "tailsieve", "uniform", "verl"]  # interleaved ABCD, DCBA
    by = {row["policy"]: row for row in report["policies"]}
    assert by["verl"]["predicted_speedup"] == 1.0  # speedups are vs stock verl
    # stock verl spreads a group's samples over the replicas; uniform keeps each group on one
    spread = np.array(by["verl"]["assignment"]).reshape(len(groups), 4)
    assert all(len(set(row)) == 2 for row in spread)
    assert all(len(set(row)) == 1 for row in np.array(by["uniform"]["assignment"]).reshape(len(groups), 4))
    for row in report["policies"]:
        assert len(row["measured_runs_s"]) == 2 and row["measured_makespan_s"] > 0
        assert row["predicted_makespan_s"] == pytest.approx(
            evaluate_samples(groups, row["assignment"], 2, PERF).makespan_s)
    sel = report["tailsieve_selection"]
    assert sel["m"] in (0, 1) and report["replicas_per_server_run"] == "concurrent"
    assert report["oracle"]["policy"] == "exact"


@pytest.mark.parametrize("kwargs, match", [
    ({"n_replicas": 1}, "at least 2 replicas"),
    ({"policies": ("uniform", "tailsieve")}, "must include verl"),
    ({"repeats": 0}, "repeats"),
])
def test_bench_refuses_impossible_requests(kwargs, match):
    with FakeOpenAIServer() as fake:
        args = {"n_replicas": 2, "repeats": 1, **kwargs}
        with pytest.raises(BenchError, match=match):
            bench(skewed_groups(), [OpenAIServer(fake.url)], perf=PERF, **args)


def test_cli_bench_with_a_given_calibration_prints_json(tmp_path, capsys):
    trace = tmp_path / "step.jsonl"
    write_trace(skewed_groups(), trace)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"device": "test", "rows": [
        {"model": "tiny", "batch": b, "context": c, "step_ms": 10 + 2 * b + 0.001 * b * c}
        for b in (1, 8, 64) for c in (16, 512)]}))
    parser = argparse.ArgumentParser()
    cli_bench.register(parser.add_subparsers())
    out = tmp_path / "bench.json"
    with FakeOpenAIServer(seconds_per_token=0.0002) as fake:
        args = parser.parse_args(["bench", "--trace", str(trace), "-R", "2", "--url", fake.url,
                                  "--calibration", str(cal), "--repeats", "1", "--policies", "verl,tailsieve",
                                  "--q", "1", "--m", "1", "--out", str(out), "--json"])
        assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert report["tailsieve_selection"]["q"] == 1 and report["replicas_per_server_run"] == "sequential per server"
    assert [r["policy"] for r in report["policies"]] == ["verl", "tailsieve"]


def test_cli_bench_needs_q_and_m_together(tmp_path):
    parser = argparse.ArgumentParser()
    cli_bench.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--preset", "strong", "-R", "2", "--url", "http://127.0.0.1:9", "--q", "2"])
    with pytest.raises(Exception, match="--q and --m together"):
        args.func(args)


def test_cli_bench_prints_a_table_measured_next_to_predicted(tmp_path, capsys):
    trace = tmp_path / "step.jsonl"
    write_trace(skewed_groups(), trace)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"device": "test", "rows": [
        {"model": "tiny", "batch": b, "context": 16, "step_ms": 10 + 2 * b} for b in (1, 8, 64)]}))
    parser = argparse.ArgumentParser()
    cli_bench.register(parser.add_subparsers())
    with FakeOpenAIServer(seconds_per_token=0.0002) as fake:
        args = parser.parse_args(["bench", "--trace", str(trace), "-R", "3", "--url", fake.url, "--calibration",
                                  str(cal), "--repeats", "1", "--policies", "verl,oracle",
                                  "--out", str(tmp_path / "b.json")])
        assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["policy", "predicted", "s"]
    assert [line.split()[0] for line in lines[2:4]] == ["verl", "oracle"]
    assert lines[-1] == f"wrote {tmp_path / 'b.json'}"


def test_cli_bench_measures_a_calibration_on_the_server_when_none_is_given(tmp_path, capsys):
    trace = tmp_path / "step.jsonl"
    write_trace([Group("a", (5,)), Group("b", (9,))], trace)
    parser = argparse.ArgumentParser()
    cli_bench.register(parser.add_subparsers())
    with FakeOpenAIServer(seconds_per_token=0.005) as fake:
        args = parser.parse_args(["bench", "--trace", str(trace), "-R", "2", "--url", fake.url, "--repeats", "1",
                                  "--policies", "verl", "--calibration-prompt-lens", "4",
                                  "--out", str(tmp_path / "b.json"), "--json"])
        assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    written = tmp_path / "b.calibration.json"
    assert report["calibration"] == str(written)
    assert [row["batch"] for row in json.loads(written.read_text())["rows"]] == [1, 2]


MEASURED_ENGINE = {"num_gpu_blocks": 1024, "block_size": 128, "prefill_s_per_token": 0.000234}


def _bench_engine(tmp_path, capsys, engine_section, *flags) -> tuple[dict, str]:
    """The engine a CLI bench predicted with (its report's "engine") for a calibration with this engine
    section (None: a file from before calibrate measured it), and what it said on stderr."""
    trace = tmp_path / "step.jsonl"
    write_trace(skewed_groups(), trace)
    doc = {"device": "test", "rows": [{"model": "tiny", "batch": b, "context": c, "step_ms": 10 + 2 * b}
                                      for b in (1, 8, 64) for c in (16, 512)]}
    if engine_section is not None:
        doc["engine"] = engine_section
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(doc))
    parser = argparse.ArgumentParser()
    cli_bench.register(parser.add_subparsers())
    out = tmp_path / "bench.json"
    with FakeOpenAIServer(seconds_per_token=0.0002) as fake:
        args = parser.parse_args(["bench", "--trace", str(trace), "-R", "2", "--url", fake.url, "--calibration",
                                  str(cal), "--repeats", "1", "--policies", "verl", "--out", str(out), "--json",
                                  *flags])
        assert args.func(args) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert report == json.loads(captured.out)
    return report["engine"], captured.err


def test_cli_bench_predicts_with_the_engine_its_calibration_measured(tmp_path, capsys):
    engine, err = _bench_engine(tmp_path, capsys, MEASURED_ENGINE)
    assert (engine["num_gpu_blocks"], engine["block_size"], engine["prefill_s_per_token"]) == (1023, 128, 0.000234)
    assert engine["max_num_seqs"] is None and engine["speculative"] is None and err == ""


def test_cli_bench_engine_flags_override_what_the_calibration_measured(tmp_path, capsys):
    engine, _ = _bench_engine(tmp_path, capsys, MEASURED_ENGINE, "--max-num-seqs", "8", "--num-gpu-blocks", "40")
    assert (engine["max_num_seqs"], engine["num_gpu_blocks"]) == (8, 40)
    assert (engine["block_size"], engine["prefill_s_per_token"]) == (128, 0.000234)  # not given: still measured


def test_cli_bench_without_engine_facts_predicts_with_the_flags_alone_and_says_so(tmp_path, capsys):
    engine, err = _bench_engine(tmp_path, capsys, None, "--max-num-seqs", "8")
    assert engine == asdict(EngineConfig(max_num_seqs=8))
    assert len(err.strip().splitlines()) == 1 and "no engine section" in err and "engine flags alone" in err


def test_cli_bench_adds_no_speculation_onto_a_speculating_servers_table(tmp_path, capsys):
    """A speculating server's calibration rows are time per generated token: speculation is in the table."""
    rows = [{"batch": 1, "context": 40.0, "k": 3.0, "tokens_per_step": 2.5, "drafts": 100, "draft_tokens": 300,
             "accepted": 150, "accepted_per_pos": [80, 50, 20], "step_ms": 30.0}]
    engine, err = _bench_engine(tmp_path, capsys, {**MEASURED_ENGINE, "speculative": {"rows": rows}})
    assert engine["speculative"] is None and engine["num_gpu_blocks"] == 1023
    assert "speculated (k = 3)" in err and "no speculation on top" in err


def test_cli_bench_predicts_with_the_engine_of_the_calibration_it_measured(tmp_path, capsys):
    metrics = (Path(__file__).parent / "vllm_cpu_metrics_dynamic_sd.txt").read_text()  # 512 blocks of 128
    trace = tmp_path / "step.jsonl"
    write_trace([Group("a", (5,)), Group("b", (9,))], trace)
    parser = argparse.ArgumentParser()
    cli_bench.register(parser.add_subparsers())
    with FakeOpenAIServer(seconds_per_token=0.005, metrics_text=metrics) as fake:
        args = parser.parse_args(["bench", "--trace", str(trace), "-R", "2", "--url", fake.url, "--repeats", "1",
                                  "--policies", "verl", "--calibration-prompt-lens", "4",
                                  "--out", str(tmp_path / "b.json"), "--json"])
        assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["engine"]["num_gpu_blocks"], report["engine"]["block_size"]) == (511, 128)
    assert report["engine"]["prefill_s_per_token"] == json.loads(
        (tmp_path / "b.calibration.json").read_text())["engine"]["prefill_s_per_token"]
