"""The engine model's speed before and after issue 32, measured side by side in one run.

Each scenario runs twice, in a fresh process each: with the package as of ``--before`` (that commit's
``tailsieve_verl/``, unpacked with ``git archive`` into a temporary directory) and with this tree's.
Scenarios (the issue's "must show"): a DAPO-sized step, 512 prompts × 16 samples on R = 8 replicas of
Qwen3-8B dense (``table:h200-dense:qwen3-8b``) under verl 0.9.1's rollout defaults
(``EngineConfig.verl_defaults``), real tails at a 32k response cap:

* ``default``: ``simulate``'s default policies (the clairvoyant references search for at most
  ``--oracle-time-limit`` wall seconds a step, so their share depends on the machine's load);
* ``hindsight``: ``best-static`` and ``clairvoyant-split``;
* ``plan``: ``plan`` of one logged 512 × 16 step at its own batch size (refused before), ``--steps`` steps
  and ``--seeds`` seeds;
* ``plan-quick``: the same plan at 3 steps and 1 seed (``tailsieve plan --steps 3 --seeds 1``), whatever
  ``--steps`` and ``--seeds`` say.

CPU seconds (``time.process_time`` of the run and of its forked workers, the figure that survives a shared machine)
and wall seconds, one core each by default (``--jobs 1``; ``--jobs 2`` runs as ``simulate``/``plan``'s default
``--jobs`` on 2 cores, the plan goal's wall seconds), numba's load of its compiled walk from its on-disk cache included
(each side's cache is filled first, so neither pays the compile). ``--after COMMIT`` measures
that commit's package instead of this tree's (a tree with someone else's uncommitted work in it)::

    PYTHONPATH=. python scripts/bench_speed.py --steps 3 [--scenarios default,hindsight,plan,plan-quick] [--jobs 2] [--before 2b7a8b1] [--after COMMIT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE = "2b7a8b1"  # main before issue 32: the span-based scheduler

DRIVER = r"""
import json, resource, sys, time
try:  # the core by concept (issue 32), or the flat core before it
    from tailsieve_verl.core.simulation import sim
    from tailsieve_verl.core.engine.engine import EngineConfig
    from tailsieve_verl.core.engine.perf import parse_perf_model
    from tailsieve_verl.core.data.workload import PromptPool, generate_trace, get_preset
    from tailsieve_verl.core.simulation.planner import plan_from_trace
except ImportError:
    from tailsieve_verl.core import sim
    from tailsieve_verl.core.engine import EngineConfig
    from tailsieve_verl.core.perf import parse_perf_model
    from tailsieve_verl.core.workload import PromptPool, generate_trace, get_preset
    from tailsieve_verl.core.planner import plan_from_trace
from tailsieve_verl.core.errors import TailSieveError
scenario, steps, seeds, jobs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
kw = {"jobs": jobs} if jobs > 1 else {}  # a commit before --jobs takes none
perf = parse_perf_model("table:h200-dense:qwen3-8b")
engine = EngineConfig.verl_defaults("qwen3-8b", perf)
workload = get_preset("real", max_response_length=32768)
import tailsieve_verl
out = {"package": tailsieve_verl.__path__[0]}
def cpu_s():  # this process and its forked workers (their CPU counts once they are reaped)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime
wall, cpu = time.perf_counter(), cpu_s()
if scenario == "plan":
    trace = generate_trace(workload, 512, 16, name="one-step")
    try:
        plan = plan_from_trace(trace, 8, perf, batch_size=512, n=16, steps=steps, seeds=seeds, engine=engine, **kw)
        out["result"] = f"speedup {plan.speedup:.3f}, start q={plan.initial_q}, m={plan.initial_m}"
    except TailSieveError as e:
        out["result"] = f"refused: {e}"
else:
    policies = sim.POLICIES if scenario == "default" else ("best-static", "clairvoyant-split")
    cfg = sim.SimConfig(steps=steps, n_replicas=8, batch_size=512, n=16, seed=0, policies=policies, engine=engine)
    result = sim.simulate(cfg, PromptPool(workload, 2048, seed=0), perf, **kw)
    out["result"] = ", ".join(f"{name} {r.mean_makespan_s:.1f} s" for name, r in result.policies.items())
