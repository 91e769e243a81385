"""Resuming the TailSieve trainer from a tailsieve.pt it cannot use as is, on verl's real rollout path
with simulated replicas: the run stops in init(), before verl launches a worker or a replica, with one
line; or, under +tailsieve.on_checkpoint_mismatch, goes on without losing or repeating a prompt
unannounced."""

from __future__ import annotations

import pytest

from tailsieve_verl.integration.checkpoint import STATE_FILE, CheckpointMismatchError
from tailsieve_verl.integration.rollout_only import RolloutOnlyTrainer

OVERRIDES = ["+tailsieve.mode=fixed", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
             "+tailsieve.controller.inner_loop=false", "tailsieve.sim.time_scale=30"]


def _prompt_id(row) -> str:
    return row["extra_info"][0]["prompt_id"]


def _refused_before_launch(harness_factory, monkeypatch, overrides: list[str]) -> str:
    """The one-line error a resume raises; fails the test if verl's set-up (workers, replicas) ran."""
    with monkeypatch.context() as patch:
        patch.setattr(RolloutOnlyTrainer, "_setup", lambda self: pytest.fail("verl launched workers and replicas"))
        with pytest.raises(CheckpointMismatchError) as error:
            harness_factory(overrides)
    line = str(error.value)
    assert "\n" not in line
    return line


def test_a_resume_under_another_shape_or_from_a_broken_file_stops_before_launch_or_keeps_every_prompt(
        harness_factory, monkeypatch, tmp_path, caplog):
    overrides = OVERRIDES + [f"trainer.default_local_dir={tmp_path}"]
    h = harness_factory(overrides)
    consumed: list[str] = []
    for _ in range(2):
        consumed += h.step()["prompt_ids"]
    carried = {identity: _prompt_id(row) for identity, row in h.trainer.carried_rows.items()}
    assert len(carried) == 4 and not set(carried.values()) & set(consumed)
    h.trainer._save_checkpoint()
    h.close()

    line = _refused_before_launch(harness_factory, monkeypatch, overrides + [
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.n_gpus_per_node=2"])
    assert "rollout replicas 4 (this run 2)" in line and "Resume with a layout of 4 rollout replicas" in line
    assert "+tailsieve.on_checkpoint_mismatch=keep_carried (its 4 carried prompts are trained once" in line
    line = _refused_before_launch(harness_factory, monkeypatch, overrides + ["data.train_batch_size=16"])
    assert "data.train_batch_size 8 (this run 16)" in line and "Resume with data.train_batch_size=8" in line

    # keep_carried: batch 16 from a batch-8 checkpoint; the 4 carried prompts run once in the next step
    resumed = harness_factory(overrides + ["data.train_batch_size=16", "+tailsieve.on_checkpoint_mismatch=keep_carried"])
    assert set(resumed.trainer.carried_rows) == set(carried) and resumed.trainer.global_steps == 2
    result = resumed.step()
    outcome = result["outcome"]
    regenerated = list(outcome.consumed_ids) + list(outcome.carried_ids)
    assert all(regenerated.count(identity) == 1 for identity in carried)
    trained = result["prompt_ids"]
    assert len(set(trained)) == 16 and not set(trained) & set(consumed)  # nothing trained twice
    assert "its 4 carried prompts are regenerated in the next step" in caplog.text
    resumed.close()

    # a truncated file (the tracker still names step 2): stop, or go on without its carried prompts
    path = tmp_path / "global_step_2" / STATE_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    line = _refused_before_launch(harness_factory, monkeypatch, overrides)
    assert "cannot be read" in line and "+tailsieve.on_checkpoint_mismatch=drop_carried" in line
    dropped = harness_factory(overrides + ["+tailsieve.on_checkpoint_mismatch=drop_carried"])
    assert dropped.trainer.carried_rows == {} and dropped.trainer.global_steps == 2
    assert "up to 14 prompts of this epoch are not regenerated" in caplog.text
    trained = dropped.step()["prompt_ids"]
    assert len(set(trained)) == 8 and not set(trained) & (set(consumed) | set(carried.values()))


def test_a_resume_starts_at_the_split_it_pins_and_a_plugin_upgrade_alone_resumes(harness_factory, tmp_path, caplog):
    """An adaptive run at m = 3 resumed with mode=fixed (q0, tail_replicas) = (2, 1) runs (2, 1), its
    carried prompts trained once; that run's checkpoint, its header rewritten as an older plugin
    version's, resumes adaptive from the learned (2, 1) (tail_replicas seeds only a fresh start)."""
    import torch

    adaptive = ["+tailsieve.q0=3", "+tailsieve.tail_replicas=3", "tailsieve.sim.time_scale=30",
                f"trainer.default_local_dir={tmp_path}"]
    h = harness_factory(adaptive)
    consumed = list(h.step()["prompt_ids"])
    assert (h.trainer.cycle.decision.m, h.trainer.settings.mode) == (3, "adaptive")
    carried = {identity: _prompt_id(row) for identity, row in h.trainer.carried_rows.items()}
    assert len(carried) == 6  # candidate_factor 2 x q 3
    h.trainer._save_checkpoint()
    h.close()

    fixed = harness_factory(OVERRIDES + [f"trainer.default_local_dir={tmp_path}"])  # q0=2, tail_replicas=1
    assert fixed.trainer.global_steps == 1 and set(fixed.trainer.carried_rows) == set(carried)
    assert (fixed.trainer.cycle.decision.q, fixed.trainer.cycle.decision.m) == (2, 1)
    assert "at the split this run pins, (q0, tail_replicas) = (2, 1) with the inner loop off" in caplog.text
    result = fixed.step()
    m, outcome = result["metrics"], result["outcome"]
    assert (m["tailsieve/q"], m["tailsieve/m"]) == (2, 1)
    regenerated = list(outcome.consumed_ids) + list(outcome.carried_ids)
    assert all(regenerated.count(identity) == 1 for identity in carried)  # each carried prompt ran once
    assert not set(result["prompt_ids"]) & set(consumed)
    learned = fixed.trainer.cycle.controller.state_dict()["state"]
    fixed.trainer._save_checkpoint()
    fixed.close()

    path = tmp_path / "global_step_2" / STATE_FILE
    state = torch.load(path, weights_only=False)
    state["run"]["plugin_version"] = "0.0.1"  # written by an older release, same format
    torch.save(state, path)
    resumed = harness_factory(adaptive)
    assert resumed.trainer.global_steps == 2 and resumed.trainer.cycle.controller.config.fixed_tail_replicas is None
    assert (resumed.trainer.cycle.decision.q, resumed.trainer.cycle.decision.m) == (2, 1)
    assert resumed.trainer.cycle.controller.state_dict()["state"] == learned  # the learned state, not a fresh start
