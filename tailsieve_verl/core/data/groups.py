"""Prompt groups and traces: the one data type shared by the simulator, the oracle, the planner
and the verl path.

A *group* is one prompt with the response lengths (tokens) of its n samples; groups are atomic
(all n samples run on one replica). A *trace* is an ordered tuple of groups (one rollout step, or a
prompt pool). Reading and writing them: :mod:`.trace` (trace files) and :mod:`.rollout_dump`
(verl's rollout dumps); this module does no file I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Sequence

from ..errors import TailSieveError


# Upper bound on one response's (or prompt's) token count: far above any engine's context window,
# low enough that a typo (a timestamp, a byte count) cannot make the evaluators allocate terabytes.
MAX_TOKENS = 10_000_000


class TraceError(TailSieveError):
    """A trace or prompt file is malformed; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Group:
    """One prompt's group of n responses. ``lengths`` are response tokens per sample."""

    prompt_id: str
    lengths: tuple[int, ...]
    prompt_len: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(self.lengths))

    @property
    def n(self) -> int:
        return len(self.lengths)

    @cached_property  # read millions of times by the searches; a group never changes
    def max_len(self) -> int:
        return max(self.lengths)

    @cached_property
    def total_len(self) -> int:
        return sum(self.lengths)

    def to_json(self) -> dict:
        record = {"prompt_id": self.prompt_id, "lengths": list(self.lengths)}
        if self.prompt_len:
            record["prompt_len"] = self.prompt_len
        return record


@dataclass(frozen=True)
class Trace:
    """An ordered collection of groups with unique prompt ids."""

    groups: tuple[Group, ...]
    name: str = ""
    _index: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        index: dict[str, int] = {}
        for i, g in enumerate(self.groups):
            if g.prompt_id in index:
                raise TraceError(
                    f"{self.name or 'trace'}: duplicate prompt_id {g.prompt_id!r} (groups "
                    f"{index[g.prompt_id]} and {i}); each prompt must appear once — merge its samples "
                    "into one group"
                )
            index[g.prompt_id] = i
        object.__setattr__(self, "_index", index)

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self):
        return iter(self.groups)

    def __getitem__(self, i: int) -> Group:
        return self.groups[i]

    def get(self, prompt_id: str) -> Group:
        return self.groups[self._index[prompt_id]]

    @property
    def lengths(self) -> list[int]:
        """All response lengths, flattened in group order."""
        return [length for g in self.groups for length in g.lengths]


def validate_group_record(record: object, where: str) -> Group:
    """Turn one parsed record into a :class:`Group`, or raise :class:`TraceError` naming ``where``."""
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object like "
                         '{"prompt_id": "p0", "lengths": [120, 340]}, got ' + type(record).__name__)
    missing = [k for k in ("prompt_id", "lengths") if k not in record]
    if missing:
        raise TraceError(f"{where}: missing key(s) {', '.join(missing)}; each line needs "
                         '"prompt_id" (string) and "lengths" (list of response token counts)')
    pid = record["prompt_id"]
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or str(pid) == "":
        raise TraceError(f"{where}: prompt_id must be a non-empty string, got {pid!r}")
    lengths = record["lengths"]
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) and not hasattr(lengths, "tolist"):
        raise TraceError(f"{where}: lengths must be a list of integers, got {type(lengths).__name__}")
    lengths = list(lengths.tolist() if hasattr(lengths, "tolist") else lengths)
    if not lengths:
        raise TraceError(f"{where}: empty group (prompt_id {pid!r} has no lengths); drop the line or "
                         "add the group's response lengths")
    for j, v in enumerate(lengths):
        if isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()):
            raise TraceError(f"{where}: lengths[{j}] = {v!r} is not an integer token count")
        if v < 0:
            raise TraceError(f"{where}: lengths[{j}] = {v} is negative; token counts are >= 0")
        if v > MAX_TOKENS:
            raise TraceError(f"{where}: lengths[{j}] = {v:.0f} is above the {MAX_TOKENS:,}-token limit on a response "
                             "length; lengths are token counts per response (check the units)")
    prompt_len = record.get("prompt_len", 0)
    if prompt_len is None:
        prompt_len = 0
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 0:
        raise TraceError(f"{where}: prompt_len must be a non-negative integer, got {prompt_len!r}")
    if prompt_len > MAX_TOKENS:
        raise TraceError(f"{where}: prompt_len = {prompt_len} is above the {MAX_TOKENS:,}-token limit")
    return Group(str(pid), tuple(int(v) for v in lengths), int(prompt_len))


def groups_to_trace(groups: Iterable[Group], name: str) -> Trace:
    groups = list(groups)
    if not groups:
        raise TraceError(f"{name}: no groups found; a trace needs at least one prompt group")
    return Trace(tuple(groups), name=name)
