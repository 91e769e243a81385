"""The named kinds shared by the core and the verl layer: pools and controller decisions.

Each is a string enum (:class:`enum.StrEnum`) whose values are the strings used before the enums existed, so a
member compares and hashes equal to its string, formats as it (``f"{Pool.TAIL}"`` is ``tail``) and
JSON-encodes as it: JSON outputs, metrics and checkpoints are unchanged, and a string read back from
one of them is accepted wherever a member is (``Pool("tail") is Pool.TAIL``).
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # Python 3.10 (setup.py's floor): the same behaviour for the uses here
    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)


class Pool(StrEnum):
    """Where a prompt group runs in a TailSieve step (:mod:`core.tailsieve.selector`)."""

    TAIL = "tail"  # m low-concurrency replicas regenerating the isolated candidates
    BULK = "bulk"  # the other R − m replicas: fresh prompts and the drained candidates
    ANY = "any"  # the router only: untagged requests (validation) go to the less loaded pool


class DecisionKind(StrEnum):
    """What produced a controller :class:`~core.tailsieve.controller.Decision` (the structured twin of its
    free-text ``reason``: read this, never parse the reason)."""

    CURRENT = "current"  # the controller's present (q, m), read before or without an observation
    HOLD = "hold"  # no loop ran (fixed split without the inner loop, or one shared pool)
    WAITING = "waiting"  # inner loop: no tail-pool measurement yet, q kept
    BALANCED = "balanced"  # inner loop: tail and bulk makespans within the tolerance, q kept
    INNER = "inner"  # inner loop: stepped q toward balance (its bounds may hold q where it was)
    OUTER = "outer"  # outer loop moved the replica split (and q with it)
    FIXED = "fixed"  # set by the caller, not the controller (stock routing, a scripted split)