out["cpu_s"], out["wall_s"] = cpu_s() - cpu, time.perf_counter() - wall
print(json.dumps(out))
"""


def package_at(commit: str, into: Path) -> Path:
    """``tailsieve_verl/`` as of ``commit``, unpacked under ``into`` (a directory to put on PYTHONPATH)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "tailsieve_verl"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


QUICK_PLAN = (3, 1)  # plan-quick's steps and seeds


WARM = r"""
import numpy as np
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.engine.scheduler import ReplicaScheduler
perf = parse_perf_model("table:h200-dense:qwen3-8b")
ReplicaScheduler(np.array([5, 9, 300]), np.array([64, 64, 64]), None, EngineConfig.verl_defaults("qwen3-8b", perf)).run_to_end(perf)
"""


def warm(tree: Path) -> None:
    """Compile the tree's walk into numba's on-disk cache, as a user's second run finds it: an unpacked
    commit has no cache yet, and its first run would pay the compile that this tree's run does not."""
    subprocess.run([sys.executable, "-c", WARM], capture_output=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})  # a tree before the walk: nothing to warm


def measure(tree: Path, scenario: str, steps: int, seeds: int, jobs: int) -> dict:
    if scenario == "plan-quick":
        scenario, (steps, seeds) = "plan", QUICK_PLAN
    # run in the tree: ``python -c`` puts the working directory before PYTHONPATH
    run = subprocess.run([sys.executable, "-c", DRIVER, scenario, str(steps), str(seeds), str(jobs)], capture_output=True,
                         text=True, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    if run.returncode:
        return {"result": "failed: " + (run.stderr.strip().splitlines() or ["?"])[-1], "cpu_s": float("nan"),
                "wall_s": float("nan")}
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if Path(out["package"]).parent != tree.resolve():
        raise SystemExit(f"the {tree} run imported the package from {out['package']}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=BEFORE, help="the commit to measure against")
    ap.add_argument("--after", default=None, help="the commit to measure (default: this working tree)")
    ap.add_argument("--steps", type=int, default=30, help="simulated steps per run (both sides)")
    ap.add_argument("--seeds", type=int, default=5, help="plan: seeds")
    ap.add_argument("--scenarios", default="default,hindsight,plan",
                    help="comma-separated: default, hindsight, plan, plan-quick")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes a run may use (`simulate`/`plan --jobs`); CPU s then sums them, wall s is the goal's")
    ap.add_argument("--after-only", action="store_true", help="skip the before side (e.g. a long --steps run)")
    args = ap.parse_args()
    print(f"512 x 16 on 8 replicas, Qwen3-8B dense under verl's rollout defaults, real tails, 32k cap; "
          f"{args.steps} steps{f', plan {args.seeds} seeds' if 'plan' in args.scenarios.split(',') else ''}"
          f"{'; plan-quick %d steps, %d seed' % QUICK_PLAN if 'plan-quick' in args.scenarios.split(',') else ''}; "
          f"before {args.before}, after {args.after or 'this tree'}; "
          f"{'one core each' if args.jobs == 1 else f'{args.jobs} processes each'}")
    print(f"{'scenario':>10} {'side':>7} {'CPU s':>8} {'wall s':>8}  result")
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"after": package_at(args.after, Path(tmp) / "after") if args.after else ROOT}
        if not args.after_only:
            sides = {"before": package_at(args.before, Path(tmp) / "before"), **sides}
        for tree in sides.values():
            warm(tree)
        for scenario in args.scenarios.split(","):
            cpu = {}
            for side, tree in sides.items():
                m = measure(tree, scenario, args.steps, args.seeds, args.jobs)
                if not m["result"].startswith(("refused", "failed")):
                    cpu[side] = m["cpu_s"]
                print(f"{scenario:>10} {side:>7} {m['cpu_s']:8.1f} {m['wall_s']:8.1f}  {m['result']}", flush=True)
            if len(cpu) == 2 and cpu["after"] > 0:
                print(f"{scenario:>10} {'':>7} {cpu['before'] / cpu['after']:7.1f}x CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
