"""A replica that fails anywhere in a step — mid-decode, at the cutoff's abort, after its last
request, in the weight update — stops the run with the one RolloutStepError naming it (or, mid-decode
in the standalone layout, is dropped and its groups re-dispatched), within the configured limits.

Each place gets its own fault, injected into a simulated replica (``SimServer.inject_fault``) on
verl's real rollout path."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from tailsieve_verl.integration.trainer import RolloutStepError

B, N, R = 8, 2, 4
FIXED_TAIL = ["+tailsieve.mode=fixed", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
              "+tailsieve.controller.inner_loop=false"]


def _bulk_replica(h):
    return h.trainer.llm_server_manager.get_replicas()[-1]  # rank R - 1: bulk pool (tail_replicas=1)


def _inject_after(replica, fault: str, delay_s: float) -> threading.Thread:
    def inject():
        time.sleep(delay_s)
        ray.get(replica.server_handle.inject_fault.remote(fault))

    thread = threading.Thread(target=inject)
    thread.start()
    return thread


def test_an_engine_dying_mid_decode_behind_a_live_actor_is_dropped_and_its_groups_rerun(harness_factory, tmp_path):
    """The liveness probe asks the engine, not the actor: a dead engine whose server actor still
    answers is recognised, dropped, and its groups run again on the survivors."""
    h = harness_factory(FIXED_TAIL + ["tailsieve.sim.time_scale=40", f"trainer.default_local_dir={tmp_path}"])
    h.step()
    victim = _bulk_replica(h)
    injector = _inject_after(victim, "engine_dead", 0.5)
    result = h.step()
    injector.join()
    m = result["metrics"]
    assert m["tailsieve/redispatched_groups"] > 0 and m["tailsieve/live_replicas"] == R - 1
    assert len(result["outcome"].consumed) == B
    assert ray.get(victim.server_handle.get_server_address.remote())  # the actor itself still answers


def test_a_replica_dying_at_the_cutoffs_abort_stops_the_run_naming_it(harness_factory, tmp_path):
    """The abort is the first call into the replica after it died: the run stops with the trainer's
    one error naming the replica, not a bare ActorDiedError out of the abort."""
    h = harness_factory(FIXED_TAIL + ["tailsieve.sim.time_scale=30", f"trainer.default_local_dir={tmp_path}"])
    victim = _bulk_replica(h)
    ray.get(victim.server_handle.inject_fault.remote("exit_on_abort"))
    with pytest.raises(RolloutStepError, match=f"rank {victim.replica_rank} at .* is down at the bulk cutoff's abort"):
        h.step()  # q = 2 with candidate_factor 2: four bulk groups are still running at the cutoff


def test_a_hung_engine_mid_step_is_named_after_the_stall_timeout(harness_factory, tmp_path):
    """An engine that stops generating (its health check still passes) is found by lack of progress."""
    h = harness_factory(["tailsieve.sim.time_scale=40", "+tailsieve.stall_timeout_s=3",
                         f"trainer.default_local_dir={tmp_path}"])
    victim = _bulk_replica(h)
    injector = _inject_after(victim, "engine_hung", 0.3)
    started = time.monotonic()
    with pytest.raises(RolloutStepError, match=f"rank {victim.replica_rank} at .* generated no token with "
                                               f"[0-9]+ requests in flight for tailsieve.stall_timeout_s=3"):
        h.step()
    injector.join()
    assert time.monotonic() - started < 30


def test_a_hung_engine_after_the_last_request_stops_verls_sleep_within_the_engine_call_limit(harness_factory,
                                                                                            tmp_path):
    h = harness_factory(["+tailsieve.engine_call_timeout_s=3", f"trainer.default_local_dir={tmp_path}"])
    h.step()
    victim = _bulk_replica(h)
    ray.get(victim.server_handle.inject_fault.remote("engine_hung"))
    started = time.monotonic()
    with pytest.raises(RolloutStepError, match="did not answer when verl put the replicas to sleep within "
                                               "tailsieve.engine_call_timeout_s=3"):
        h.trainer.on_sample_end()  # verl's hook after the rollout: it drains and sleeps every replica
    assert time.monotonic() - started < 20


def test_a_weight_update_that_never_returns_stops_within_the_engine_call_limit(harness_factory, tmp_path):
    h = harness_factory(["+tailsieve.engine_call_timeout_s=3", f"trainer.default_local_dir={tmp_path}"])
    h.step()
    never = threading.Event()
    h.trainer.actor_rollout_wg.update_weights = lambda **_: never.wait()  # a push into an engine that hangs
    started = time.monotonic()
    with pytest.raises(RolloutStepError, match="did not answer in the weight update within "
                                               "tailsieve.engine_call_timeout_s=3"):
        h.trainer.on_step_end()
    assert time.monotonic() - started < 20
    never.set()


def test_a_lost_router_mid_step_stops_the_run_naming_it(harness_factory, tmp_path):
    """A node that leaves the Ray cluster takes every actor Ray placed there, the pool router included
    (verl places it anywhere); the step stops with the one error naming it, not a bare Ray error."""
    h = harness_factory(FIXED_TAIL + ["tailsieve.sim.time_scale=40", f"trainer.default_local_dir={tmp_path}"])
    h.step()
    router = h.trainer.router
    killer = threading.Thread(target=lambda: (time.sleep(0.5), ray.kill(router)))
    killer.start()
    with pytest.raises(RolloutStepError, match=r"step 2: the pool router is gone \(\w+Error; its node may have left"):
        h.step()
    killer.join()
