"""TailSieve on verl 0.9.1's own V1 rollout path (agent-loop manager and workers, TransferQueue,
replay buffer, router plugin) with simulated replicas, for several steps."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import ray

B, N, R = 8, 2, 4


def _check_whole_batch(result: dict) -> Counter:
    """Exactly B groups, each with all its N trajectories, none of them aborted."""
    counts = Counter(result["prompt_ids"])
    assert len(result["batch"].keys) == B * N
    assert len(counts) == B and set(counts.values()) == {N}
    assert all(tag.get("response_len", 0) >= 1 for tag in result["batch"].tags)
    return counts


def _kill(replica) -> None:
    """Kill a replica's server actor and wait until Ray reports it dead: ``ray.kill`` returns before
    the actor is gone, and a call that reaches it in between still succeeds."""
    ray.kill(replica.server_handle)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(replica.server_handle.get_server_address.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue  # busy or dying: ask again
        time.sleep(0.05)
    raise AssertionError(f"replica {replica.replica_rank} still answers 60 s after ray.kill")


def _kill_when_busy(replica, deadline_s: float = 30.0) -> threading.Thread:
    """Kill ``replica`` as soon as it is generating, so the kill lands mid-step whatever the load."""
    def run():
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if ray.get(replica.server_handle.get_stats.remote())["active"] > 0:
                _kill(replica)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _heaviest_candidates(trainer, q: int) -> tuple[str, ...]:
    """The q carried candidates the tail pool must take: highest abort score, or the per-prompt
    record's larger lower bound for a candidate that was aborted on an earlier step as well."""
    selector, record = trainer.cycle.selector, trainer.cycle.record
    weight = {p: max(selector.scores[p], record.predict(trainer.prompt_keys[p]) or 0.0) for p in selector.carried}
    return tuple(sorted(selector.carried, key=lambda p: -weight[p])[:q])


