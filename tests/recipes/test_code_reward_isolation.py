"""The code reward runs model-written code isolated: hostile candidates score 0 and leave the machine
as it was (files, the home folder, loopback listeners, processes, the trainer itself); legitimate
candidates still pass; a node that cannot isolate refuses at launch and in the reward, with one
line, unless the user opts into the unisolated runner."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tailsieve_verl import code_sandbox, rewards

ROOT = Path(__file__).resolve().parents[2]
PREAMBLE = "Reasoning: add.\nCorrectness: trivial.\nEdge cases: negatives.\nComplexity: O(1).\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]

def candidate(*body: str, imports: str = "import os") -> str:
    """A response whose only function is a correct ``add`` that first runs ``body``: it scores 1
    exactly when every hostile step in ``body`` succeeds."""
    lines = "\n".join(f"    {line}" for line in body)
    return PREAMBLE + f"```python\n{imports}\n\ndef add(a, b):\n{lines}\n    return a + b\n```"


def score(response: str) -> float:
    return rewards.compute_score(rewards.CODE_DATA_SOURCE, response,
                                 json.dumps({"entry_point": "add", "tests": TESTS}))


def sandbox_processes(uids: set[int]) -> list[int]:
    """Host PIDs of live processes (not zombies) running as one of ``uids`` (a candidate or anything
    it started). Where the host's backstop killed them (its judge was killed), they die within a
    moment of the verdict: give them one second."""
    deadline = time.monotonic() + 1.0
    while True:
        found = []
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            except OSError:
                continue
            if int(fields.get("Uid", "-1 ").split()[0]) in uids and not fields.get("State", "").strip().startswith("Z"):
                found.append(int(status.parent.name))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def no_process_left_behind(monkeypatch):
    """No process of the fresh user ids this test's candidates got survives it (other test files,
    run beside this one, score candidates of their own meanwhile)."""
    used: list[int] = []
    draw = code_sandbox.fresh_uid
    monkeypatch.setattr(code_sandbox, "fresh_uid", lambda: used.append(draw()) or used[-1])
    yield
    assert sandbox_processes(set(used)) == []


# ---------------------------------------------------------------------------------------------
# legitimate candidates


def test_legitimate_candidates_still_pass():
    assert score(candidate("pass")) == 1.0
    uses_stdlib_threads_and_its_folder = candidate(
        "import collections, functools, heapq, itertools, json, math, random, re, tempfile, threading",
        "t = threading.Thread(target=lambda: None); t.start(); t.join()",
        "with tempfile.NamedTemporaryFile('w') as f: f.write(json.dumps([math.pi, random.random()]))",
        "open('scratch.txt', 'w').write('mine')",
        "assert open('scratch.txt').read() == 'mine'")
    assert score(uses_stdlib_threads_and_its_folder) == 1.0
    assert score(candidate("return a - b")) == 0.0


def test_candidate_folder_leaves_nothing_on_the_host():
    marker = f"tailsieve_marker_{os.getpid()}_{time.time_ns()}"
    assert score(candidate(f"open('/tmp/{marker}', 'w').write('x')", f"open('{marker}', 'w').write('x')")) == 1.0
    host_tmp = Path(tempfile.gettempdir())
    assert not list(host_tmp.glob(f"{marker}")) and not list(host_tmp.glob(f"*/{marker}"))


# ---------------------------------------------------------------------------------------------
# hostile candidates: each scores 0 and the machine is as it was


def test_writing_outside_its_folder_scores_zero_and_writes_nothing(tmp_path):
    target = tmp_path / "written_by_candidate"
    assert score(candidate(f"open({str(target)!r}, 'w').write('pwned')")) == 0.0
    assert score(candidate("open('/usr/written_by_candidate', 'w').write('pwned')")) == 0.0
    assert not target.exists() and not Path("/usr/written_by_candidate").exists()


def test_filling_its_folder_stops_at_its_size():
    fill = f"open('/tmp/big', 'wb').write(bytes({2 * code_sandbox.SANDBOX_WORK_BYTES}))"
    assert score(candidate(fill)) == 0.0


def test_deleting_outside_its_folder_scores_zero_and_deletes_nothing(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "data").write_text("keep me too")
    assert score(candidate(f"os.remove({str(victim)!r})")) == 0.0
    assert score(candidate(f"shutil.rmtree({str(tree)!r})", imports="import shutil")) == 0.0
    assert victim.read_text() == "keep me" and (tree / "sub" / "data").read_text() == "keep me too"


def test_reading_the_home_folder_or_the_checkout_scores_zero():
    with tempfile.NamedTemporaryFile("w", dir=Path.home(), prefix=".tailsieve_secret_") as secret:
        secret.write("token")
        secret.flush()
        assert score(candidate(f"assert open({secret.name!r}).read() == 'token'")) == 0.0
        listed = f"assert {os.path.basename(secret.name)!r} in os.listdir({str(Path.home())!r})"
        assert score(candidate(listed)) == 0.0
    assert score(candidate(f"open({str(ROOT / 'setup.py')!r}).read()")) == 0.0


def test_connecting_to_a_loopback_listener_scores_zero_and_connects_nothing():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert score(candidate(f"socket.create_connection(('127.0.0.1', {port}), timeout=2).close()",
                               imports="import socket")) == 0.0
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


def forking(children: int | bool) -> str:
    """A candidate that starts ``children`` sleeping children (``True``: until refused)."""
    loop = "while True:" if children is True else f"for _ in range({children}):"
    return candidate(loop, "    if os.fork() == 0:", "        time.sleep(60)", "        os._exit(0)",
                     imports="import os, time")


@pytest.mark.parametrize("cgroup", ["the node's", "none"])
def test_forking_is_bounded_and_cleaned_up(runner, cgroup, monkeypatch):
    if cgroup == "none":  # then RLIMIT_NPROC alone bounds it: the candidate's user id is its own
        monkeypatch.setattr(code_sandbox, "cgroup_parents", lambda: (None, "none for this test"))
    if runner == "unisolated" and os.geteuid() != 0 and code_sandbox.cgroup_parents()[0] is None:
        pytest.skip("unisolated as an ordinary user, only a cgroup bounds the candidate's processes: "
                    f"{code_sandbox.cgroup_parents()[1]}")
    assert score(forking(8)) == 1.0  # a few processes are fine (and killed when the candidate ends)
    assert score(forking(code_sandbox.SANDBOX_PROCESSES)) == 0.0
    assert score(forking(True)) == 0.0
    classic_bomb = candidate("while True:", "    os.fork()")
    assert score(classic_bomb) == 0.0


def processes_named(name: str) -> list[int]:
    return [int(comm.parent.name) for comm in Path("/proc").glob("[0-9]*/comm")
            if comm.exists() and comm.read_text().strip() == name]


def test_sleeping_past_the_limit_is_killed_with_its_whole_tree(runner):
    name = f"ts{time.time_ns() % 10**12}"  # the sleepers rename themselves (comm) so the test can find them
    sleeper = candidate(
        f"ctypes.CDLL(None).prctl(15, {name.encode()!r})",
        "if os.fork() == 0:",
        "    os.setsid()",
        "    time.sleep(600)",
        "time.sleep(600)", imports="import ctypes, os, time")
    start = time.monotonic()
    assert rewards.run_function_tests(rewards.extract_code(sleeper), "add", TESTS, timeout_s=1.0) is False
    assert time.monotonic() - start < 1.0 + code_sandbox.HOST_GRACE_S
    assert processes_named(name) == []


def test_allocating_past_the_memory_limit_scores_zero(runner):
    assert score(candidate(f"x = bytearray({2 * rewards.CODE_MEMORY_LIMIT_BYTES})")) == 0.0


def test_memory_is_bounded_over_the_whole_tree(runner, monkeypatch):
    """Two children holding 0.6 GiB each at once: each is within the per-process bound, the tree is not."""
    if code_sandbox.cgroup_parents()[0] is None:
        pytest.skip(f"no cgroup: memory is bounded per process only ({code_sandbox.cgroup_parents()[1]})")
    share = int(0.6 * rewards.CODE_MEMORY_LIMIT_BYTES)
    monkeypatch.setattr(rewards, "CODE_TIMEOUT_S", 60.0)  # writing 1.2 GiB on a busy machine
    together = candidate("children = []", "for _ in range(2):", "    pid = os.fork()", "    if pid == 0:",
                         f"        x = b'x' * {share}", "        time.sleep(1.5)", "        os._exit(0)",
                         "    children.append(pid)",
                         "if any(os.waitpid(pid, 0)[1] != 0 for pid in children):", "    return a - b",
                         imports="import os, time")
    one_at_a_time = together.replace("time.sleep(1.5)", "pass").replace("    children.append(pid)",
                                                                         "    os.waitpid(pid, 0)")
    one_test = json.dumps({"entry_point": "add", "tests": TESTS[:1]})  # 1.2 GiB to write: keep to one call
    assert rewards.compute_score(rewards.CODE_DATA_SOURCE, together, one_test) == 0.0
    assert rewards.compute_score(rewards.CODE_DATA_SOURCE, one_at_a_time, one_test) == 1.0


def test_signalling_its_parent_or_the_trainer_scores_zero_and_reaches_neither():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        assert score(candidate("os.kill(os.getppid(), signal.SIGUSR1)", imports="import os, signal")) == 0.0
        assert score(candidate(f"os.kill({os.getpid()}, signal.SIGUSR1)", imports="import os, signal")) == 0.0
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == []


def test_reaching_the_trainers_session_keyring_scores_zero():
    from tailsieve_verl.sandbox_init import SYS_KEYCTL

    keyctl = SYS_KEYCTL[os.uname().machine]
    session = ctypes.CDLL(None).syscall(keyctl, 0, -3, 0)  # KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING
    assert session > 0
    assert score(candidate(f"assert ctypes.CDLL(None).syscall({keyctl}, 0, -3, 0) == {session}",
                           imports="import ctypes")) == 0.0


# ---------------------------------------------------------------------------------------------
# reward hacks: each is a wrong ``add`` (it subtracts) plus a way to score anyway; each scores 0 in
# both runners, while legitimate solutions still score 1. scripts/bench_code_reward.py --hacks
# scores this table on any commit (the "before" column of issue 46).


def wrong_add(*body: str, imports: str = "import os, sys", signature: str = "def add(a, b):") -> str:
    lines = "\n".join(f"    {line}" for line in body)
    return PREAMBLE + f"```python\n{imports}\n\n{signature}\n{lines}\n    return a - b\n```"


READ_THE_TESTS = (  # find "add(<a>, <b>) == <expected>" in any file, argv or environment it can reach
    "import glob, re",
    "text = ''",
    "for path in [sys.argv[0], __file__ if '__file__' in globals() else '', '/proc/self/cmdline',",
    "             '/proc/self/environ', f'/proc/{os.getppid()}/cmdline', *glob.glob('*'), *glob.glob('/tmp/*'),",
    "             *glob.glob('/tmp/*/*')]:",
    "    try:",
    "        text += open(path, errors='replace').read()",
    "    except Exception:",
    "        pass",
    "found = re.search(r'add\\(%r, %r\\) == (-?\\d+)' % (a, b), text)",
    "if found:",
    "    return int(found.group(1))")
READ_THE_PARENTS_MEMORY = (  # the same search in the parent's memory (the judge, or the trainer)
    "import re",
    "pid, pattern = os.getppid(), re.compile(rb'add\\(%d, %d\\) == (-?\\d+)' % (a, b))",
    "try:",
    "    with open(f'/proc/{pid}/maps') as maps, open(f'/proc/{pid}/mem', 'rb') as mem:",
    "        for line in maps:",
    "            start, end = (int(x, 16) for x in line.split()[0].split('-'))",
    "            if line.split()[1].startswith('rw') and end - start < 1 << 26:",
    "                try:",
    "                    mem.seek(start)",
    "                    found = pattern.search(mem.read(end - start))",
    "                except OSError:",
    "                    continue",
    "                if found:",
    "                    return int(found.group(1))",
    "except OSError:",
    "    pass")
HACKS = {
    "sys.exit(0)": wrong_add("sys.exit(0)"),
    "os._exit(0)": wrong_add("os._exit(0)"),
    "raise SystemExit": wrong_add("raise SystemExit"),
    "quit()": wrong_add("quit()"),
    "exit()": wrong_add("exit()"),
    "atexit handler exits 0": wrong_add("atexit.register(os._exit, 0)", imports="import atexit, os"),
    "SIGKILL to itself": wrong_add("os.kill(os.getpid(), signal.SIGKILL)", imports="import os, signal"),
    "SIGTERM to itself, handler exits 0": wrong_add(
        "signal.signal(signal.SIGTERM, lambda *_: os._exit(0))", "os.kill(os.getpid(), signal.SIGTERM)",
        imports="import os, signal"),
    "SIGKILL to its parent": wrong_add("os.kill(os.getppid(), signal.SIGKILL)", imports="import os, signal"),
    "default argument exits at definition": wrong_add(signature="def add(a, b, _=__import__('os')._exit(0)):"),
    "decorator exits at definition": wrong_add(signature="@(lambda f: __import__('os')._exit(0))\ndef add(a, b):"),
    "object equal to anything": wrong_add("class Equal:", "    __eq__ = lambda self, other: True",
                                          "    __hash__ = object.__hash__", "return Equal()"),
    "int subclass equal to anything": wrong_add("class Equal(int):", "    __eq__ = lambda self, other: True",
                                                "    __hash__ = int.__hash__", "return Equal(7)"),
    "swallow the AssertionError (excepthook exits 0)": wrong_add("sys.excepthook = lambda *_: os._exit(0)"),
    "patch builtins (eval returns an Equal)": wrong_add(
        "import builtins", "class Equal:", "    __eq__ = lambda self, other: True",
        "builtins.eval = lambda *args, **kwargs: Equal()"),
    "patch the harness (json.dumps forges every value)": wrong_add(
        "import json", "json.dumps = lambda *args, **kwargs: '[' + ','.join(['{\"value\": true}'] * 2) + ']'"),
    "pre-empt the reply channel (fd 3)": wrong_add("os.write(3, b'[{\"value\": 3}, {\"value\": 3}]\\n')"),
    "print the success marker and exit 0": wrong_add("print('PASS', flush=True)", "sys.stderr.write('PASS\\n')",
                                                    "os._exit(0)"),
    "read the tests from disk, argv or /proc/self": wrong_add(*READ_THE_TESTS),
    "read the expected answers from the parent's memory": wrong_add(*READ_THE_PARENTS_MEMORY),
    "fork a child that exits 0 for it": wrong_add("if os.fork():", "    os._exit(0)"),
    "sleep until the timeout": wrong_add("time.sleep(600)", imports="import os, time"),
    "call the reference function the tests define": wrong_add(
        "if 'reference' in globals():", "    return globals()['reference'](a, b)"),
    "read the expected values the tests assign": wrong_add(
        "if 'expected' in globals():", "    return globals()['expected'][a, b]"),
    "open the judge script for writing (root's file powers)": wrong_add(
        f"open({code_sandbox.INIT_SCRIPT!r}, 'ab').close()", "return a + b"),
    "plant a module beside the standard library": wrong_add(
        "import tempfile", "fd, path = tempfile.mkstemp(suffix='.py', dir=os.path.dirname(os.__file__))",
        "os.close(fd)", "os.remove(path)", "return a + b"),
    "reply with 16 MB of nested empty lists": wrong_add(
        "body = b'{\"value\":[' + b','.join([b'[]'] * (5 << 20)) + b']}'",
        "os.write(4, len(body).to_bytes(8, 'big') + body)", "time.sleep(60)", imports="import os, time"),
    "reply with a set of colliding hashes": wrong_add(
        "body = ('{\"value\":{\"set\":[' + ','.join(str(k * (2 ** 61 - 1)) for k in range(200000)) + ']}}').encode()",
        "os.write(4, len(body).to_bytes(8, 'big') + body)", "time.sleep(60)", imports="import os, time"),
    "a response nested too deeply to parse": PREAMBLE + "```python\ndef add(a, b):\n    return a - b\nx = "
    + "1+" * 100000 + "1\n```",
}
# The tests each hack above is scored against, where not TESTS: a reference function the tests
# define, and a HumanEval check that assigns its expected values (5d35b14's judge ran both in the
# candidate's namespace).
HACK_TESTS = {
    "call the reference function the tests define": [
        "def reference(a, b):\n    return a + b", "assert add(1, 2) == reference(1, 2)",
        "assert add(-1, 1) == reference(-1, 1)"],
    "read the expected values the tests assign": [
        "def check(candidate):\n    expected = {(1, 2): 3, (-1, 1): 0}\n    assert candidate(1, 2) == expected[1, 2]\n"
        "    assert candidate(-1, 1) == expected[-1, 1]", "check(add)"],
}

LEGITIMATE = {
    "prints": ("def add(a, b):\n    print('adding', a, b)\n    return a + b", "add", TESTS),
    "recurses 5000 deep": (
        "import sys\n\ndef add(a, b, depth=5000):\n    sys.setrecursionlimit(20000)\n"
        "    return a + b if depth == 0 else add(a, b, depth - 1)", "add", TESTS),
    "standard library": (
        "import collections, heapq, itertools, math, re\n\ndef top(words, k):\n"
        "    counts = collections.Counter(w for w in re.findall(r'[a-z]+', words.lower()))\n"
        "    best = heapq.nlargest(k, counts.items(), key=lambda kv: (kv[1], kv[0]))\n"
        "    pairs = list(itertools.islice(best, k))\n"
        "    return {'pairs': pairs, 'keys': {w for w, _ in pairs}, 'root': math.sqrt(len(pairs)),\n"
        "            'tuple': tuple(counts.most_common(1)[0]), 'raw': b'ok', 'none': None}",
        "top", ["assert top('b a b c b a', 2) == {'pairs': [('b', 3), ('a', 2)], 'keys': {'a', 'b'}, "
                "'root': math.sqrt(2), 'tuple': ('b', 3), 'raw': b'ok', 'none': None}",
                "assert math.isclose(top('x', 1)['root'], 1.0)",
                "assert set(top('a b', 2)['keys']) == set(['a', 'b']) and len(top('a', 1)['pairs']) == 1"]),
    "HumanEval check(candidate)": (
        "def add(a, b):\n    return a + b", "add",
        ["def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n", "check(add)"]),
    "a helper and a constant beside the entry point": (
        "OFFSET = 0\n\ndef plus(a, b):\n    return a + b + OFFSET\n\ndef add(a, b):\n    return plus(a, b)", "add", TESTS),
    "an example call after the function": ("def add(a, b):\n    return a + b\n\nprint(add(1, 2))", "add", TESTS),
    "tests that call it in a for loop": (
        "def add(a, b):\n    return a + b", "add", ["for a in range(5):\n    assert add(a, 1) == a + 1"]),
    "sorts its argument in place": (
        "def sort_in_place(xs):\n    xs.sort()", "sort_in_place",
        ["xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]"]),
    "unseeded randomness in the tests' setup": (
        "def biggest(xs):\n    return max(xs)", "biggest",
        ["import random\nxs = [random.random() for _ in range(5)]\nassert biggest(xs) == max(xs)"]),
    "a generator read with list()": ("def upto(n):\n    yield from range(n)", "upto", ["assert list(upto(3)) == [0, 1, 2]"]),
    "deque, dict views, Fraction": (
        "import collections, fractions\n\ndef kinds(n):\n"
        "    return collections.deque(range(n)), {i: -i for i in range(n)}.values(), fractions.Fraction(1, n)",
        "kinds", ["import collections, fractions\nq, values, f = kinds(3)\n"
                  "assert q == collections.deque([0, 1, 2]) and list(values) == [0, -1, -2] and f == fractions.Fraction(1, 3)"]),
    "a returned closure the test calls": (
        "def adder(n):\n    return lambda x: x + n", "adder", ["assert adder(3)(4) == 7"]),
    "an int over 4,300 digits": ("def power(n):\n    return 10 ** n", "power", ["assert power(5000) == 10 ** 5000"]),
    "HumanEval+ shape (numpy in the tests, a loop over inputs)": (
        "def add(a, b):\n    return a + b", "add",
        ["import numpy as np\n\ndef assertion(out, exp, atol):\n"
         "    assert out == exp or (atol != 0 and np.allclose(out, exp, rtol=1e-07, atol=atol))\n\n"
         "def check(candidate):\n    inputs, results = [[1, 2], [0.1, 0.2]], [3, 0.3]\n"
         "    for inp, exp in zip(inputs, results):\n        assertion(candidate(*inp), exp, 1e-6)", "check(add)"]),
    "imports numpy": ("import numpy as np\n\ndef total(xs):\n    return np.sum(np.array(xs))", "total",
                      ["assert total([1, 2, 3]) == 6"]),
}


@pytest.fixture(params=["isolated", "unisolated"])
def runner(request, monkeypatch):
    """Score through the isolated runner, or through the opt-in unisolated one on this same node."""
    if request.param == "unisolated":
        monkeypatch.setattr(rewards, "isolation_problem", lambda: "forced unisolated")
        monkeypatch.setenv(code_sandbox.UNISOLATED_ENV, "1")
    return request.param


@pytest.mark.parametrize("hack", list(HACKS))
def test_reward_hack_scores_zero(hack, runner, monkeypatch):
    if hack == "sleep until the timeout":
        monkeypatch.setattr(rewards, "CODE_TIMEOUT_S", 1.0)
    if hack == "reply with a set of colliding hashes":  # the judge's own CPU bound stops it, even under load
        monkeypatch.setattr(rewards, "CODE_CPU_LIMIT_S", 2)
        monkeypatch.setattr(rewards, "CODE_TIMEOUT_S", 120.0)
    truth = json.dumps({"entry_point": "add", "tests": HACK_TESTS.get(hack, TESTS)})
    assert rewards.compute_score(rewards.CODE_DATA_SOURCE, HACKS[hack], truth) == 0.0


@pytest.mark.parametrize("hack,why", [("reply with 16 MB of nested empty lists", "more than 1048576 items"),
                                      ("reply with a set of colliding hashes", "the judge ran out of CPU time")])
def test_a_costly_reply_stops_the_judge_within_its_bounds(hack, why, runner, monkeypatch):
    monkeypatch.setattr(rewards, "CODE_CPU_LIMIT_S", 2)  # the judge's CPU bound is the candidate's plus a second
    monkeypatch.setattr(rewards, "CODE_TIMEOUT_S", 120.0)  # so that bound, not the wall clock, stops it under load
    passed, line = rewards.code_verdict(rewards.extract_code(HACKS[hack]), "add", TESTS)
    assert not passed and why in line


def wrong_variant(code: str, entry_point: str) -> str:
    """``code`` with its entry point redefined last to return a wrong value."""
    return f"{code}\n\ndef {entry_point}(*args, **kwargs):\n    return None\n"


@pytest.mark.parametrize("name", list(LEGITIMATE))
def test_legitimate_solution_scores_one(name, runner):
    code, entry_point, tests = LEGITIMATE[name]
    truth = json.dumps({"entry_point": entry_point, "tests": tests})
    assert rewards.code_verdict(code, entry_point, tests) == (True, "PASS")
    assert rewards.compute_score(rewards.CODE_DATA_SOURCE, PREAMBLE + f"```python\n{code}\n```", truth) == 1.0
    wrong = PREAMBLE + f"```python\n{wrong_variant(code, entry_point)}\n```"
    assert rewards.compute_score(rewards.CODE_DATA_SOURCE, wrong, truth) == 0.0


def test_no_process_of_a_candidate_outlives_its_verdict(runner):
    """A child that leaves its session and its cgroup and kills the judge is killed all the same."""
    name = f"ts{time.time_ns() % 10**12}"
    escapes = [f"open({str(path)!r}, 'w').write(str(os.getpid()))" for path in
               sorted(Path("/sys/fs/cgroup").glob("*/cgroup.procs"))[:2]]
    leaver = wrong_add("judge = os.getppid()", "if os.fork() == 0:", "    os.setsid()", *[f"    try:\n        {line}\n    except OSError:\n"
                                                                "        pass" for line in escapes],
                       f"    ctypes.CDLL(None).prctl(15, {name.encode()!r})", "    os.kill(judge, 9)",
                       "    time.sleep(600)", "time.sleep(1)", imports="import ctypes, os, time")
    assert score(leaver) == 0.0
    time.sleep(0.5)
    assert processes_named(name) == []


# ---------------------------------------------------------------------------------------------
# a node that cannot isolate: refuse, or run unisolated only when the user says so


@pytest.fixture
def node_without_unshare(tmp_path, monkeypatch):
    """PATH with every command of /usr/bin except util-linux ``unshare``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in Path("/usr/bin").iterdir():
        if tool.name != "unshare":
            (bin_dir / tool.name).symlink_to(tool)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv(code_sandbox.UNISOLATED_ENV, raising=False)
    code_sandbox.isolation_problem.cache_clear()
    yield os.environ.copy()
    code_sandbox.isolation_problem.cache_clear()


