"""TailSieveTrainer's own parts: the stable prompt key and the per-prompt record across epochs."""

from __future__ import annotations

from collections import Counter

import numpy as np
from verl.utils import tensordict_utils as tu

from tailsieve_verl.integration.trainer import prompt_key


def _rows(prompts: list[str]) -> list:
    batch = tu.get_tensordict({
        "raw_prompt": np.array([[{"role": "user", "content": p}] for p in prompts], dtype=object),
        "uid": np.array([f"uid-{i}" for i in range(len(prompts))], dtype=object)})
    return [batch[i:i + 1] for i in range(len(prompts))]


def test_prompt_key_names_the_prompt_not_the_fetch(tmp_path):
    import torch

    first, again, other = _rows(["two plus two", "two plus two", "three plus three"])
    assert prompt_key(first) == prompt_key(again)  # verl gave the two fetches different uids
    assert prompt_key(first) != prompt_key(other)
    torch.save({"row": first}, tmp_path / "state.pt")  # a carried row, checkpointed and restored
    restored = torch.load(tmp_path / "state.pt", weights_only=False)["row"]
    assert prompt_key(restored) == prompt_key(first)


def test_the_record_follows_prompts_across_epochs_and_sends_known_heavy_ones_to_the_tail(harness_factory, assets,
                                                                                       tmp_path):
    """12 prompts, 8 per step plus 4 aborted: every step after the first re-fetches prompts seen before.
    The record holds one entry per prompt (not per fetch), and fresh prompts it knows to be heavy go
    straight to the tail pool."""
    h = harness_factory([f"data.train_files={assets.small_data}", "+tailsieve.mode=fixed", "+tailsieve.q0=2",
                         "+tailsieve.tail_replicas=1", "+tailsieve.controller.inner_loop=false",
                         "tailsieve.sim.time_scale=30", f"trainer.default_local_dir={tmp_path}"])
    carried_prev: set[str] = set()
    fresh_in_tail = 0
    for _ in range(5):
        result = h.step()
        outcome = result["outcome"]
        groups = Counter(key.split("_")[0] for key in result["batch"].keys)
        assert len(groups) == 8 and set(groups.values()) == {2}  # B whole groups (a prompt carried from the
        # last epoch may meet its fresh fetch of this epoch in one batch: two groups, two uids)
        tail = [c.prompt_id for c in outcome.consumed if c.route == "tail"]
        fresh_in_tail += len(set(tail) - carried_prev)
        carried_prev = set(outcome.carried_ids)
    assert 0 < len(h.trainer.cycle.record) <= 12
    assert fresh_in_tail > 0
