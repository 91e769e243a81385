"""Records of a JSONL or Parquet file, each with where it stands for error messages; shared by
the trace reader (:mod:`.trace`), the rollout-dump reader (:mod:`.rollout_dump`) and data preparation."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from ..errors import TailSieveError
from .groups import TraceError


def iter_records(path: str | os.PathLike,
                 error: type[TailSieveError] = TraceError) -> Iterator[tuple[str, object]]:
    """``(where, record)`` per non-blank JSONL line or Parquet row; ``where`` names the file and the
    line (or row) for error messages. Bad JSON, text that is not UTF-8 and a file that is not
    Parquet raise ``error`` saying so."""
    path = Path(path)
    if path.suffix == ".parquet":
        yield from _parquet_records(path, error)
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                raise error(f"{where}: not UTF-8 text (a binary file?); expected JSONL, one JSON object per line, "
                            "or a .parquet file") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: not valid JSON ({e.msg}); one JSON object per line") from None
            except (ValueError, RecursionError) as e:  # a number too long to convert, nesting too deep
                raise error(f"{where}: not usable JSON ({str(e).splitlines()[0]}); one JSON object per line") from None


def _parquet_records(path: Path, error: type[TailSieveError]) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        reason = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise error(f"{path}: not a readable Parquet file ({reason}); give a Parquet file with prompt_id and "
                    "lengths columns, or a JSONL trace (any other suffix)") from None
    for row, record in enumerate(rows):
        yield f"{path}: row {row}", record
