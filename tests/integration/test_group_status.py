"""TransferQueue group statuses: verl's strings, and which of them are settled."""

from __future__ import annotations

import inspect

from tailsieve_verl.integration.group_status import GroupStatus


def test_settled_means_finished_or_failed():
    assert [s for s in GroupStatus if GroupStatus.is_settled(s)] == [GroupStatus.FINISHED, GroupStatus.FAILURE]
    assert GroupStatus.is_settled("finished") and GroupStatus.is_settled("failure")
    assert not GroupStatus.is_settled("running") and not GroupStatus.is_settled(None)


def test_the_values_are_the_statuses_verl_writes():
    from verl.trainer.ppo.v1 import replay_buffer  # the CPU suite always has verl: a missing one fails
    source = inspect.getsource(replay_buffer.ReplayBuffer)
    for status in GroupStatus:
        assert f'case "{status.value}":' in source  # verl's ReplayBuffer accepts exactly these
