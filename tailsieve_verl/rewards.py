"""Prompt templates and rule-based rewards for the two TailSieve recipe workloads.

The templates and the reward parsers live together because they are one contract: the data
preparation script (``scripts/prepare_data.py``) writes prompts with :func:`math_prompt` /
:func:`code_prompt`, and verl scores the responses with :func:`compute_score`, wired in by the
recipes through ``reward.custom_reward_function.path=<this file> ...name=compute_score``.

* ``tailsieve_math``: the final answer goes in ``\\boxed{...}`` followed at once by the ``<END>``
  terminator (the recipes' stop string). Reward 1 if the boxed answer equals the ground truth
  (verl's MATH normalisation, then an exact rational comparison), else 0; a response with no
  ``\\boxed{}<END>`` ending scores 0.
* ``tailsieve_code``: bounded reasoning (reasoning, correctness, edge cases, complexity), then the
  solution in one fenced block. Reward = 1 if the tests pass, as judged outside the candidate's
  process (:func:`judge_job`: the tests run only in the judge; the candidate's process defines the
  code and answers the calls of the names the tests use), else 0; a response with zero or several
  code blocks scores 0, and the exit status never counts. The candidate runs in a sandbox
  (:mod:`tailsieve_verl.code_sandbox`: a fresh user id, no network, no host files, a private
  ``/tmp``, bounded processes, CPU, memory and wall-clock limits); where the node cannot isolate,
  the reward refuses with one line unless ``TAILSIEVE_UNISOLATED_CODE_REWARD=1``.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import sys
from fractions import Fraction
from typing import Any

from tailsieve_verl.code_sandbox import UNISOLATED_ENV, isolation_problem, run_judged

MATH_DATA_SOURCE = "tailsieve_math"
CODE_DATA_SOURCE = "tailsieve_code"
END_TOKEN = "<END>"

MATH_TEMPLATE = (
    "{question}\n\n"
    "Solve the problem step by step. End your response with the final answer in the form "
    "\\boxed{{ANSWER}} followed immediately by {end}, and write nothing after {end}."
)

CODE_TEMPLATE = (
    "{question}\n\n"
    "Answer in this order, keeping each part brief:\n"
    "1. Reasoning: how you will solve the problem.\n"
    "2. Correctness: why the approach is correct.\n"
    "3. Edge cases: the edge cases and how they are handled.\n"
    "4. Complexity: time and space complexity.\n"
    "Then give exactly one complete Python function named `{entry_point}` in a single "
    "```python code block, with any imports inside the block. Do not write any other code block."
)

# Tests for generated code: wall-clock seconds, CPU seconds and address space (bytes) per response.
CODE_TIMEOUT_S = 10.0
CODE_CPU_LIMIT_S = 8
CODE_MEMORY_LIMIT_BYTES = 1 << 30

_BOXED_END = re.compile(r"\\boxed\s*\{")
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def math_prompt(question: str) -> str:
    return MATH_TEMPLATE.format(question=question.strip(), end=END_TOKEN)


def code_prompt(question: str, entry_point: str) -> str:
    return CODE_TEMPLATE.format(question=question.strip(), entry_point=entry_point)


# ---------------------------------------------------------------------------------------------
# math


def extract_boxed_answer(response: str) -> str | None:
    """The content of the last ``\\boxed{...}`` if it is followed at once by ``<END>`` (or by the
    end of the text, for engines that strip the stop string), else None."""
    text = response.rstrip()
    if text.endswith(END_TOKEN):
        text = text[: -len(END_TOKEN)].rstrip()
    starts = [m.end() for m in _BOXED_END.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip() if not text[i + 1 :].strip() else None
    return None


def _as_number(text: str) -> Fraction | None:
    cleaned = text.replace(",", "").replace("$", "").replace("\\!", "").strip().rstrip(".")
    frac = re.fullmatch(r"(-?)\\d?frac\{(-?\d+)\}\{(-?\d+)\}", cleaned)
    try:
        if frac:
            value = Fraction(int(frac.group(2)), int(frac.group(3)))
            return -value if frac.group(1) else value
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def math_answers_equal(answer: str, ground_truth: str) -> bool:
    from verl.utils.reward_score.math_reward import is_equiv

    if is_equiv(answer, ground_truth):
        return True
    a, b = _as_number(answer), _as_number(ground_truth)
    return a is not None and b is not None and a == b


def math_score(solution_str: str, ground_truth: str) -> float:
    answer = extract_boxed_answer(solution_str)
    return 1.0 if answer is not None and math_answers_equal(answer, str(ground_truth)) else 0.0


# ---------------------------------------------------------------------------------------------
# code


def extract_code(response: str) -> str | None:
    """The code of the response's only fenced block, else None. Anything may sit beside the entry
    point (helpers, constants, an example call): only the judge's tests decide."""
    blocks = _CODE_BLOCK.findall(response)
    return blocks[0] if len(blocks) == 1 else None


