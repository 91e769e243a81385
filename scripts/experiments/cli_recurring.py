"""At worst, stock verl on pools whose prompts recur, tried as a new user would (issue 56): ``tailsieve simulate``
through the command line on a 256-prompt pool at 64 × 8 (a prompt recurs every 4 steps), 40 steps, per seed and
tail preset; TailSieve's speedup over stock verl on steps 8–39 (the record knows every prompt from step 4 on).

    python scripts/experiments/cli_recurring.py --seeds 24 --out scripts/results/at_worst_stock_verl/cli_recurring.jsonl
    PYTHONPATH=<a checkout of 5d35b14> python scripts/experiments/cli_recurring.py --rule old --out ...   # the judge before

``--rule`` only labels the rows: the ``tailsieve`` package on the path is the one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

FIRST_MEASURED = 8


def run(workload: str, seed: int, rule: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "tailsieve_verl", "simulate", "--workload", workload, "--batch", "64", "--n", "8",
                   "--pool-size", "256", "--steps", "40", "--seed", str(seed), "--policies", "verl,tailsieve",
                   "--json", "--no-plots", "--out", out]
        result = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    verl, tailsieve = (result["policies"][name]["makespan_s"][FIRST_MEASURED:] for name in ("verl", "tailsieve"))
    ts = result["policies"]["tailsieve"]
    return {"workload": workload, "seed": seed, "rule": rule, "speedup_vs_verl": sum(verl) / sum(tailsieve),
            "split_steps": sum(m > 0 for m in ts["m"][FIRST_MEASURED:]), "max_deferral_steps": ts["max_deferral_steps"],
            "lost_dup_stale": ts["prompts_lost"] + ts["prompts_duplicated"] + ts["stale_responses"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="weak,real")
    ap.add_argument("--seeds", type=int, default=24)
    ap.add_argument("--rule", default="new", help="the label of the rows: new (this checkout's judge) or old")
    ap.add_argument("--out")
    args = ap.parse_args()
    for workload in args.workloads.split(","):
        for seed in range(args.seeds):
            row = json.dumps(run(workload, seed, args.rule))
            print(row, flush=True)
            if args.out:
                with open(args.out, "a") as sink:
                    sink.write(row + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
