"""How long is a prompt deferred? (issue 20) The longest run of consecutive steps any prompt stays
carried, counted from outside the selector (its ``finish_step`` wrapped), so the same script measures
the code before and after the no-starvation fix; next to each policy's speedup over stock verl.

    PYTHONPATH=<checkout> python scripts/experiments/deferral_probe.py [all|weak|real|strong|rare]

Workloads: the presets at 64 × 8 on 8 dense replicas, and a rare-extreme pool (192 prompts, median
~155 tokens, every 32nd prompt now and then at the 16,000-token cap) at 64 × 8 on 4 MoE replicas.
Results (before: 84ce9ff, after: the fix) in ``scripts/results/no_starvation/``.
"""

from __future__ import annotations

import sys

from tailsieve_verl.core.tailsieve import selector
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.simulation.sim import SimConfig, simulate
from tailsieve_verl.core.data.workload import PromptPool, rare_extreme_pool

streaks: dict[int, dict] = {}
_finish_step = selector.TailSelector.finish_step


def _counting_finish_step(self, plan, *args, **kwargs):
    out = _finish_step(self, plan, *args, **kwargs)
    state = streaks.setdefault(id(self), {"carried": {}, "longest": 0})
    state["carried"] = {p: state["carried"].get(p, 0) + 1 for p in out.carried_ids}
    state["longest"] = max([state["longest"], *state["carried"].values()])
    return out


def main(which: str) -> None:
    selector.TailSelector.finish_step = _counting_finish_step
    cells = (("weak", "table:h200-dense", 8), ("real", "table:h200-dense", 8), ("strong", "table:h200-dense", 8),
             ("rare", "table:h200-moe", 4))
    for workload, perf, replicas in cells:
        if which not in ("all", workload):
            continue
        pool = rare_extreme_pool() if workload == "rare" else PromptPool(workload, 2048, seed=0)
        streaks.clear()
        cfg = SimConfig(steps=30, n_replicas=replicas, batch_size=64, n=8, seed=0,
                        policies=("verl", "tailsieve-fixed", "tailsieve", "clairvoyant-sample"))
        result = simulate(cfg, pool, parse_perf_model(perf))
        fixed, adaptive = (s["longest"] for s in streaks.values())  # runners are built in policy order
        speedup = {k: round(v, 3) for k, v in result.speedup_vs("verl").items() if k != "verl"}
        print(f"{workload}: longest run of carried steps tailsieve-fixed {fixed}, tailsieve {adaptive}; "
              f"speedup vs stock verl {speedup}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