@pytest.mark.parametrize("group_atomic", [False, True])
def test_uniform_mode_routes_like_stock_verl_or_whole_groups(harness_factory, tmp_path, group_atomic):
    h = harness_factory(["+tailsieve.enable=false", f"+tailsieve.group_atomic={group_atomic}",
                         f"trainer.default_local_dir={tmp_path}"])
    seen: list[str] = []
    for _ in range(2):
        result = h.step()
        m = result["metrics"]
        assert (m["tailsieve/q"], m["tailsieve/m"], m["tailsieve/aborted_groups"]) == (0, 0, 0)
        expected = m["tailsieve/pred_uniform_makespan_s"] if group_atomic else m["tailsieve/pred_verl_makespan_s"]
        assert m["tailsieve/pred_makespan_s"] == expected
        seen += list(_check_whole_batch(result))
    assert len(set(seen)) == len(seen)  # every prompt consumed exactly once
    stats = h.server_stats()
    completed = [s["completed"] for s in stats]
    assert sum(completed) == 2 * B * N and sum(s["aborted"] for s in stats) == 0
    if group_atomic:  # whole groups by least in flight over the 4 replicas: 2 steps x 8 groups x 2 samples / 4
        assert completed == [2 * B * N // R] * R
    else:  # every sample by least in flight: every replica serves the step
        assert min(completed) > 0


def test_per_pool_engines_leave_the_tail_replica_idle_in_a_step_with_nothing_carried(harness_factory, tmp_path):
    """Per-pool engines are set at launch: replica 0 runs the tail engine. The first step carries nothing
    (m = 0), and its bulk groups stay off that replica rather than queue behind the tail engine's limit; the
    next step's carried groups run there."""
    h = harness_factory(["+tailsieve.mode=fixed", "+tailsieve.tail_replicas=1", "+tailsieve.q0=2",
                         "+tailsieve.tail.max_num_seqs=2", f"trainer.default_local_dir={tmp_path}"])
    assert h.trainer.engines_per_pool
    tail_rank = [r.replica_rank for r in h.trainer.llm_server_manager.get_replicas()].index(0)
    first = h.step()
    assert first["metrics"]["tailsieve/m"] == 0 and first["metrics"]["tailsieve/aborted_groups"] > 0
    stats = h.server_stats()
    assert stats[tail_rank]["completed"] == stats[tail_rank]["aborted"] == 0
    assert all(s["completed"] > 0 for i, s in enumerate(stats) if i != tail_rank)
    second = h.step()
    assert second["metrics"]["tailsieve/m"] == 1 and second["metrics"]["tailsieve/carried_groups"] > 0
    assert h.server_stats()[tail_rank]["completed"] > 0


def test_adaptive_mode_starts_at_one_shared_pool(harness_factory, tmp_path):
    """``+tailsieve.tail_replicas=0`` (what `tailsieve simulate`/`plan` recommend when the controller starts
    shared) launches in adaptive mode: the first step runs (q, m) = (0, 0), one pool of all R replicas,
    consumes exactly B whole groups and carries nothing."""
    h = harness_factory(["+tailsieve.tail_replicas=0", f"trainer.default_local_dir={tmp_path}"])
    assert h.trainer.settings.active and h.trainer.settings.mode == "adaptive"
    result = h.step()
    m, outcome = result["metrics"], result["outcome"]
    assert (m["tailsieve/q"], m["tailsieve/m"], m["tailsieve/aborted_groups"]) == (0, 0, 0)
    assert m["tailsieve/carried_groups"] == m["tailsieve/requeued_groups"] == 0
    assert len(set(_check_whole_batch(result))) == B
    assert not outcome.carried_ids and not h.trainer.carried_rows
    stats = h.server_stats()
    assert sum(s["completed"] for s in stats) == B * N and sum(s["aborted"] for s in stats) == 0
    assert min(s["completed"] for s in stats) > 0  # every replica served the step: one shared pool
    h.step()  # two measured steps of one shared pool: the controller plans its probe from their groups
    planned, decision = h.trainer.cycle.controller.state.planned, h.trainer.cycle.decision
    assert planned is not None and 0 <= planned.m <= R // 2 and planned.relative > 0
    assert decision.m in (0, planned.m) and (decision.m == 0) == (decision.q == 0)


def test_later_epochs_are_planned_from_the_record_and_a_resume_keeps_it(harness_factory, assets, tmp_path, caplog):
    """16 prompts, two steps an epoch, the controller held at one shared pool: from the second epoch on the
    per-prompt record knows every prompt and each step is planned from it (core.tailsieve.cycle: record-planned
    steps) — its q heaviest predicted groups on a tail pool, nothing aborted, every prompt once an epoch — until
    the guard finds the controller's split better (said in one line). A resume mid-epoch restores the record and
    the planning state; a resume under another batch size (keep_carried) keeps the record and starts the planning
    guard afresh."""
    import logging

    from tailsieve_verl.core.tailsieve.cycle import TailSieveCycle

    caplog.set_level(logging.INFO, logger="tailsieve_verl.integration.trainer")
    overrides = [f"data.train_files={assets.epoch_data}", "+tailsieve.tail_replicas=0", "+tailsieve.controller.record_plan=true",
                 # the controller stays at one shared pool (no probe); any predicted gain is planned, and the
                 # plans' predictions, not one step's noise, decide the way back
                 "+tailsieve.controller.plan_probe=false", "+tailsieve.controller.switch_threshold=1.0",
                 "+tailsieve.controller.plan_margin=0", "+tailsieve.controller.plan_weight=1000",
                 f"trainer.default_local_dir={tmp_path}"]
    h = harness_factory(overrides)
    assert h.trainer.cycle.step_planner is not None and h.trainer.cycle.group_size == N
    results = [h.step() for _ in range(3)]
    for step, r in enumerate(results, 1):
        m = r["metrics"]
        _check_whole_batch(r)
        assert m["tailsieve/aborted_groups"] == 0 and not r["outcome"].carried_ids
        if step <= 2:  # the first epoch: nothing known, nothing planned from the record, one shared pool
            assert (m["tailsieve/record_planned"], m["tailsieve/record_coverage"], m["tailsieve/m"]) == (0, 0, 0)
            assert "tailsieve/record_rho" not in m and m["tailsieve/record_plan_cpu_s"] == 0
        else:  # the second: every prompt known, the step planned from the record
            assert (m["tailsieve/record_planned"], m["tailsieve/record_coverage"]) == (1, 1.0)
            assert -1 <= m["tailsieve/record_rho"] <= 1 and m["tailsieve/record_plan_cpu_s"] > 0
    assert h.trainer.cycle.decision.split == (0, 0)  # the controller waited
    # a plan that keeps one shared pool, measured against the controller's one shared pool, may stop planning
    stopped = h.trainer.cycle.guard.off
    assert h.trainer.cycle.planning == (not stopped)
    assert (f"record-planned steps stop, back to the controller's decisions: {stopped}" in caplog.text) == bool(stopped)
    state = h.trainer.cycle.state_dict()
    h.trainer._save_checkpoint()
    h.close()

    resumed = harness_factory(overrides)  # resume_mode=auto: global_step_3, mid-epoch
    assert resumed.trainer.global_steps == 3
    assert resumed.trainer.cycle.state_dict() == state  # the record and the planning state came back
    results.append(resumed.step())
    m, outcome = results[-1]["metrics"], results[-1]["outcome"]
    _check_whole_batch(results[-1])
    assert (m["tailsieve/record_planned"], m["tailsieve/record_coverage"]) == (0 if stopped else 1, 1.0)
    assert "tailsieve/record_rho" in m
    assert m["tailsieve/aborted_groups"] == 0 and not outcome.carried_ids  # planned: nothing aborted or carried
    assert sum(s["aborted"] for s in resumed.server_stats()) == 0
    assert m["tailsieve/q"] == m["tailsieve/carried_groups"] + m["tailsieve/record_tail_groups"]
    assert (m["tailsieve/m"] > 0) == (m["tailsieve/q"] > 0) and 0 < m["tailsieve/record_plan_relative"] <= 1
    # two epochs in four steps: every prompt consumed once an epoch (whole groups), every pull once
    consumed = [c for r in results for c in r["outcome"].consumed_ids]
    assert len(consumed) == len(set(consumed)) == 4 * B
    assert set(Counter(p for r in results for p in r["prompt_ids"]).values()) == {2 * N}
    assert not resumed.trainer.carried_rows and not resumed.trainer.drawn_rows
    record, guard = resumed.trainer.cycle.record, resumed.trainer.cycle.guard
    keys = list(record.state_dict()["prompts"])
    # the guard weighs the planned steps that split (the controller holds one shared pool); lengths are seeded by
    # verl's request ids, so a plan may keep one shared pool on one run and split on the next
    weighed = sum(r["metrics"]["tailsieve/record_planned"] == 1 and r["metrics"]["tailsieve/m"] > 0 for r in results)
    assert len(keys) == 16 and guard.steps == weighed and (weighed >= 1 or not stopped)
    saved, predictions = record.state_dict(), record.predictions(keys)
    resumed.trainer._save_checkpoint()
    resumed.close()

    # another batch size: the record is kept whole, the record-planned steps' guard starts afresh
    wider = harness_factory(overrides + ["data.train_batch_size=16", "+tailsieve.on_checkpoint_mismatch=keep_carried"])
    cycle = wider.trainer.cycle
    assert wider.trainer.global_steps == 4 and cycle.selector.batch_size == 16
    assert cycle.record.state_dict() == saved  # as saved: its predictions (the file rounds the record's figures)
    assert cycle.record.predictions(keys) == pytest.approx(predictions, rel=1e-4)
    fresh = TailSieveCycle(16, R, cycle.controller.config, wider.trainer.settings.perf())
    assert not cycle.planning and vars(cycle.guard) == vars(fresh.guard)


def test_carried_groups_are_regenerated_and_survive_checkpoint_resume(harness_factory, tmp_path):
    overrides = ["+tailsieve.mode=fixed", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
                 "+tailsieve.controller.inner_loop=false",  # hold q = 2 too, so every step carries 2
                 "tailsieve.sim.time_scale=30",  # slow enough that the cutoff lands before the tails finish
                 f"trainer.default_local_dir={tmp_path}"]
    h = harness_factory(overrides)  # candidate_factor 2 (default): 4 aborted per step, the top 2 isolated
    consumed: list[str] = []
    carried_prev: tuple[str, ...] = ()
    wasted, all_scores = 0.0, []
    for step in range(3):
        heaviest = _heaviest_candidates(h.trainer, 2)
        before = h.server_stats()[0]
        result = h.step()
        after = h.server_stats()[0]
        m, outcome = result["metrics"], result["outcome"]
        _check_whole_batch(result)
        consumed += sorted(set(result["prompt_ids"]))
        tail_ids = [c.prompt_id for c in outcome.consumed if c.route == "tail"]
        assert tuple(tail_ids) == heaviest  # last step's two heaviest candidates, regenerated now
        assert set(tail_ids) <= set(carried_prev)  # (no fresh prompt is known to the record yet)
        assert m["tailsieve/carried_groups"] == len(carried_prev[:2])
        assert m["tailsieve/requeued_groups"] == len(carried_prev[2:])  # the other candidates: bulk pool
        assert m["tailsieve/m"] == (1 if carried_prev else 0)
        assert m["tailsieve/q"] == 2 and m["tailsieve/aborted_groups"] == len(outcome.carried_ids) == 4
        scores = [h.trainer.cycle.selector.scores[p] for p in outcome.carried_ids]
        assert scores == sorted(scores, reverse=True)  # ranked by tokens generated by the abort
        all_scores += scores
        wasted += m["tailsieve/aborted_tokens"]
        assert not set(outcome.carried_ids) & set(outcome.consumed_ids)
        if carried_prev:  # replica 0 is the tail pool: it ran exactly the isolated groups, never aborted
            assert after["completed"] - before["completed"] == 2 * N
            assert after["aborted"] == before["aborted"]
        carried_prev = outcome.carried_ids
    assert len(consumed) == len(set(consumed)) == 3 * B  # no prompt consumed twice
    stats = h.server_stats()
    assert sum(s["aborted"] for s in stats) > 0  # the bulk cutoff really aborted requests
    # every token an abort cut is waste, and so are the finished samples of aborted groups (test_sample_work)
    assert wasted >= sum(s["aborted_tokens"] for s in stats)
    assert max(all_scores) > 0  # (a group parked before admission scores 0: it generated nothing)

    carried_rows = dict(h.trainer.carried_rows)
    carried_prompts = {row["extra_info"][0]["prompt_id"] for row in carried_rows.values()}
    assert len(carried_prompts) == 4 and not carried_prompts & set(consumed)
    record = h.trainer.cycle.record.state_dict()
    drawn = [row["extra_info"][0]["prompt_id"] for row in h.trainer.drawn_rows]  # the loader's next prompts
    h.trainer._save_checkpoint()
    folder = Path(h.trainer.config.trainer.default_local_dir) / "global_step_3"
    assert (folder / "tailsieve.pt").exists() and not (folder / "transfer_queue").exists()  # as stock sync saves
    h.close()

    resumed = harness_factory(overrides)  # resume_mode=auto finds global_step_3
    assert resumed.trainer.global_steps == 3
    assert set(resumed.trainer.carried_rows) == set(carried_rows)
    assert resumed.trainer.cycle.record.state_dict() == record  # the per-prompt length record came back too
    assert [row["extra_info"][0]["prompt_id"] for row in resumed.trainer.drawn_rows] == drawn
    result = resumed.step()
    _check_whole_batch(result)
    outcome, m = result["outcome"], result["metrics"]
    # every restored candidate ran exactly once after the resume (tail or bulk): consumed, or aborted and carried again
    regenerated = list(outcome.consumed_ids) + list(outcome.carried_ids)
    assert all(regenerated.count(identity) == 1 for identity in carried_rows)
    # the tail pool took the q = 2 heaviest: restored candidates by abort score, or fresh prompts the record knew
    assert m["tailsieve/carried_groups"] + m["tailsieve/record_tail_groups"] == 2
    after = set(result["prompt_ids"])
    assert not (after - carried_prompts) & set(consumed)  # and nothing consumed twice
    carried_after = {row["extra_info"][0]["prompt_id"] for row in resumed.trainer.carried_rows.values()}
    assert set(drawn) <= after | carried_after  # the drawn prompts went first after the resume


def test_replica_failure_mid_step_redispatches_its_groups(harness_factory, tmp_path):
    h = harness_factory(["+tailsieve.mode=fixed", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
                         "+tailsieve.controller.inner_loop=false", "tailsieve.sim.time_scale=40", f"trainer.default_local_dir={tmp_path}"])
    h.step()  # fills the carried queue, so the next step has a tail pool
    victim = h.trainer.llm_server_manager.get_replicas()[-1]  # a bulk replica
    killer = _kill_when_busy(victim)
    result = h.step()
    killer.join()
    m = result["metrics"]
    _check_whole_batch(result)
    assert m["tailsieve/redispatched_groups"] > 0
    assert m["tailsieve/live_replicas"] == R - 1
    outcome = result["outcome"]
    assert len(outcome.consumed) == B and len(outcome.carried_ids) == 4  # candidate_factor 2 × q
    result = h.step()  # the next step runs on the survivors
    _check_whole_batch(result)
    assert result["metrics"]["tailsieve/live_replicas"] == R - 1


def test_a_replica_dead_after_its_last_request_stops_the_step_naming_it(harness_factory, tmp_path):
    """A replica that dies between the rollout's end and verl's sleep call (nothing of the step is
    left to re-dispatch) stops the run with the trainer's one-line error, not a bare actor error."""
    from tailsieve_verl.integration.trainer import RolloutStepError

    h = harness_factory([f"trainer.default_local_dir={tmp_path}"])
    h.step()
    victim = h.trainer.llm_server_manager.get_replicas()[-1]
    _kill(victim)
    with pytest.raises(RolloutStepError, match=f"rank {victim.replica_rank} at .* is down when verl put the replicas"):
        h.trainer.on_sample_end()  # verl's hook after the rollout: it sleeps every replica
    with pytest.raises(RolloutStepError, match=f"rank {victim.replica_rank} at .* is down before the weight update"):
        h.trainer.on_step_end()

