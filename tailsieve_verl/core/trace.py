"""Prompt groups and traces: the one data type shared by the simulator, the oracle, the planner
and the verl path.

A *group* is one prompt with the response lengths (tokens) of its n samples; groups are atomic
(all n samples run on one replica). A *trace* is an ordered tuple of groups (one rollout step, or a
prompt pool).

On-disk format (JSONL, one group per line)::

    {"prompt_id": "gsm8k-17", "lengths": [812, 1400, 95, ...], "prompt_len": 210}

``prompt_len`` is optional (default 0). Parquet files with the same columns are read too, and so
are the JSONL rollout dumps verl writes with ``trainer.rollout_data_dir`` (see
:func:`read_verl_rollout_dump`).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from .errors import TailSieveError


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

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
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
    prompt_len = record.get("prompt_len", 0)
    if prompt_len is None:
        prompt_len = 0
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 0:
        raise TraceError(f"{where}: prompt_len must be a non-negative integer, got {prompt_len!r}")
    return Group(str(pid), tuple(int(v) for v in lengths), int(prompt_len))


def groups_to_trace(groups: Iterable[Group], name: str) -> Trace:
    groups = list(groups)
    if not groups:
        raise TraceError(f"{name}: no groups found; a trace needs at least one prompt group")
    return Trace(tuple(groups), name=name)


def read_jsonl(path: str | os.PathLike) -> Trace:
    path = Path(path)
    groups: list[Group] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg}); one JSON object per line") from None
            group = validate_group_record(record, where)
            if group.prompt_id in seen:
                raise TraceError(f"{where}: duplicate prompt_id {group.prompt_id!r} (first on line "
                                 f"{seen[group.prompt_id]}); merge its samples into one group")
            seen[group.prompt_id] = lineno
            groups.append(group)
    return groups_to_trace(groups, str(path))


def read_parquet(path: str | os.PathLike) -> Trace:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = {"prompt_id", "lengths"} - set(table.column_names)
    if missing:
        raise TraceError(f"{path}: parquet trace lacks column(s) {', '.join(sorted(missing))}; "
                         "expected prompt_id, lengths[, prompt_len]")
    groups, seen = [], {}
    for row, record in enumerate(table.to_pylist()):
        where = f"{path}: row {row}"
        group = validate_group_record(record, where)
        if group.prompt_id in seen:
            raise TraceError(f"{where}: duplicate prompt_id {group.prompt_id!r} (first at row "
                             f"{seen[group.prompt_id]})")
        seen[group.prompt_id] = row
        groups.append(group)
    return groups_to_trace(groups, str(path))


def group_key_from_uid(uid: object) -> str:
    """verl V1 keys a response ``{sample}_{rollout}_{output}``; its group is ``{sample}``."""
    parts = str(uid).rsplit("_", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() else str(uid)


def read_verl_rollout_dump(path: str | os.PathLike, step: int | None = None) -> Trace:
    """Read the JSONL rollout dumps that verl 0.9.1 writes under ``trainer.rollout_data_dir``.

    verl writes one ``{step}.jsonl`` per step; each line is one response with (at least) the
    decoded ``input`` and ``output`` text, ``score`` and ``step``, plus any extra keys it was given.
    V1 writes ``uid`` as the TransferQueue key ``{sample}_{rollout}_{output}``; a group is the
    ``{sample}`` part (the legacy trainer's ``uid`` is already per prompt), else the prompt text. The response length is ``response_length`` when the dump has it (token count), else the
    whitespace token count of ``output`` — an approximation the caller is warned about through the
    trace name. ``path`` is a directory (all steps, or ``step``) or one file.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"), key=lambda p: (len(p.stem), p.stem))
        if step is not None:
            files = [p for p in files if p.stem == str(step)]
        if not files:
            raise TraceError(f"{path}: no verl rollout dump ({'%s.jsonl' % step if step is not None else '*.jsonl'}) "
                             "found; point at trainer.rollout_data_dir of a verl run")
    else:
        files = [path]
    groups: "OrderedDict[str, dict]" = OrderedDict()
    approximate = False
    for file in files:
        with open(file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{file}:{lineno}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
                if not isinstance(rec, dict) or "output" not in rec and "response_length" not in rec:
                    raise TraceError(f"{where}: not a verl rollout dump line (needs 'output' or "
                                     "'response_length'); for a trace use the JSONL trace format")
                key = group_key_from_uid(rec["uid"]) if rec.get("uid") else rec.get("input")
                if key is None:
                    raise TraceError(f"{where}: cannot identify the prompt group (no 'uid' or 'input')")
                key = f"{rec.get('step', file.stem)}:{key}" if len(files) > 1 else str(key)
                if "response_length" in rec:
                    length = int(rec["response_length"])
                else:
                    length = len(str(rec["output"]).split())
                    approximate = True
                entry = groups.setdefault(key, {"lengths": [], "prompt_len": int(rec.get("prompt_length", 0) or 0)})
                entry["lengths"].append(length)
    prompt_ids = {key: f"g{i:06d}" if len(key) > 64 else key for i, key in enumerate(groups)}
    out = [Group(prompt_ids[k], tuple(v["lengths"]), v["prompt_len"]) for k, v in groups.items()]
    name = str(path) + (" (lengths approximated by whitespace tokens)" if approximate else "")
    return groups_to_trace(out, name)


def read_trace(path: str | os.PathLike) -> Trace:
    """Read a trace from a JSONL/Parquet trace file or a verl rollout-dump directory."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory")
    if path.is_dir():
        return read_verl_rollout_dump(path)
    if path.suffix == ".parquet":
        return read_parquet(path)
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        head = json.loads(first) if first else {}
    except json.JSONDecodeError:
        head = {}
    if isinstance(head, dict) and "lengths" not in head and ("output" in head or "response_length" in head):
        return read_verl_rollout_dump(path)
    return read_jsonl(path)


def write_trace(trace: Trace | Iterable[Group], path: str | os.PathLike) -> None:
    """Write groups as a JSONL (or ``.parquet``) trace."""
    groups = list(trace)
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([
            {"prompt_id": g.prompt_id, "lengths": list(g.lengths), "prompt_len": g.prompt_len} for g in groups
        ]), path)
        return
    with open(path, "w", encoding="utf-8") as f:
        for g in groups:
            f.write(json.dumps(g.to_json()) + "\n")
