"""The vLLM-v1 replica model, mechanism by mechanism, against cases worked out by hand.

``LinearPerf(1, 0)`` makes every step cost 1 s, so times read as step counts."""

from __future__ import annotations

import numpy as np
import pytest

from tailsieve_verl.core.engine.engine import EngineConfig, EngineConfigError, SpeculativeConfig
from tailsieve_verl.core.engine.perf import LinearPerf
from tailsieve_verl.core.engine.replica import evaluate_samples, simulate_replica, tokens_generated_at
from tailsieve_verl.core.data.trace import Group

ONE_SECOND_STEPS = LinearPerf(1.0, 0.0)
HUGE_KV = 10 ** 9  # a KV limit that never binds, only to take the scheduler's path


def run(lengths, prompts, engine, groups=None, perf=ONE_SECOND_STEPS):
    return simulate_replica(lengths, perf, prompts, engine=engine, groups=groups)


def test_concurrency_limit_queues_fifo():
    # cap 2: #0 and #1 start; #1 ends after step 1, so #2 starts at step 2; #0 ends after step 2, #3 starts at 3
    r = run([3, 2, 4, 1], [8] * 4, EngineConfig(max_num_seqs=2, num_gpu_blocks=HUGE_KV), groups=[0, 1, 2, 3])
    np.testing.assert_array_equal(r.admit_s, [0, 0, 2, 3])
    np.testing.assert_array_equal(r.finish_s, [3, 2, 6, 4])
    assert r.events.queue_wait_s == 5 and r.events.max_queue_wait_s == 3 and r.events.preemptions == 0


def test_kv_exhaustion_preempts_the_newest_and_recomputes_it():
    # block 4, 5 blocks. #0 (prompt 4) and #1 (prompt 5) admitted at step 0 (1 + 2 blocks). Step 1: #0
    # grows to 2 blocks; step 4: #1 to 3 (5 used). Step 5: #0 needs a 3rd block, none free: the newest
    # running request, #1 (5 tokens generated), is preempted although #0 asked. #0 ends after step 7;
    # #1 waits for its 3 blocks, is re-admitted at step 8, prefills its 5 + 5 tokens again and emits
    # token 6 there, then 7 and 8 in steps 9 and 10.
    engine = EngineConfig(num_gpu_blocks=5, block_size=4)
    r = run([8, 8], [4, 5], engine, groups=[0, 1])
    np.testing.assert_array_equal(r.finish_s, [8, 11])
    np.testing.assert_array_equal(r.admit_s, [0, 0])
    assert (r.events.preemptions, r.events.tokens_recomputed, r.steps) == (1, 10, 11)
    assert r.events.queue_wait_s == 3  # #1 waited from step 5 to step 8
    # #1's tokens stall while it waits: 5 at the preemption, still 5 just before re-admission
    np.testing.assert_array_equal(r.progress.tokens_at(7.5), [7, 5])
    np.testing.assert_array_equal(r.progress.tokens_at(9.0), [8, 6])
    # the same two requests with room for both never preempt and finish together
    free = run([8, 8], [4, 5], EngineConfig(num_gpu_blocks=6, block_size=4), groups=[0, 1])
    np.testing.assert_array_equal(free.finish_s, [8, 8])
    assert free.events.preemptions == 0


def test_the_requester_preempts_itself_when_it_is_the_newest():
    # prompts 4 and 4: both need a 3rd block at step 5 with one free: #0 takes it, #1 (newest) preempts itself
    r = run([8, 8], [4, 4], EngineConfig(num_gpu_blocks=5, block_size=4), groups=[0, 1])
    np.testing.assert_array_equal(r.finish_s, [8, 11])
    assert (r.events.preemptions, r.events.tokens_recomputed) == (1, 9)