def test_reward_refuses_without_isolation_unless_opted_in(node_without_unshare, monkeypatch):
    with pytest.raises(RuntimeError, match=r"isolation unavailable: util-linux `unshare` is not on PATH.*"
                                           + code_sandbox.UNISOLATED_ENV + "=1") as refused:
        score(candidate("pass"))
    assert "\n" not in str(refused.value)
    monkeypatch.setenv(code_sandbox.UNISOLATED_ENV, "1")
    assert score(candidate("pass")) == 1.0 and score(candidate("return a - b")) == 0.0


def check_isolation(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tailsieve_verl.code_sandbox", "--check-isolation"],
                          env=env, capture_output=True, text=True, timeout=60)


def test_check_isolation_passes_here_and_refuses_without_unshare(node_without_unshare):
    assert check_isolation(dict(os.environ, PATH="/usr/bin:/bin")).returncode == 0
    refused = check_isolation(node_without_unshare)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert "isolation unavailable" in refused.stderr and code_sandbox.UNISOLATED_ENV in refused.stderr
    opted_in = check_isolation(dict(node_without_unshare, **{code_sandbox.UNISOLATED_ENV: "1"}))
    assert opted_in.returncode == 0 and "UNISOLATED" in opted_in.stderr


def test_code_recipe_stops_at_launch_without_isolation(node_without_unshare):
    env = dict(node_without_unshare, PYTHON=sys.executable, WORKLOAD="code", TAILSIEVE_DRY_RUN="1")
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "qwen3-8b_verl.sh")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "isolation unavailable" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# ---------------------------------------------------------------------------------------------
# an ordinary user: isolated in an unprivileged user namespace, with the same guarantees

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
AS_NOBODY = """\
import json, os, sys
sys.path.insert(0, {root!r})
from tailsieve_verl import code_sandbox, rewards
responses, truth = json.load(sys.stdin)
scores = {{name: rewards.compute_score(rewards.CODE_DATA_SOURCE, response, truth) for name, response in responses.items()}}
print(json.dumps({{"uid": os.getuid(), "problem": code_sandbox.isolation_problem(), "scores": scores}}))
"""


