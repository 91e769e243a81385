"""The start-up check of the private verl internals TailSieve overrides or calls (integration.verl_compat)."""

from __future__ import annotations

import importlib

import pytest

from tailsieve_verl.integration.verl_compat import (
    INTERNALS,
    SUPPORTED_VERL_VERSION,
    Internal,
    VerlCompatibilityError,
    check_verl_internals,
)


def _owner(internal: Internal):
    module, cls = internal.owner.split(":")
    return getattr(importlib.import_module(module), cls)


def test_the_installed_verl_matches_every_internal():
    import verl

    assert verl.__version__ == SUPPORTED_VERL_VERSION
    check_verl_internals()


def test_every_overridden_verl_method_is_listed():
    """A TailSieve override of a private verl method that the check does not cover would go unchecked."""
    from tailsieve_verl.integration.trainer import TailSieveReplayBuffer, TailSieveTrainer

    listed = {(i.owner.split(":")[1], i.name) for i in INTERNALS}
    for ours, base in ((TailSieveTrainer, "PPOTrainer"), (TailSieveReplayBuffer, "ReplayBuffer")):
        for name in vars(ours):
            if name.startswith("_") and not name.startswith("__") and callable(getattr(ours, name)):
                inherited = [c for c in ours.__mro__[1:] if name in vars(c)]
                if inherited:  # an override of something verl defines
                    assert (base, name) in listed or any((c.__name__, name) in listed for c in inherited), name


@pytest.mark.parametrize("internal", INTERNALS, ids=lambda i: f"{i.owner.split(':')[1]}.{i.name}")
def test_a_missing_internal_stops_with_one_line_naming_the_supported_version(monkeypatch, internal):
    monkeypatch.delattr(_owner(internal), internal.name)
    with pytest.raises(VerlCompatibilityError) as info:
        check_verl_internals()
    message = str(info.value)
    assert "\n" not in message
    assert f"verl {SUPPORTED_VERL_VERSION}" in message and f"verl=={SUPPORTED_VERL_VERSION}" in message
    assert f"{internal.name} is missing" in message


def test_a_changed_signature_stops_with_the_found_and_expected_parameters(monkeypatch):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    def materialize(self, partition_id, uids):  # a verl that dropped the snapshot argument
        return None

    monkeypatch.setattr(ReplayBuffer, "_materialize_batch", materialize)
    with pytest.raises(VerlCompatibilityError,
                       match=r"ReplayBuffer\._materialize_batch\(self, partition_id, uids\) does not take "
                             r"\(self, partition_id, selected_prompt_uids, partition_snapshot\)"):
        check_verl_internals()


def test_a_keyword_the_plugin_passes_must_exist(monkeypatch):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    def init(self, trainer_mode, trainer_config, max_off_policy_threshold, max_off_policy_strategy, sampler_kwargs,
             refill_fn=None, train_batch_size=None, gen_batch_size=None):  # no poll_interval
        pass

    monkeypatch.setattr(ReplayBuffer, "__init__", init)
    with pytest.raises(VerlCompatibilityError, match=r"ReplayBuffer\.__init__\(.*\) does not take"):
        check_verl_internals()


def test_the_trainer_checks_before_reading_its_config(monkeypatch):
    """The check runs first in TailSieveTrainer.__init__: nothing is launched on a mismatching verl."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from tailsieve_verl.integration.trainer import TailSieveTrainer

    monkeypatch.delattr(PPOTrainer, "_step_once")
    with pytest.raises(VerlCompatibilityError, match="_step_once is missing"):
        TailSieveTrainer(config=None)
