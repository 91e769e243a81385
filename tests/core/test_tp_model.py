"""A replica's tensor-parallel width in the engine model (issue 58): the TP step against its closed form on a
``linear:`` model, the KV capacity of one weight copy over t GPUs, the GPU-conserving split layout, and width 1
giving today's floats exactly."""

from __future__ import annotations

import numpy as np
import pytest

from tailsieve_verl.core.data.trace import Group
from tailsieve_verl.core.engine.engine import (H200_MEMORY_BYTES, H200_MODELS, EngineConfig, EngineConfigError,
                                               h200_kv_blocks, replica_engines)
from tailsieve_verl.core.engine.perf import (HBM_BYTES_PER_S, LinearPerf, PerfModelError, TensorParallel,
                                             TensorParallelPerf, at_width, parse_perf_model, step_floor_s)
from tailsieve_verl.core.engine.replica import evaluate_samples, simulate_replica
from tailsieve_verl.core.routing.policies import least_inflight_assignment
from tailsieve_verl.core.simulation.step_split import best_split

A, C, FLOOR = 0.010, 0.001, 0.004
TP4 = TensorParallel(size=4, floor_s=FLOOR, layers=2, hidden=1000, allreduce_latency_s=1e-4, link_bytes_per_s=1e9)
HUGE_KV = 10 ** 9  # never binds; only takes the scheduler's path


def tp_linear_coefficients(tp: TensorParallel) -> tuple[float, float]:
    """The TP step of ``linear:a=A,c=C`` is again linear, a' + c'·active: the floor and 2·layers all-reduce
    latencies per step, the rest of A and all of C split t ways, the all-reduce bytes per request."""
    t = tp.size
    per_request_bytes = 2 * (t - 1) / t * tp.hidden * tp.bytes_per_element / tp.link_bytes_per_s
    return (tp.floor_s + (A - tp.floor_s) / t + 2 * tp.layers * tp.allreduce_latency_s,
            C / t + 2 * tp.layers * per_request_bytes)


def test_the_tp_step_of_a_linear_model_is_its_closed_form():
    a, c = tp_linear_coefficients(TP4)
    active = np.array([0.0, 1.0, 7.0, 300.0])
    np.testing.assert_allclose(TensorParallelPerf(LinearPerf(A, C), TP4).step_time(active, active * 10),
                               np.where(active > 0, a + c * active, 0.0), rtol=1e-12)


@pytest.mark.parametrize("limits", [{}, {"num_gpu_blocks": HUGE_KV}], ids=["closed form", "scheduler"])
def test_a_wide_replica_finishes_at_the_closed_form(limits):
    # everyone admitted at 0, one token a step: a'·max_len + c'·Σ len, on both evaluators
    lengths = [5, 40, 17, 3, 40]
    a, c = tp_linear_coefficients(TP4)
    run = simulate_replica(lengths, LinearPerf(A, C), [0] * 5, EngineConfig(tensor_parallel=TP4, **limits))
    assert run.completion_s == pytest.approx(a * max(lengths) + c * sum(lengths), rel=1e-12)
    one = simulate_replica(lengths, LinearPerf(A, C), [0] * 5, EngineConfig(**limits))
    assert one.completion_s == pytest.approx(A * max(lengths) + C * sum(lengths), rel=1e-12)


