"""Prompt templates and rule-based rewards for the two TailSieve recipe workloads.

The templates and the reward parsers live together because they are one contract: the data
preparation script (``scripts/prepare_data.py``) writes prompts with :func:`math_prompt` /
:func:`code_prompt`, and verl scores the responses with :func:`compute_score`, wired in by the
recipes through ``reward.custom_reward_function.path=<this file> ...name=compute_score``.

* ``tailsieve_math``: the final answer goes in ``\\boxed{...}`` followed at once by the ``<END>``
  terminator (the recipes' stop string). Reward 1 if the boxed answer equals the ground truth
  (verl's MATH normalisation, then an exact rational comparison), else 0; a response with no
  ``\\boxed{}<END>`` ending scores 0.
* ``tailsieve_code``: bounded reasoning (reasoning, correctness, edge cases, complexity), then
  exactly one complete Python function in one fenced block. Reward = 1 if the function passes
  every test (``assert`` lines), as judged outside the candidate's process (:func:`judge_job`: the
  candidate only computes each call of its function; the judge compares), else 0; a response with
  zero or several code blocks or functions scores 0, and the exit status never counts. The
  candidate runs in a sandbox (:mod:`tailsieve_verl.code_sandbox`: no network, no host files, a
  private ``/tmp``, bounded processes, CPU, memory and wall-clock limits); where the node cannot
  isolate, the reward refuses with one line unless ``TAILSIEVE_UNISOLATED_CODE_REWARD=1``.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
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


def extract_single_function(response: str) -> str | None:
    """The code of the response's only fenced block if that block parses and defines exactly one
    top-level function (imports allowed), else None."""
    blocks = _CODE_BLOCK.findall(response)
    if len(blocks) != 1:
        return None
    code = blocks[0]
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    functions = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    others = [node for node in tree.body
              if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Import, ast.ImportFrom))
              and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    if len(functions) != 1 or others:
        return None
    return code


def parse_code_ground_truth(ground_truth: str | dict) -> tuple[str, list[str]]:
    """``{"entry_point": name, "tests": ["assert ...", ...]}`` (a dict or its JSON string)."""
    spec = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
    entry_point, tests = spec.get("entry_point"), spec.get("tests")
    if not isinstance(entry_point, str) or not isinstance(tests, list) or not tests:
        raise ValueError("code ground truth needs 'entry_point' (str) and a non-empty 'tests' list")
    return entry_point, [str(t) for t in tests]


CALL_VALUE = "_tailsieve_call_{}"  # the judge binds call k's value to this name
# nodes that bind names: a call to the entry point below one depends on them, so it cannot be sent alone
_BINDING_NODES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.NamedExpr)


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


class _CallsToValues(ast.NodeTransformer):
    """Replaces each outermost call of the entry point by the name of its value, collecting the calls."""

    def __init__(self, entry_point: str, calls: list[str]):
        self.entry_point, self.calls = entry_point, calls

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if isinstance(node.func, ast.Name) and node.func.id == self.entry_point:
            self.calls.append(ast.unparse(node))
            return ast.Name(CALL_VALUE.format(len(self.calls) - 1), ast.Load())
        return self.generic_visit(node)

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, _BINDING_NODES) and _mentions(node, self.entry_point):
            raise ValueError(f"calls {self.entry_point} inside a lambda, comprehension or := "
                             f"({ast.unparse(node)[:80]})")
        return super().generic_visit(node)


class _Renamed(ast.NodeTransformer):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(self.new, node.ctx) if node.id == self.old else node


def _inline_check_functions(statements: list[ast.stmt], entry_point: str) -> list[ast.stmt]:
    """HumanEval's ``def check(candidate): <asserts>`` then ``check(<entry point>)``: the check's
    statements in place of the call, with ``candidate`` renamed to the entry point."""
    defs = {node.name: node for node in statements
            if isinstance(node, ast.FunctionDef) and len(node.args.args) == 1}
    inlined = [node.value.func.id for node in statements
               if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
               and isinstance(node.value.func, ast.Name) and node.value.func.id in defs and not node.value.keywords
               and [ast.unparse(a) for a in node.value.args] == [entry_point]]
    out: list[ast.stmt] = []
    for node in statements:
        if isinstance(node, ast.FunctionDef) and node.name in inlined:
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
                and node.value.func.id in inlined:
            check = defs[node.value.func.id]
            out += [_Renamed(check.args.args[0].arg, entry_point).visit(statement) for statement in check.body]
        else:
            out.append(node)
    return out


def judge_job(code: str, entry_point: str, tests: list[str]) -> dict:
    """Split the tests between the candidate and its judge (:mod:`tailsieve_verl.sandbox_init`): each
    outermost call of ``entry_point`` in an ``assert`` runs in the candidate's process (``calls``),
    the rest of the assert (the expected side, the comparison) only in the judge (``checks``).
    Other statements (imports, setup data) run in both (``setup``); ``modules``: names the checks
    use that nothing defines, imported by the judge. ValueError (one line) for a test the judge
    cannot split so that its verdict stays out of the candidate's reach."""
    statements: list[ast.stmt] = []
    for test in tests:
        try:
            statements += ast.parse(test).body
        except SyntaxError as error:
            raise ValueError(f"code ground truth: test {test[:80]!r} does not parse ({error.msg})") from None
    setup, calls, checks = [], [], []
    for node in _inline_check_functions(statements, entry_point):
        try:
            if isinstance(node, ast.Assert):
                checks.append(ast.unparse(_CallsToValues(entry_point, calls).visit(node.test)))
                if _mentions(ast.parse(checks[-1]), entry_point):
                    raise ValueError(f"uses {entry_point} other than by calling it")
            elif _mentions(node, entry_point):
                raise ValueError(f"only assert statements may use {entry_point}")
            else:
                setup.append(ast.unparse(node))
        except ValueError as error:
            raise ValueError(f"code ground truth: test {ast.unparse(node)[:80]!r} cannot be judged "
                             f"outside the candidate: {error}") from None
    if not calls:
        raise ValueError(f"code ground truth: no assert calls the entry point {entry_point!r}")
    defined = {name for line in setup for node in ast.walk(ast.parse(line))
               for name in ([node.id] if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
                            else [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                            else [(a.asname or a.name).split(".")[0] for a in node.names]
                            if isinstance(node, (ast.Import, ast.ImportFrom)) else [])}
    used = {node.id for check in checks for node in ast.walk(ast.parse(check))
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    bound = {node.arg if isinstance(node, ast.arg) else node.id for check in checks for node in ast.walk(ast.parse(check))
             if isinstance(node, ast.arg) or (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store))}
    modules = sorted(name for name in used - defined - bound
                     if not hasattr(builtins, name) and not name.startswith("_tailsieve_call_"))
    return {"code": code, "setup": setup, "calls": calls, "checks": checks, "modules": modules}


def run_function_tests(code: str, entry_point: str, tests: list[str], timeout_s: float | None = None) -> bool:
    """True if ``code``'s ``entry_point`` passes every test, as judged outside the candidate's
    process (:func:`judge_job`); in the sandbox, or on a node that cannot isolate, refuses with one
    line unless the user opted into the unisolated runner."""
    job = judge_job(code, entry_point, tests)
    problem = isolation_problem()
    if problem is not None and os.environ.get(UNISOLATED_ENV) != "1":
        raise RuntimeError(problem)
    return run_judged(job, CODE_TIMEOUT_S if timeout_s is None else timeout_s, CODE_CPU_LIMIT_S,
                      CODE_MEMORY_LIMIT_BYTES, isolated=problem is None)[0]


def code_score(solution_str: str, ground_truth: str | dict) -> float:
    entry_point, tests = parse_code_ground_truth(ground_truth)
    code = extract_single_function(solution_str)
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