def test_preempting_a_groups_last_holder_frees_its_prompt_blocks():
    # block 4, 15 blocks; three single-request groups, prompt 17 (4 shared prompt blocks + 1 private
    # each: 15 used). At 4 generated tokens all three need a 6th block, none free: #0 asks, the newest
    # (#2) is preempted and frees its private block and, as its group's last holder, its 4 prompt
    # blocks; #0 and #1 take theirs from those. One preemption, as vLLM's walk does it (the scheduler
    # once credited only the private blocks and preempted #1 as well).
    r = run([5, 5, 5], [17, 17, 17], EngineConfig(num_gpu_blocks=15, block_size=4), groups=[0, 1, 2],
            perf=LinearPerf(0.01, 0.0))
    assert r.events.preemptions == 1
    np.testing.assert_allclose(r.finish_s, [0.05, 0.05, 0.06])  # #2: re-admitted at step 5, prefills, emits its 5th


def test_chunked_prefill_within_the_token_budget():
    # budget 8, 0.5 s per prefilled token. Step 0: 8 of #0's 10 prompt tokens (no token emitted): 4 s.
    # Step 1: #0's last 2 tokens + #1's 3 (both emit their first token): 1 s + 2.5 s. Step 2: both
    # decode their second token and finish: 1 s.
    engine = EngineConfig(max_num_batched_tokens=8, prefill_s_per_token=0.5)
    r = run([2, 2], [10, 3], engine, groups=[0, 1])
    np.testing.assert_allclose(r.finish_s, [8.5, 8.5])
    np.testing.assert_allclose(r.admit_s, [0, 4])
    assert r.events.prefill_tokens == 13 and r.steps == 3


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_holds_it():
    # budget 8: #0's 6-token prompt fills step 0 with 2 left, too few for #1's 5 unchunked; #1 waits a step
    engine = EngineConfig(max_num_batched_tokens=8, enable_chunked_prefill=False)
    r = run([3, 1], [6, 5], engine, groups=[0, 1])
    np.testing.assert_array_equal(r.admit_s, [0, 1])
    np.testing.assert_array_equal(r.finish_s, [3, 2])


def test_a_groups_prompt_blocks_are_shared_on_one_replica():
    # prompt 33 at block 16: 2 full blocks shared, 1 private each; 4 blocks hold both siblings at once
    # (3 + 1) but not two strangers (3 + 3): the second then waits for the first to finish
    engine = EngineConfig(num_gpu_blocks=4, block_size=16)
    siblings = run([1, 1], [33, 33], engine, groups=[7, 7])
    strangers = run([1, 1], [33, 33], engine, groups=[7, 8])
    np.testing.assert_array_equal(siblings.finish_s, [1, 1])
    np.testing.assert_array_equal(strangers.finish_s, [1, 2])
    assert siblings.events.prefill_tokens == 33 + 1 and strangers.events.prefill_tokens == 66
    unshared = run([1, 1], [33, 33], EngineConfig(num_gpu_blocks=4, enable_prefix_caching=False), groups=[7, 7])
    np.testing.assert_array_equal(unshared.finish_s, [1, 2])
    # one group, two prompt lengths: its shared blocks have no one size (they once leaked until the walk hung)
    with pytest.raises(EngineConfigError, match="request 1 has a 40-token prompt and an earlier one of its group 33"):
        run([1, 1], [33, 40], engine, groups=[7, 7])


@pytest.mark.parametrize("acceptance, steps, accepted", [(1.0, 3, 6.0), (0.0, 9, 0.0)])
def test_speculation_tokens_per_step_at_full_and_zero_acceptance(acceptance, steps, accepted):
    # k = 3: the prefill step emits 1 token; each verify step emits 1 + 3 at acceptance 1, 1 at 0.
    # Verify step = T(4, 0) + T(1, c) − T(1, 0) + 3 × 0.1 × T(1, c) = 2 + 0.375 with T = 1 + 0.25·b.
    spec = SpeculativeConfig(3, (acceptance,), draft_cost=0.1)
    r = run([9], [4], EngineConfig(speculative=spec), perf=LinearPerf(1.0, 0.25))
    assert r.steps == steps
    assert r.completion_s == pytest.approx(1.25 + (steps - 1) * 2.375)
    assert r.events.spec_draft_tokens == 3 * (steps - 1)
    assert r.events.spec_accepted_tokens == pytest.approx(accepted)


