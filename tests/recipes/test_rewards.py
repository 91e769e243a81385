"""Rewards of the recipe workloads: the format gates and the scoring, on hand-written responses."""

from __future__ import annotations

import json

import pytest

from tailsieve_verl import rewards
from tailsieve_verl.rewards import compute_score


def math(response: str, truth: str) -> float:
    return compute_score(rewards.MATH_DATA_SOURCE, response, truth, extra_info={})


def test_math_boxed_answer_followed_by_end_scores():
    assert math("2+2 is four, so \\boxed{4}<END>", "4") == 1.0
    assert math("so \\boxed{4} <END>\n", "4") == 1.0
    # engines that strip the stop string from the text
    assert math("so \\boxed{4}", "4") == 1.0


def test_math_wrong_or_unterminated_answers_score_zero():
    assert math("\\boxed{5}<END>", "4") == 0.0
    assert math("\\boxed{4}<END> and then more text", "4") == 0.0
    assert math("\\boxed{4} therefore", "4") == 0.0
    assert math("the answer is 4<END>", "4") == 0.0
    assert math("\\boxed{4<END>", "4") == 0.0


def test_math_uses_last_box_and_normalises():
    assert math("first \\boxed{3}, finally \\boxed{\\frac{1}{2}}<END>", "1/2") == 1.0
    assert math("\\boxed{\\dfrac{1}{2}}<END>", "0.5") == 1.0
    assert math("\\boxed{1,000}<END>", "1000") == 1.0
    assert math("\\boxed{\\{1, 2\\}}<END>", "\\{1,2\\}") == 1.0


CODE_TRUTH = json.dumps({"entry_point": "add", "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]})
PREAMBLE = "Reasoning: add.\nCorrectness: trivial.\nEdge cases: negatives.\nComplexity: O(1).\n"


def code(response: str, truth: str = CODE_TRUTH) -> float:
    return compute_score(rewards.CODE_DATA_SOURCE, response, truth)


def test_code_single_correct_function_scores_one():
    assert code(PREAMBLE + "```python\nimport math\n\ndef add(a, b):\n    return a + b\n```") == 1.0


def test_code_wrong_function_or_format_scores_zero():
    assert code(PREAMBLE + "```python\ndef add(a, b):\n    return a - b\n```") == 0.0
    two_blocks = PREAMBLE + "```python\ndef add(a, b):\n    return a + b\n```\n```python\nprint(1)\n```"
    assert code(two_blocks) == 0.0
    assert code(PREAMBLE + "no code at all") == 0.0
    assert code(PREAMBLE + "```python\ndef add(a, b) return\n```") == 0.0
    assert code(PREAMBLE + "```python\ndef plus(a, b):\n    return a + b\n```") == 0.0


def test_code_beside_the_entry_point_is_judged_not_refused():
    helper = PREAMBLE + "```python\nSTEP = 1\n\ndef helper(a):\n    return a\n\ndef add(a, b):\n    return helper(a) + b\n```"
    assert code(helper) == 1.0
    example_call = PREAMBLE + "```python\ndef add(a, b):\n    return a + b\nprint(add(1, 2))\n```"
    assert code(example_call) == 1.0
    assert code(example_call.replace("a + b", "a - b")) == 0.0


def test_code_runaway_function_is_stopped(monkeypatch):
    monkeypatch.setattr(rewards, "CODE_TIMEOUT_S", 1.0)
    loop = PREAMBLE + "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert rewards.run_function_tests(rewards.extract_code(loop), "add", ["assert add(1, 2) == 3"],
                                      timeout_s=1.0) is False


def test_unknown_data_source_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown data_source 'gsm8k'"):
        compute_score("gsm8k", "\\boxed{1}<END>", "1")


def test_bad_code_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="entry_point"):
        code("```python\ndef add(a, b):\n    return a + b\n```", json.dumps({"tests": []}))


def test_judge_job_keeps_the_tests_out_of_the_candidates_part():
    tests = ["import math", "assert add(1, 2) == 3", "assert math.isclose(add(0.1, 0.2), 0.3)",
             "assert add(add(1, 1), 1) == 3 and sorted([add(2, 2)]) == [4]", "assert cmath.phase(add(1, 0)) == 0"]
    job = rewards.judge_job("def add(a, b):\n    return a + b", "add", tests)
    assert job == {"code": "def add(a, b):\n    return a + b", "tests": tests, "remote": ["add"], "modules": ["cmath"]}
    helper = rewards.judge_job("", "add", ["def check(candidate):\n    assert candidate(1, 2) == helper(3)", "check(add)"])
    assert helper["remote"] == ["add", "helper"]  # names the tests never bind are the candidate's to answer


@pytest.mark.parametrize("test", [
    "assert all(add(i, 0) == i for i in range(3))",
    "assert list(map(add, [1], [2])) == [3]",
    "x = add(1, 2)\nassert x == 3",
    "def check(candidate):\n    for i in range(3):\n        assert candidate(i, 0) == i\ncheck(add)",
    "expected = {i: add(i, i) for i in range(3)}\nassert expected == {0: 0, 1: 2, 2: 4}",
])
def test_every_test_shape_is_judged(test):
    truth = json.dumps({"entry_point": "add", "tests": [test]})
    assert code(PREAMBLE + "```python\ndef add(a, b):\n    return a + b\n```", truth) == 1.0
    assert code(PREAMBLE + "```python\ndef add(a, b):\n    return a * b\n```", truth) == 0.0


def test_tests_that_never_use_the_entry_point_or_bind_it_are_a_clear_error():
    with pytest.raises(ValueError, match="no test uses the entry point 'add'"):
        rewards.judge_job("def add(a, b):\n    return a + b", "add", ["assert True"])
    with pytest.raises(ValueError, match="the tests bind the entry point 'add' themselves"):
        rewards.judge_job("", "add", ["def add(a, b):\n    return a + b", "assert add(1, 2) == 3"])
