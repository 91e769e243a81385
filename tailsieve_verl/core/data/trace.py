"""Trace files: reading and writing prompt groups (:mod:`.groups`).

On-disk format (JSONL, one group per line)::

    {"prompt_id": "gsm8k-17", "lengths": [812, 1400, 95, ...], "prompt_len": 210}

``prompt_len`` is optional (default 0). Parquet files with the same columns are read too, and so
are the JSONL rollout dumps verl writes with ``trainer.rollout_data_dir`` (see
:mod:`.rollout_dump`). A length (response or prompt) above :data:`MAX_TOKENS` is refused: no engine
generates that many tokens, and the evaluators' memory grows with the longest response.

The types and the record reader are re-exported here, so ``from .trace import Group, Trace,
TraceError, MAX_TOKENS, iter_records`` keeps working.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from .groups import MAX_TOKENS, Group, Trace, TraceError, groups_to_trace, validate_group_record
from .records import iter_records
from .rollout_dump import build_trace

__all__ = ["MAX_TOKENS", "Group", "Trace", "TraceError", "groups_to_trace", "iter_records", "read_trace",
           "read_trace_file", "validate_group_record", "write_trace"]


def read_trace_file(path: str | os.PathLike) -> Trace:
    """A JSONL or Parquet trace; every bad record is reported with its line (or row)."""
    groups: list[Group] = []
    seen: dict[str, str] = {}
    for where, record in iter_records(path):
        group = validate_group_record(record, where)
        if group.prompt_id in seen:
            raise TraceError(f"{where}: duplicate prompt_id {group.prompt_id!r} (first at {seen[group.prompt_id]}); "
                             "merge its samples into one group")
        seen[group.prompt_id] = where
        groups.append(group)
    return groups_to_trace(groups, str(path))


def read_trace(path: str | os.PathLike) -> Trace:
    """Read a trace from a JSONL/Parquet trace file or a verl rollout-dump directory."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such file or directory")
    if path.is_dir():
        return _read_rollout_dump(path)
    if not path.is_file():
        raise TraceError(f"{path}: not a regular file; give a JSONL/Parquet trace or a rollout-dump directory")
    if path.suffix == ".parquet":
        return read_trace_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        head = json.loads(first) if first else {}
    except (UnicodeDecodeError, ValueError, RecursionError):  # read_trace_file names the line and the fault
        head = {}
    if isinstance(head, dict) and "lengths" not in head and ("output" in head or "response_length" in head):
        return _read_rollout_dump(path)
    return read_trace_file(path)


def _read_rollout_dump(path: Path) -> Trace:
    return build_trace(path).trace  # a prompt pool; `tailsieve trace` adds token counting


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