def test_speculation_schedule_picks_k_by_running_batch():
    spec = SpeculativeConfig(3, (1.0,), schedule=((1, 1, 3), (2, 4, 1), (8, 16, 0)))
    assert [spec.k_for_batch(b) for b in (1, 2, 4, 5, 7, 8, 16, 300)] == [3, 1, 1, 1, 1, 0, 0, 0]
    engine = EngineConfig(speculative=spec)
    alone = run([5], [4], engine)  # batch 1, k = 3: tokens 1, then 5
    pair = run([5, 5], [4, 4], engine, groups=[0, 1])  # batch 2, k = 1: tokens 1, 3, 5
    assert (alone.steps, pair.steps) == (2, 3)
    assert (alone.events.spec_draft_tokens, pair.events.spec_draft_tokens) == (3, 4)


def test_acceptance_decays_with_context():
    spec = SpeculativeConfig(2, (0.8,), acceptance_half_life=1000.0)
    np.testing.assert_allclose(spec.tokens_per_step(2, [0.0, 1000.0]), [1 + 0.8 + 0.64, 1 + 0.4 + 0.16])
    shallow = SpeculativeConfig(3, (0.9, 0.5))  # the last value repeats for deeper positions
    np.testing.assert_allclose(shallow.tokens_per_step(3, 0.0), 1 + 0.9 + 0.45 + 0.225)
    # in a run, read at the mid-way context 4 + 12 / 2 = 10 = the half-life: 1.5 tokens per verify step,
    # so the 11 tokens after the prefill's take 8 steps (6 without decay)
    decayed = SpeculativeConfig(1, (1.0,), acceptance_half_life=10.0)
    assert run([12], [4], EngineConfig(speculative=decayed)).steps == 1 + 8
    assert run([12], [4], EngineConfig(speculative=SpeculativeConfig(1, (1.0,)))).steps == 1 + 6


def test_tokens_at_a_cutoff_count_only_steps_after_admission():
    # cap 1: #1 starts at step 3; at t = 4.5 it has 1 token. Interpolating between finish times as if
    # both had started at 0 would give it 3.
    groups = [Group("a", (3,), prompt_len=4), Group("b", (5,), prompt_len=4)]
    for engine in (EngineConfig(max_num_seqs=1), EngineConfig(max_num_seqs=1, num_gpu_blocks=HUGE_KV)):
        ev = evaluate_samples(groups, [0, 0], 1, ONE_SECOND_STEPS, engine=engine)
        np.testing.assert_array_equal(tokens_generated_at(groups, ev, 4.5), [3, 1])
        np.testing.assert_array_equal(ev.admit_s, [0, 3])
    # nobody queues: the finish-time interpolation of the closed form (both started at 0)
    ev = evaluate_samples(groups, [0, 0], 1, ONE_SECOND_STEPS)
    assert ev.progress == (None,)
    np.testing.assert_array_equal(tokens_generated_at(groups, ev, 2.5), [2, 2])


def test_events_reach_the_evaluation_per_replica():
    groups = [Group("a", (8,), prompt_len=4), Group("b", (8,), prompt_len=5), Group("c", (8,), prompt_len=5)]
    engines = [EngineConfig(num_gpu_blocks=5, block_size=4), EngineConfig()]
    ev = evaluate_samples(groups, [0, 0, 1], 2, ONE_SECOND_STEPS, engine=engines)
    assert [e.preemptions for e in ev.replica_events] == [1, 0]
    assert ev.replica_times_s == [11.0, 8.0]
    with pytest.raises(ValueError, match="3 engine configs for 2 replicas"):
        evaluate_samples(groups, [0, 0, 1], 2, ONE_SECOND_STEPS, engine=engines + engines[:1])


def test_verl_defaults_on_an_h200():
    cfg = EngineConfig.verl_defaults("qwen3-8b", LinearPerf(0.01, 1e-5))
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size) == (256, 8192, 16)
    assert cfg.enable_chunked_prefill and cfg.enable_prefix_caching and cfg.speculative is None
    assert 350_000 < cfg.num_gpu_blocks * cfg.block_size < 420_000  # ≈ 375k tokens of KV (ENGINE_NOTES)
    assert cfg.prefill_s_per_token == pytest.approx(1e-5)  # a linear model's cost per extra query token
    small = EngineConfig.verl_defaults("qwen3-1.7b")
    moe = EngineConfig.verl_defaults("qwen3-30b-a3b")
    assert small.num_gpu_blocks > cfg.num_gpu_blocks > moe.num_gpu_blocks > 0