def interpreter_for_nobody() -> str | None:
    """A base interpreter (3.10+) that uid 65534 can run: this one, else the system's."""
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        probe = subprocess.run([*NOBODY, python, "-I", "-S", "-c", "import os, sys; assert sys.version_info >= (3, 10) "
                                "and os.access(os.path.realpath(sys.executable), os.X_OK)"],
                               capture_output=True)
        if probe.returncode == 0:
            return python
    return None


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to become uid 65534")
def test_an_ordinary_user_runs_candidates_isolated_in_a_user_namespace():
    python = interpreter_for_nobody()
    if python is None:
        pytest.skip("no Python 3.10+ interpreter that uid 65534 can run")
    responses = {"correct": candidate("pass"), "wrong": candidate("return a - b"),
                 "reads the checkout": candidate(f"open({str(ROOT / 'setup.py')!r}).read()"),
                 "chroot escape": candidate("os.mkdir('/tmp/x')", "os.chroot('/tmp/x')"),
                 "fork bomb": candidate("while True:", "    os.fork()"),
                 "network": candidate("socket.create_connection(('127.0.0.1', 22), timeout=1)", imports="import socket"),
                 **{hack: HACKS[hack] for hack in ("sys.exit(0)", "os._exit(0)", "default argument exits at definition",
                                                   "object equal to anything", "read the tests from disk, argv or /proc/self",
                                                   "read the expected answers from the parent's memory",
                                                   "SIGKILL to its parent", "print the success marker and exit 0")}}
    refused = subprocess.run([*NOBODY, "unshare", *code_sandbox.USER_NAMESPACE, "true"], capture_output=True)
    done = subprocess.run([*NOBODY, python, "-I", "-S", "-c", AS_NOBODY.format(root=str(ROOT))],
                          input=json.dumps([responses, json.dumps({"entry_point": "add", "tests": TESTS})]),
                          capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
    if refused.returncode != 0:  # this kernel refuses user namespaces to ordinary users: the refusal names that
        assert done.returncode != 0 and "needs root or unprivileged user namespaces" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["uid"] == 65534 and result["problem"] is None
    assert result["scores"] == {name: float(name == "correct") for name in responses}
