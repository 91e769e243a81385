"""Trace format: round trips, verl rollout dumps, and one clear error per bad input naming the line."""

from __future__ import annotations

import json

import pytest

from tailsieve_verl.core.data.rollout_dump import prompt_identity
from tailsieve_verl.core.data.trace import Group, Trace, TraceError, read_trace, write_trace


def _write(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_and_parquet_round_trip(tmp_path):
    trace = Trace((Group("a", (3, 4), 10), Group("b", (7,))), name="x")
    for name in ("t.jsonl", "t.parquet"):
        write_trace(trace, tmp_path / name)
        back = read_trace(tmp_path / name)
        assert back.groups == trace.groups
    assert back.get("b").max_len == 7 and back.lengths == [3, 4, 7]


@pytest.mark.parametrize("line, needle", [
    ('{"lengths": [1, 2]}', "missing key(s) prompt_id"),
    ('{"prompt_id": "a"}', "missing key(s) lengths"),
    ('{"prompt_id": "a", "lengths": [1, -2]}', "lengths[1] = -2 is negative"),
    ('{"prompt_id": "a", "lengths": [1, 2.5]}', "lengths[1] = 2.5 is not an integer"),
    ('{"prompt_id": "a", "lengths": [1, "7"]}', "is not an integer"),
    ('{"prompt_id": "a", "lengths": []}', "empty group"),
    ('{"prompt_id": "a", "lengths": "12"}', "must be a list of integers"),
    ('{"prompt_id": "", "lengths": [1]}', "prompt_id must be a non-empty string"),
    ('{"prompt_id": "a", "lengths": [1], "prompt_len": -3}', "prompt_len must be a non-negative integer"),
    ('[1, 2, 3]', "expected a JSON object"),
    ('{"prompt_id": "a", "lengths": [1, 2]', "not valid JSON"),
])
def test_bad_line_names_file_and_line(tmp_path, line, needle):
    path = _write(tmp_path, ['{"prompt_id": "ok", "lengths": [5]}', line])
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert f"{path}:2" in str(err.value)
    assert needle in str(err.value)


def test_duplicate_prompt_names_both_lines(tmp_path):
    path = _write(tmp_path, ['{"prompt_id": "a", "lengths": [5]}', '{"prompt_id": "b", "lengths": [5]}',
                             '{"prompt_id": "a", "lengths": [6]}'])
    with pytest.raises(TraceError, match=r"t.jsonl:3: duplicate prompt_id 'a' \(first at .*t.jsonl:1\)"):
        read_trace(path)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(TraceError, match="no groups found"):
        read_trace(_write(tmp_path, [""]))
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "absent.jsonl")


def test_duplicate_ids_in_memory():
    with pytest.raises(TraceError, match="duplicate prompt_id 'a'"):
        Trace((Group("a", (1,)), Group("a", (2,))))


def test_parquet_missing_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt_id": "a"}]), path)
    with pytest.raises(TraceError, match="row 0: missing key"):
        read_trace(path)


def test_verl_rollout_dump_reads_as_a_prompt_pool(tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    rows = [{"input": "q1", "output": "x", "score": 1.0, "step": 1, "uid": "s7_0_0", "response_length": 12},
            {"input": "q1", "output": "y", "score": 0.0, "step": 1, "uid": "s7_0_1", "response_length": 30},
            {"input": "q2", "output": "z", "score": 0.0, "step": 1, "uid": "s9_0_0", "response_length": 4}]
    (dump / "1.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = read_trace(dump)
    assert [g.prompt_id for g in trace] == [prompt_identity("q1"), prompt_identity("q2")]
    assert trace.get(prompt_identity("q1")).lengths == (12, 30)
    assert trace.get(prompt_identity("q2")).lengths == (4,)


def test_verl_dump_bad_line(tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "3.jsonl").write_text('{"input": "q", "output": "a b", "step": 3}\n{"input": "q"}\n')
    with pytest.raises(TraceError, match=r"3.jsonl:2: not a verl rollout dump line"):
        read_trace(dump)
