"""The simulated server decodes with the core's continuous-batching formula and honours abort."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.engine.replica import simulate_replica
from tailsieve_verl.integration.simulated_server import LengthModel, SimServer

SECTION = {"perf_model": "linear:a=0.01,c=0.002", "sim": {"time_scale": 0.02, "mean_response_len": 24,
                                                          "prompt_sigma": 0.8, "sample_sigma": 0.3, "seed": 3}}


def make_server(max_num_seqs: int, time_scale: float = 0.02) -> SimServer:
    section = {**SECTION, "sim": {**SECTION["sim"], "time_scale": time_scale}}
    return SimServer(0, max_num_seqs, max_model_len=512, response_length=128, tailsieve_section=section,
                     vocab_ids=list(range(10, 60)), address="sim-0@node")


def test_length_model_is_deterministic_per_prompt_and_request():
    model = LengthModel(64, prompt_sigma=1.0, sample_sigma=0.5, seed=1)
    assert model.sample([1, 2, 3], "r1", 512) == model.sample([1, 2, 3], "r1", 512)
    means = [model.prompt_mean([i, i + 1]) for i in range(200)]
    assert np.std(np.log(means)) == pytest.approx(1.0, abs=0.15)  # the prompt effect
    assert all(1 <= model.sample([5], f"r{i}", 40) <= 40 for i in range(100))


@pytest.mark.parametrize("max_num_seqs", [64, 3])
def test_busy_time_equals_the_core_replica_model(max_num_seqs):
    server = make_server(max_num_seqs)
    prompts = [[7] * (4 + i) for i in range(8)]

    async def run():
        return await asyncio.gather(*[server.generate(p, {}, request_id=f"q{i}") for i, p in enumerate(prompts)])

    outputs = asyncio.run(run())
    lengths = [len(o.token_ids) for o in outputs]
    assert lengths == [server.lengths.sample(p, f"q{i}", 128) for i, p in enumerate(prompts)]
    assert all(o.stop_reason == "completed" for o in outputs)
    assert all(10 <= t < 60 for o in outputs for t in o.token_ids)  # real vocabulary ids
    expected = simulate_replica(lengths, parse_perf_model(SECTION["perf_model"]), [len(p) for p in prompts],
                                engine=EngineConfig(max_num_seqs=max_num_seqs))
    assert server.stats.busy_sim_s == pytest.approx(expected.completion_s, rel=1e-9)
    assert server.stats.steps == expected.steps


def test_abort_returns_partial_tokens_and_parks_new_requests_until_resume():
    server = make_server(16, time_scale=2.0)  # ~40 ms per decode step: the abort lands mid-generation

    async def run():
        running = [asyncio.create_task(server.generate([1, 2], {"max_tokens": 100}, request_id=f"a{i}"))
                   for i in range(4)]
        await asyncio.sleep(0.05)
        result = await server.abort_all_requests()
        aborted = await asyncio.gather(*running)
        parked = asyncio.create_task(server.generate([1, 2], {"max_tokens": 4}, request_id="late"))
        await asyncio.sleep(0.05)
        parked_before_resume = not parked.done()
        await server.resume_generation()
        late = await parked
        return result, aborted, parked_before_resume, late

    result, aborted, parked_before_resume, late = asyncio.run(run())
    assert result["aborted_count"] == 4
    assert all(o.stop_reason == "aborted" for o in aborted)
    assert parked_before_resume and late.stop_reason == "completed"
    assert server.stats.aborted == 4 and server.stats.aborted_tokens == sum(len(o.token_ids) for o in aborted)


def test_abort_groups_aborts_one_group_and_its_later_requests_while_the_engine_runs_on():
    server = make_server(16, time_scale=2.0)  # ~40 ms per decode step

    async def run():
        doomed = [asyncio.create_task(server.generate([1, 2], {"max_tokens": 100}, request_id=f"ts:ga:{i}"))
                  for i in range(2)]
        other = asyncio.create_task(server.generate([3, 4], {"max_tokens": 100}, request_id="ts:gb:0"))
        await asyncio.sleep(0.2)
        progress = server.progress()
        result = await server.abort_groups(["ga"])
        aborted = await asyncio.gather(*doomed)
        late = await server.generate([1, 2], {"max_tokens": 4}, request_id="ts:ga:next-turn")
        return progress, result, aborted, late, await other

    progress, result, aborted, late, other = asyncio.run(run())
    assert progress["in_flight"] == 3 and progress["tokens"] > 0  # counted mid-chunk
    assert result["aborted_count"] == 2 and sorted(result["request_ids"]) == ["ts:ga:0", "ts:ga:1"]
    assert all(o.stop_reason == "aborted" and 0 < len(o.token_ids) < 100 for o in aborted)  # partial tokens
    assert late.stop_reason == "aborted" and late.token_ids == []  # a later turn: aborted at once, never parked
    assert other.stop_reason == "completed" and not server.get_stats()["paused"]
    assert server.stats.aborted_tokens == sum(len(o.token_ids) for o in aborted)
