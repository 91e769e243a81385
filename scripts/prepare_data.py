#!/usr/bin/env python
"""Turn a local math or coding data set into verl's RL parquet format for the TailSieve recipes.

Nothing is downloaded: point ``--input`` at a JSONL or Parquet file you already have.

math  — one problem per row. Question field: ``question`` | ``problem`` | ``prompt``; answer:
        ``answer`` (GSM8K's ``... #### 72`` is cut at ``####``) or ``solution`` (its last
        ``\\boxed{}``, as in MATH / MATH-500). Fits GSM8K, MATH, MATH-500, DAPO-Math-style jsonl.
code  — one function-writing task per row. Question: ``text`` | ``prompt`` | ``question`` |
        ``problem``; tests: ``test_list`` (list of ``assert`` lines, MBPP), ``tests`` (list or
        newline-separated asserts) or HumanEval's ``test`` (a ``check(candidate)`` function, run on
        ``entry_point``, beside the helpers its code ``prompt`` defines); optional ``test_setup_code`` / ``test_imports``; entry point:
        ``entry_point``, else the function the tests call (MBPP), else the one ``def`` of the
        reference ``code``. Fits MBPP, HumanEval(+) and jsonl in those shapes; stdin/stdout-judged
        sets (LiveCodeBench, APPS) need their tests rewritten as asserts first.

Each output row: ``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model``
(``{"style": "rule", "ground_truth": ...}``) and ``extra_info`` (``split``, ``index``,
``prompt_id`` — a stable id from the source row's id or its question text).

    python scripts/prepare_data.py math --input gsm8k_train.jsonl --output data/math/train.parquet
    python scripts/prepare_data.py code --input mbpp.jsonl --output data/code/train.parquet --split train
"""

from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailsieve_verl.core.errors import TailSieveError  # noqa: E402
from tailsieve_verl.core.data.trace import iter_records  # noqa: E402
from tailsieve_verl.rewards import (  # noqa: E402
    CODE_DATA_SOURCE,
    MATH_DATA_SOURCE,
    code_prompt,
    judge_job,
    math_prompt,
)


class DataPrepError(TailSieveError):
    """A source row cannot be converted; the message names the file, the row and the fix."""


def read_rows(path: Path) -> Iterator[tuple[str, dict]]:
    if not path.exists():
        raise DataPrepError(f"{path}: no such file; give a local .jsonl or .parquet file")
    for where, row in iter_records(path, error=DataPrepError):
        if not isinstance(row, dict):
            raise DataPrepError(f"{where}: expected a JSON object")
        yield where, row


def first_field(row: dict, names: tuple[str, ...], where: str, what: str) -> str:
    for name in names:
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return value
    raise DataPrepError(f"{where}: no {what} field (looked for {', '.join(names)}); rename the column")


def stable_prompt_id(row: dict, question: str, prefix: str) -> str:
    for name in ("id", "task_id", "unique_id", "problem_id"):
        if row.get(name) not in (None, ""):
            return f"{prefix}-{row[name]}"
    return f"{prefix}-{hashlib.sha1(question.encode('utf-8')).hexdigest()[:16]}"


def math_answer(row: dict, where: str) -> str:
    from verl.utils.reward_score.math_reward import last_boxed_only_string, remove_boxed

    if isinstance(row.get("answer"), (str, int, float)) and str(row["answer"]).strip():
        answer = str(row["answer"])
        return answer.split("####")[-1].strip().replace(",", "") if "####" in answer else answer.strip()
    if isinstance(row.get("solution"), str):
        boxed = last_boxed_only_string(row["solution"])
        if boxed is not None:
            return remove_boxed(boxed).strip()
    raise DataPrepError(f"{where}: no answer (an 'answer' field, or a 'solution' with \\boxed{{}})")


