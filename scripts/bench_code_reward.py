"""Code reward: time per candidate in the sandbox next to the unisolated runner (issue 35).

Scores the same passing candidate (a small function and five asserts) alternately with each runner,
so both see the same machine load, and prints per candidate the median and mean wall time and the
CPU time of all its processes (less sensitive to a busy machine), and the ratios. Prints
measurements (no pass/fail: machines are noisy). Needs a node where the sandbox runs (root,
util-linux ``unshare``). Run from the repo root:
    .venv/bin/python scripts/bench_code_reward.py [--candidates 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tailsieve_verl import rewards  # noqa: E402
from tailsieve_verl.code_sandbox import isolation_problem, run_isolated  # noqa: E402

PROGRAM = """\
def running_max(xs):
    out, best = [], None
    for x in xs:
        best = x if best is None or x > best else best
        out.append(best)
    return out

assert callable(running_max)
assert running_max([]) == []
assert running_max([1]) == [1]
assert running_max([3, 1, 4, 1, 5]) == [3, 3, 4, 4, 5]
assert running_max([-2, -5, -1]) == [-2, -2, -1]
assert running_max(list(range(1000)))[-1] == 999
"""


def isolated() -> bool:
    return run_isolated(PROGRAM, rewards.CODE_TIMEOUT_S, rewards.CODE_CPU_LIMIT_S,
                        rewards.CODE_MEMORY_LIMIT_BYTES).returncode == 0


def unisolated() -> bool:
    return rewards.run_unisolated(PROGRAM)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--candidates", type=int, default=20, help="candidates scored by each runner")
    args = p.parse_args()
    start = time.perf_counter()
    problem = isolation_problem()
    if problem is not None:
        sys.exit(problem)
    print(f"isolation check (once per process): {1e3 * (time.perf_counter() - start):.0f} ms")
    wall: dict[str, list[float]] = {"unisolated": [], "isolated": []}
    cpu = dict.fromkeys(wall, 0.0)
    for _ in range(args.candidates):
        for name, runner in (("unisolated", unisolated), ("isolated", isolated)):
            start, start_cpu = time.perf_counter(), children_cpu_s()
            assert runner(), f"the {name} runner failed a passing candidate"
            wall[name].append(time.perf_counter() - start)
            cpu[name] += children_cpu_s() - start_cpu
    median, mean = ({name: f(values) for name, values in wall.items()} for f in (statistics.median, statistics.mean))
    for name in wall:
        print(f"{name:>10}: wall median {1e3 * median[name]:6.1f} ms, mean {1e3 * mean[name]:6.1f} ms; "
              f"CPU {1e3 * cpu[name] / args.candidates:5.1f} ms per candidate ({args.candidates} candidates)")
    print(f"isolated / unisolated: wall {median['isolated'] / median['unisolated']:.2f}x (median), "
          f"{mean['isolated'] / mean['unisolated']:.2f}x (mean); CPU {cpu['isolated'] / cpu['unisolated']:.2f}x")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