def test_width_one_is_todays_model_bit_for_bit():
    perf = parse_perf_model("table:h200-dense:qwen3-8b")
    assert at_width(perf, TensorParallel()) is perf
    active, context = np.array([1.0, 16, 64, 256]), np.array([4096.0, 16384, 900, 30000])
    np.testing.assert_array_equal(TensorParallelPerf(perf, TensorParallel()).step_time(active, context),
                                  perf.step_time(active, context))
    default = EngineConfig.verl_defaults("qwen3-8b", perf)
    assert EngineConfig.verl_defaults("qwen3-8b", perf, tensor_parallel_size=1) == default
    today = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, num_gpu_blocks=h200_kv_blocks("qwen3-8b"),
                         prefill_s_per_token=default.prefill_s_per_token)
    assert default == today
    shape = H200_MODELS["qwen3-8b"]  # the one-GPU cache as before widths: 0.5 of the memory less the weights
    assert today.num_gpu_blocks == int((0.5 * H200_MEMORY_BYTES - shape.params_b * 2e9) // (shape.kv_bytes_per_token * 16))
    assert today.step_model(perf) is perf


def test_a_wide_replica_holds_one_weight_copy_and_the_rest_as_kv():
    shape = H200_MODELS["qwen3-8b"]
    one = h200_kv_blocks("qwen3-8b", 0.5, 16)
    for t in (2, 4, 8):
        blocks = h200_kv_blocks("qwen3-8b", 0.5, 16, t)
        assert blocks == int((t * 0.5 * H200_MEMORY_BYTES - shape.params_b * 2e9) // (shape.kv_bytes_per_token * 16))
        assert blocks > t * one  # the weights are stored once, not t times
    with pytest.raises(EngineConfigError, match="divide qwen3-30b-a3b's 4 KV heads"):
        h200_kv_blocks("qwen3-30b-a3b", 0.5, 16, 8)


def test_the_floor_is_the_batch_one_step_less_the_weight_read():
    weights = 2e9 * 2
    assert step_floor_s(LinearPerf(A, C), weights) == pytest.approx(A + C - weights / HBM_BYTES_PER_S)
    assert step_floor_s(LinearPerf(1e-4, 0.0), weights) == 0.0  # a step faster than its weights: no floor
    engine = EngineConfig.verl_defaults("qwen3-8b", LinearPerf(A, C), tensor_parallel_size=2)
    shape = H200_MODELS["qwen3-8b"]
    floor = step_floor_s(LinearPerf(A, C), shape.params_b * 2e9)
    assert engine.tensor_parallel == TensorParallel(size=2, floor_s=floor, layers=shape.layers, hidden=shape.hidden)


def test_on_the_bundled_table_width_buys_latency_and_costs_throughput():
    perf = parse_perf_model("table:h200-dense:qwen3-8b")
    step = {t: EngineConfig.verl_defaults("qwen3-8b", perf, tensor_parallel_size=t).step_model(perf)
            for t in (1, 2, 4, 8)}
    for context in (4096.0, 16384.0):
        at_one = [float(step[t].step_time(1.0, context)) for t in (1, 2, 4, 8)]
        assert at_one == sorted(at_one, reverse=True)  # the lone tail request decodes faster the wider
        # 8 GPUs at 256 requests each: t replicas' worth of tokens a second falls with width
        tokens = [8 / t * 256 / float(step[t].step_time(256.0, context)) for t in (1, 2, 4, 8)]
        assert tokens == sorted(tokens, reverse=True)


def test_a_wide_tail_keeps_the_gpus_of_the_split():
    bulk = EngineConfig()
    tail = EngineConfig(tensor_parallel=TP4)
    assert replica_engines(tail, bulk, 1, 8) == [tail] + [bulk] * 4  # 4 GPUs of tail, 4 bulk replicas
    assert replica_engines(bulk, bulk, 3, 8) == [bulk] * 8
    with pytest.raises(EngineConfigError, match="width 4 within 8 replicas"):
        replica_engines(tail, bulk, 3, 8)


def test_the_split_search_times_a_wide_tail_on_its_own_layout():
    groups = [Group(f"p{i}", (4000 if i == 0 else 50 + i,) * 4, 100) for i in range(16)]
    perf, bulk = LinearPerf(A, C), EngineConfig()
    tail = EngineConfig(tensor_parallel=TP4)
    shared = least_inflight_assignment(64, 8, rng=np.random.default_rng(0))
    best, shared_s, samples, pick = best_split([groups], groups, [(1, 1, tail)], 8, perf, bulk, False,
                                               np.random.default_rng(1), shared)
    assert pick == (1, 1, tail) and best < shared_s
    assert samples.max() == 4  # the tail replica and the 4 bulk replicas the other 4 GPUs make
    assert best == evaluate_samples(groups, samples, 5, perf, replica_engines(tail, bulk, 1, 8)).makespan_s


@pytest.mark.parametrize("make, needle", [
    (lambda: TensorParallel(size=0), "size must be an integer >= 1"),
    (lambda: TensorParallel(size=2), "needs the model's layers and hidden size"),
    (lambda: TensorParallel(floor_s=-1.0), "floor_s must be >= 0"),
    (lambda: TensorParallel(link_bytes_per_s=0.0), "link_bytes_per_s must be > 0"),
    (lambda: EngineConfig(tensor_parallel=2), "tensor_parallel must be a TensorParallel"),
    (lambda: EngineConfig.verl_defaults("qwen3-8b", None, tensor_parallel_size=2), "prices its step from the one-GPU"),
])
def test_bad_widths_get_one_clear_line(make, needle):
    with pytest.raises((PerfModelError, EngineConfigError), match=needle):
        make()