def parse_code_ground_truth(ground_truth: str | dict) -> tuple[str, list[str]]:
    """``{"entry_point": name, "tests": ["assert ...", ...]}`` (a dict or its JSON string)."""
    spec = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
    entry_point, tests = spec.get("entry_point"), spec.get("tests")
    if not isinstance(entry_point, str) or not isinstance(tests, list) or not tests:
        raise ValueError("code ground truth needs 'entry_point' (str) and a non-empty 'tests' list")
    return entry_point, [str(t) for t in tests]


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name the tests bind anywhere (assigned, defined, imported, a parameter, a loop variable)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def judge_job(code: str, entry_point: str, tests: list[str]) -> dict:
    """What the judge (:mod:`tailsieve_verl.sandbox_init`) needs: the candidate's ``code``, which is
    all its process gets, and the ``tests``, which run only in the judge: ``remote`` (the names the
    tests use but never bind, the entry point among them: calls into the candidate) and ``modules``
    (standard modules the tests use without importing them). ValueError (one line) for tests that do
    not parse, never use the entry point or bind it themselves."""
    trees = []
    for test in tests:
        try:
            trees.append(ast.parse(test))
        except SyntaxError as error:
            raise ValueError(f"code ground truth: test {test[:80]!r} does not parse ({error.msg})") from None
    loaded = {node.id for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Name)
              and isinstance(node.ctx, ast.Load)}
    bound = set().union(*map(_bound_names, trees))
    if entry_point not in loaded:
        raise ValueError(f"code ground truth: no test uses the entry point {entry_point!r}")
    if entry_point in bound:  # the tests would call their own, and every candidate would pass
        raise ValueError(f"code ground truth: the tests bind the entry point {entry_point!r} themselves")
    free = loaded - bound - set(dir(builtins))
    modules = sorted(name for name in free if name in sys.stdlib_module_names and name != entry_point)
    return {"code": code, "tests": tests, "remote": sorted(free - set(modules)), "modules": modules}


def code_verdict(code: str, entry_point: str, tests: list[str], timeout_s: float | None = None) -> tuple[bool, str]:
    """(passed, the judge's line) for ``code``'s ``entry_point`` against ``tests``, judged outside the
    candidate's process (:func:`judge_job`); in the sandbox, or on a node that cannot isolate,
    refuses with one line unless the user opted into the unisolated runner."""
    job = judge_job(code, entry_point, tests)
    problem = isolation_problem()
    if problem is not None and os.environ.get(UNISOLATED_ENV) != "1":
        raise RuntimeError(problem)
    return run_judged(job, CODE_TIMEOUT_S if timeout_s is None else timeout_s, CODE_CPU_LIMIT_S,
                      CODE_MEMORY_LIMIT_BYTES, isolated=problem is None)


def run_function_tests(code: str, entry_point: str, tests: list[str], timeout_s: float | None = None) -> bool:
    return code_verdict(code, entry_point, tests, timeout_s)[0]


def code_score(solution_str: str, ground_truth: str | dict) -> float:
    entry_point, tests = parse_code_ground_truth(ground_truth)
    code = extract_code(solution_str)
    if code is None:
        return 0.0
    return 1.0 if run_function_tests(code, entry_point, tests) else 0.0


# ---------------------------------------------------------------------------------------------
# verl entry point


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **kwargs: Any) -> float:
    """verl ``custom_reward_function`` entry point (NaiveRewardManager calling convention)."""
    if data_source == MATH_DATA_SOURCE:
        return math_score(solution_str, ground_truth)
    if data_source == CODE_DATA_SOURCE:
        return code_score(solution_str, ground_truth)
    raise ValueError(f"tailsieve_verl.rewards: unknown data_source {data_source!r}; expected "
                     f"{MATH_DATA_SOURCE!r} or {CODE_DATA_SOURCE!r} (prepare data with scripts/prepare_data.py)")