@pytest.mark.parametrize("make, needle", [
    (lambda: EngineConfig(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (lambda: EngineConfig(num_gpu_blocks=2.5), "num_gpu_blocks must be an integer >= 1"),
    (lambda: EngineConfig(block_size=0), "block_size must be an integer >= 1, got 0"),
    (lambda: EngineConfig(max_num_batched_tokens=-8), "max_num_batched_tokens must be"),
    (lambda: EngineConfig(prefill_s_per_token=-1.0), "prefill_s_per_token must be >= 0"),
    (lambda: EngineConfig(enable_prefix_caching="yes"), "enable_prefix_caching must be true or false"),
    (lambda: EngineConfig(speculative=3), "speculative must be a SpeculativeConfig"),
    (lambda: EngineConfig(max_num_batched_tokens=3, speculative=SpeculativeConfig(3, (0.5,))),
     "cannot hold one request's 4 verify tokens"),
    (lambda: SpeculativeConfig(0, (0.5,)), "num_speculative_tokens must be an integer >= 1"),
    (lambda: SpeculativeConfig(2, (1.5,)), r"acceptance needs one or more values in \[0, 1\]"),
    (lambda: SpeculativeConfig(2, ()), "acceptance needs one or more values"),
    (lambda: SpeculativeConfig(2, (0.5,), schedule=((2, 8, 1),)), "must start at batch 1"),
    (lambda: SpeculativeConfig(2, (0.5,), schedule=((1, 8, 3),)), "k=3 for batch 1-8 must be in 0..2"),
    (lambda: SpeculativeConfig(2, (0.5,), schedule=((1, 8, 1), (4, 9, 0))), "non-overlapping"),
    (lambda: SpeculativeConfig(2, (0.5,), acceptance_half_life=0.0), "acceptance_half_life must be > 0"),
    (lambda: SpeculativeConfig(2, (0.5,), draft_cost=-0.1), "draft_cost must be >= 0"),
    (lambda: EngineConfig.verl_defaults("llama-7b"), "unknown model shape 'llama-7b'"),
    (lambda: EngineConfig.verl_defaults("qwen3-30b-a3b", gpu_memory_utilization=0.3), "weights do not fit"),
])
def test_bad_settings_get_one_clear_line(make, needle):
    with pytest.raises(EngineConfigError, match=needle) as err:
        make()
    assert "\n" not in str(err.value)


def test_requests_the_engine_can_never_hold_are_refused():
    with pytest.raises(EngineConfigError, match="needs 3 KV blocks but the replica has 2"):
        run([8], [4], EngineConfig(num_gpu_blocks=2, block_size=4))
    with pytest.raises(EngineConfigError, match="chunked prefill off, a prefill of up to 11 tokens"):
        run([2], [10], EngineConfig(max_num_batched_tokens=8, enable_chunked_prefill=False))


def test_a_replica_run_again_is_the_cached_run():
    # the same requests on the same engine and model (group ids as labels only) give the one cached run
    engine = EngineConfig(num_gpu_blocks=40, block_size=4)
    first = run([9, 3, 7, 7], [5, 5, 6, 6], engine, groups=[0, 0, 1, 1])
    assert run([9, 3, 7, 7], [5, 5, 6, 6], engine, groups=[8, 8, 2, 2]) is first
    assert run([9, 3, 7, 7], [5, 5, 6, 6], EngineConfig(num_gpu_blocks=41, block_size=4), groups=[0, 0, 1, 1]) is not first
    assert run([9, 3, 7, 7], [5, 5, 6, 6], engine, groups=[0, 1, 2, 2]) is not first
    assert run([9, 3, 7, 7], [5, 5, 6, 6], engine, groups=[0, 0, 1, 1], perf=LinearPerf(2.0, 0.0)) is not first
    with pytest.raises(ValueError):  # shared by every caller: read-only
        first.finish_s[0] = 0.0
