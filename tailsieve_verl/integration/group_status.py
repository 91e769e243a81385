"""A prompt group's status in TransferQueue, as verl 0.9.1 writes it.

verl tags every prompt key of a partition with ``{"status": ...}``: ``pending`` when the trainer
submits it (``trainer_base``), ``running`` when an agent-loop worker picks it up, and, once every
session of the group has settled, ``finished`` or ``failure`` (``agent_loop_tq.py``); verl's own
``ReplayBuffer`` refuses any other value. The values are verl's strings, so a status read from
TransferQueue compares equal to its member (``"finished" == GroupStatus.FINISHED``).
"""

from __future__ import annotations

from tailsieve_verl.core.kinds import StrEnum


class GroupStatus(StrEnum):
    PENDING = "pending"  # submitted, not yet picked up by an agent-loop worker
    RUNNING = "running"  # its samples are being generated
    FINISHED = "finished"  # every sample completed (possibly cut short by an abort)
    FAILURE = "failure"  # a sample raised (its replica died, its tool failed, it was aborted); the others' trajectories are kept

    @staticmethod
    def is_settled(status: str | None) -> bool:
        """Finished or failed: the group's agent loop writes nothing more (``None``: not listed yet)."""
        return status in (GroupStatus.FINISHED, GroupStatus.FAILURE)
