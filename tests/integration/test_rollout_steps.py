"""TailSieve on verl 0.9.1's own V1 rollout path (agent-loop manager and workers, TransferQueue,
replay buffer, router plugin) with simulated replicas, for several steps."""

from __future__ import annotations

import threading
import time
from collections import Counter

import ray

B, N, R = 8, 2, 4


def _check_whole_batch(result: dict) -> Counter:
    """Exactly B groups, each with all its N trajectories, none of them aborted."""
    counts = Counter(result["prompt_ids"])
    assert len(result["batch"].keys) == B * N
    assert len(counts) == B and set(counts.values()) == {N}
    assert all(tag.get("response_len", 0) >= 1 for tag in result["batch"].tags)
    return counts


def test_uniform_mode_is_uniform_group_routing(harness_factory, tmp_path):
    h = harness_factory(["+tailsieve.enable=false", f"trainer.default_local_dir={tmp_path}"])
    seen: list[str] = []
    for _ in range(2):
        result = h.step()
        m = result["metrics"]
        assert (m["tailsieve/q"], m["tailsieve/m"], m["tailsieve/aborted_groups"]) == (0, 0, 0)
        assert m["tailsieve/pred_makespan_s"] == m["tailsieve/pred_uniform_makespan_s"]
        seen += list(_check_whole_batch(result))
    assert len(set(seen)) == len(seen)  # every prompt consumed exactly once
    stats = h.server_stats()
    # whole groups round-robin over the 4 replicas: 2 steps x 8 groups x 2 samples / 4 replicas each
    assert [s["completed"] for s in stats] == [2 * B * N // R] * R
    assert sum(s["aborted"] for s in stats) == 0


def test_carried_groups_are_regenerated_and_survive_checkpoint_resume(harness_factory, tmp_path):
    overrides = ["+tailsieve.mode=fixed", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
                 "+tailsieve.controller.inner_loop=false",  # hold q = 2 too, so every step carries 2
                 "tailsieve.sim.time_scale=30",  # slow enough that the cutoff lands before the tails finish
                 f"trainer.default_local_dir={tmp_path}"]
    h = harness_factory(overrides)
    consumed: list[str] = []
    carried_prev: tuple[str, ...] = ()
    wasted = 0.0
    for step in range(3):
        before = h.server_stats()[0]
        result = h.step()
        after = h.server_stats()[0]
        m, outcome = result["metrics"], result["outcome"]
        _check_whole_batch(result)
        consumed += sorted(set(result["prompt_ids"]))
        tail_ids = [c.prompt_id for c in outcome.consumed if c.route == "tail"]
        assert tuple(tail_ids) == carried_prev  # last step's aborted groups, all regenerated now
        assert m["tailsieve/carried_groups"] == len(carried_prev)
        assert m["tailsieve/m"] == (1 if carried_prev else 0)
        assert m["tailsieve/q"] == m["tailsieve/aborted_groups"] == len(outcome.carried_ids) == 2
        wasted += m["tailsieve/aborted_tokens"]
        assert not set(outcome.carried_ids) & set(outcome.consumed_ids)
        if carried_prev:  # replica 0 is the tail pool: it ran exactly the carried groups, never aborted
            assert after["completed"] - before["completed"] == len(carried_prev) * N
            assert after["aborted"] == before["aborted"]
        carried_prev = outcome.carried_ids
    assert len(consumed) == len(set(consumed)) == 3 * B  # no prompt consumed twice
    stats = h.server_stats()
    assert sum(s["aborted"] for s in stats) > 0  # the bulk cutoff really aborted requests
    assert wasted == sum(s["aborted_tokens"] for s in stats)  # every aborted token is accounted as waste

    carried_rows = dict(h.trainer.carried_rows)
    carried_prompts = {row["extra_info"][0]["prompt_id"] for row in carried_rows.values()}
    assert len(carried_prompts) == 2 and not carried_prompts & set(consumed)
    h.trainer._save_checkpoint()
    h.close()

    resumed = harness_factory(overrides)  # resume_mode=auto finds global_step_3
    assert resumed.trainer.global_steps == 3
    assert set(resumed.trainer.carried_rows) == set(carried_rows)
    result = resumed.step()
    _check_whole_batch(result)
    after = set(result["prompt_ids"])
    assert carried_prompts <= after  # regenerated after the resume, not lost
    assert not (after - carried_prompts) & set(consumed)  # and nothing consumed twice


def test_replica_failure_mid_step_redispatches_its_groups(harness_factory, tmp_path):
    h = harness_factory(["+tailsieve.mode=fixed", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
                         "+tailsieve.controller.inner_loop=false", "tailsieve.sim.time_scale=40", f"trainer.default_local_dir={tmp_path}"])
    h.step()  # fills the carried queue, so the next step has a tail pool
    victim = h.trainer.llm_server_manager.get_replicas()[-1]  # a bulk replica

    def kill_soon():
        time.sleep(0.5)
        ray.kill(victim.server_handle)

    killer = threading.Thread(target=kill_soon)
    killer.start()
    result = h.step()
    killer.join()
    m = result["metrics"]
    _check_whole_batch(result)
    assert m["tailsieve/redispatched_groups"] > 0
    assert m["tailsieve/live_replicas"] == R - 1
    outcome = result["outcome"]
    assert len(outcome.consumed) == B and len(outcome.carried_ids) == 2
    result = h.step()  # the next step runs on the survivors
    _check_whole_batch(result)
    assert result["metrics"]["tailsieve/live_replicas"] == R - 1