def math_record(row: dict, where: str, split: str, index: int) -> dict:
    question = first_field(row, ("question", "problem", "prompt"), where, "question")
    return {
        "data_source": MATH_DATA_SOURCE,
        "prompt": [{"role": "user", "content": math_prompt(question)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": math_answer(row, where)},
        "extra_info": {"split": split, "index": index, "prompt_id": stable_prompt_id(row, question, "math")},
    }


def called_function(tests: list[str]) -> str | None:
    names = set()
    for test in tests:
        try:
            tree = ast.parse(test)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not hasattr(builtins, node.func.id):
                names.add(node.func.id)
    return names.pop() if len(names) == 1 else None


def defined_function(code: object) -> str | None:
    if not isinstance(code, str):
        return None
    try:
        defs = [n.name for n in ast.parse(code).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    except SyntaxError:
        return None
    return defs[0] if len(defs) == 1 else None


def prompt_definitions(prompt: object, entry_point: str) -> list[str]:
    """HumanEval's prompt is code: the helpers and constants it defines beside the entry point (the
    ``poly`` that HumanEval/32's test calls, say) run in the judge, so the tests use the problem's
    own, not the candidate's."""
    try:
        body = ast.parse(prompt).body if isinstance(prompt, str) else []
    except SyntaxError:
        return []
    if not any(isinstance(node, ast.FunctionDef) and node.name == entry_point for node in body):
        return []
    return [ast.unparse(node) for node in body
            if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point)
            and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]


def code_record(row: dict, where: str, split: str, index: int) -> dict:
    question = first_field(row, ("text", "prompt", "question", "problem"), where, "question")
    tests = row.get("test_list", row.get("tests"))
    if isinstance(row.get("test"), str) and "def check(" in row["test"] and isinstance(row.get("entry_point"), str):
        tests = [*prompt_definitions(row.get("prompt"), row["entry_point"]), row["test"],
                 f"check({row['entry_point']})"]  # HumanEval: a check(candidate) function
    if isinstance(tests, str):
        tests = [line for line in tests.splitlines() if line.strip()]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise DataPrepError(f"{where}: needs 'test_list' or 'tests': a non-empty list of assert lines")
    setup = [s for s in (row.get("test_imports"), row.get("test_setup_code")) if s]
    setup = [line for s in setup for line in (s if isinstance(s, list) else str(s).splitlines())]
    entry_point = row.get("entry_point") or called_function(tests) or defined_function(row.get("code"))
    if not isinstance(entry_point, str) or not re.fullmatch(r"[A-Za-z_]\w*", entry_point):
        raise DataPrepError(f"{where}: cannot tell which function the tests call; add an 'entry_point' field")
    try:  # tests that do not parse or never use the entry point would fail at the first reward call, not here
        judge_job("", entry_point, [*setup, *tests])
    except ValueError as error:
        raise DataPrepError(f"{where}: {error}") from None
    ground_truth = json.dumps({"entry_point": entry_point, "tests": [*setup, *tests]})
    return {
        "data_source": CODE_DATA_SOURCE,
        "prompt": [{"role": "user", "content": code_prompt(question, entry_point)}],
        "ability": "code",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "prompt_id": stable_prompt_id(row, question, "code")},
    }


BUILDERS = {"math": math_record, "code": code_record}


def prepare(workload: str, input_path: Path, output_path: Path, split: str, limit: int | None = None) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    build = BUILDERS[workload]
    records, seen = [], {}
    for where, row in read_rows(input_path):
        if limit is not None and len(records) >= limit:
            break
        record = build(row, where, split, len(records))
        pid = record["extra_info"]["prompt_id"]
        if pid in seen:
            raise DataPrepError(f"{where}: duplicate prompt (same id/question as {seen[pid]}); de-duplicate the "
                                "source so each prompt has one identity")
        seen[pid] = where
        records.append(record)
    if not records:
        raise DataPrepError(f"{input_path}: no rows")
    output_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), output_path)
    return len(records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(BUILDERS))
    parser.add_argument("--input", required=True, type=Path, help="local source file (.jsonl or .parquet)")
    parser.add_argument("--output", required=True, type=Path, help="parquet file to write")
    parser.add_argument("--split", default="train", help="value of extra_info.split (default: train)")
    parser.add_argument("--limit", type=int, default=None, help="keep only the first N rows")
    args = parser.parse_args(argv)
    try:
        n = prepare(args.workload, args.input, args.output, args.split, args.limit)
    except TailSieveError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} {args.workload} prompts to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
