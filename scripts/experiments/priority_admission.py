"""Longest-predicted-first admission through vLLM's priority scheduling, in the engine model (issue 48).

    python scripts/experiments/priority_admission.py [--cells dense8b-weak,dense8b-real,dense8b-strong,moe-real]
        [--shape 512x16] [--cap 32768] [--steps 4] [--seeds 2] [--out-dir scripts/results/priority_admission]

verl 0.9.1 forwards a per-sample ``priority`` (``non_tensor_batch["priority"]``, default ``arange``: submission
order) to vLLM and sets vLLM's policy from ``actor_rollout_ref.rollout.scheduling_policy`` (default ``fcfs``).
Under ``priority`` each replica's waiting queue pops the smallest (priority, arrival) and, short of KV blocks,
the running request with the largest is preempted. Routing is unchanged (stock verl: each sample to the
least-in-flight replica in submission order, :func:`core.routing.policies.least_inflight_assignment`), so the
only change is each replica's admission order, which :func:`core.engine.replica.priority_admission_order`
turns into the input order of the engine model (FCFS on priority-sorted input is vLLM's priority policy
when every request is queued before the first schedule, as in a synchronous step).

Per step, on the same groups and the same routing, every replica on ``EngineConfig.verl_defaults`` for the
cell's model (max_num_seqs 256, 8192-token chunked prefill, prefix caching, KV at gpu_memory_utilization 0.5):

* ``fcfs``: stock verl (``scheduling_policy: fcfs``);
* ``typical``: priority = the prompt's true typical length (``PromptPool.typical_length``: the best per-prompt
  predictor, prompt and checkpoint effects, no sampling noise), longest first;
* ``noisy``: priority = typical length × exp(σ z), σ = ``--sigma`` (0.5), z fixed per prompt and seed;
* ``true-mean``: priority = the step's true mean length of the group (a ceiling for a per-prompt key);
* ``true-max``: priority = the step's true max length of the group.

Prints, per cell, the mean over steps of fcfs makespan / variant makespan (mean over seeds, [min, max] over
seeds), and the engine's queueing per replica (preemptions, request-seconds of queue wait, the longest wait,
recomputed tokens; means over steps and replicas) so the mechanism is visible. Writes ``<name>.txt`` (the
command in its header) and ``<name>.jsonl`` (one row per cell, seed, step and variant: every replica's time
and events, one list per field) to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from tailsieve_verl.core.data.workload import PromptPool, get_preset
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.engine.replica import evaluate_samples, priority_admission_order
from tailsieve_verl.core.routing.policies import least_inflight_assignment

SETUPS = {"dense8b": ("table:h200-dense:qwen3-8b", 8, "qwen3-8b"), "moe": ("table:h200-moe", 4, "qwen3-30b-a3b")}
VARIANTS = ("fcfs", "typical", "noisy", "true-mean", "true-max")
POOL = 17000
EVENT_FIELDS = ("steps", "preemptions", "queue_wait_s", "max_queue_wait_s", "tokens_recomputed", "prefill_tokens")


def run_cell(cell: str, batch: int, n: int, cap: int, steps: int, seed: int, sigma: float) -> list[dict]:
    setup, preset = cell.split("-")
    perf_name, n_replicas, model = SETUPS[setup]
    perf = parse_perf_model(perf_name)
    engine = EngineConfig.verl_defaults(model, perf)
    pool = PromptPool(get_preset(preset, max_response_length=cap), POOL, seed)
    rng = np.random.default_rng(seed)
    z = np.random.default_rng(10_000 + seed).normal(size=len(pool))  # the noisy predictor's error, fixed per prompt
    rows = []
    for step in range(steps):
        picks = rng.choice(len(pool), size=batch, replace=False)
        groups = [pool.sample_group(pool.prompt_ids[i], n, step, rng) for i in picks]
        routed = least_inflight_assignment(batch * n, n_replicas, rng=np.random.default_rng([seed, step]))
        typical = np.array([pool.typical_length(pool.prompt_ids[i], step) for i in picks], dtype=float)
        keys = {"typical": typical, "noisy": typical * np.exp(sigma * z[picks]),
                "true-mean": np.array([g.total_len / g.n for g in groups]),
                "true-max": np.array([g.max_len for g in groups], dtype=float)}
        for variant in VARIANTS:
            t0 = time.process_time()
            if variant == "fcfs":
                ev = evaluate_samples(groups, routed, n_replicas, perf, engine)
            else:
                order = priority_admission_order(groups, routed, keys[variant])
                ev = evaluate_samples(order.groups, order.sample_replica, n_replicas, perf, engine)
            events = {f: [round(getattr(e, f), 3) for e in ev.replica_events] for f in EVENT_FIELDS}
            rows.append({"cell": cell, "shape": f"{batch}x{n}@{cap}", "seed": seed, "step": step, "variant": variant,
                         "makespan_s": round(ev.makespan_s, 4), "replica_times_s": [round(t, 4) for t in ev.replica_times_s],
                         "events": events, "cpu_s": round(time.process_time() - t0, 3)})
    return rows


def summarize(rows: list[dict], cells: list[str], shape: str, seeds: int) -> list[str]:
    by = {(r["cell"], r["seed"], r["step"], r["variant"]): r for r in rows}
    lines = [f"speedup = fcfs makespan / variant makespan, mean over steps; mean over {seeds} seeds [min, max over seeds]",
             f"{'cell':<16} {'shape':<13} {'fcfs s':>7} " + " ".join(f"{v:>21}" for v in VARIANTS[1:])]
    for cell in cells:
        seed_ids = sorted({r["seed"] for r in rows if r["cell"] == cell})
        steps = sorted({r["step"] for r in rows if r["cell"] == cell})
        fcfs = np.mean([by[cell, s, t, "fcfs"]["makespan_s"] for s in seed_ids for t in steps])
        cols = []
        for v in VARIANTS[1:]:
            per_seed = [np.mean([by[cell, s, t, "fcfs"]["makespan_s"] / by[cell, s, t, v]["makespan_s"] for t in steps])
                        for s in seed_ids]
            cols.append(f"{np.mean(per_seed):.3f}x [{min(per_seed):.3f},{max(per_seed):.3f}]")
        lines.append(f"{cell:<16} {shape:<13} {fcfs:>7.0f} " + " ".join(f"{c:>21}" for c in cols))
    lines += ["", "queueing per replica (means over seeds, steps and replicas): preemptions, queue wait (request-s), "
              "longest wait (s), recomputed tokens; replica spread = slowest / mean replica time",
              f"{'cell':<16} {'variant':<10} {'preempt':>8} {'wait req-s':>11} {'max wait s':>10} {'recomputed':>11} "
              f"{'spread':>7}"]
    for cell in cells:
        for v in VARIANTS:
            rs = [r for r in rows if r["cell"] == cell and r["variant"] == v]
            ev = {f: np.mean([x for r in rs for x in r["events"][f]]) for f in EVENT_FIELDS}  # per replica
            spread = np.mean([max(r["replica_times_s"]) / np.mean(r["replica_times_s"]) for r in rs])
            lines.append(f"{cell:<16} {v:<10} {ev['preemptions']:>8.1f} {ev['queue_wait_s']:>11.0f} "
                         f"{ev['max_queue_wait_s']:>10.0f} {ev['tokens_recomputed']:>11.0f} {spread:>7.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="dense8b-weak,dense8b-real,dense8b-strong,moe-real")
    ap.add_argument("--shape", default="512x16")
    ap.add_argument("--cap", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--sigma", type=float, default=0.5)
    ap.add_argument("--name", default=None, help="output file stem (default: priority_admission_<shape>_<cap>)")
    ap.add_argument("--out-dir", type=Path, default=Path("scripts/results/priority_admission"))
    args = ap.parse_args()
    batch, n = (int(x) for x in args.shape.split("x"))
    cells = args.cells.split(",")
    stem = args.name or f"priority_admission_{args.shape}_{args.cap}"
    command = "python " + " ".join(sys.argv)
    rows: list[dict] = []
    t0 = time.process_time()
    for cell in cells:
        for seed in range(args.seeds):
            rows += run_cell(cell, batch, n, args.cap, args.steps, seed, args.sigma)
            print(f"# {cell} seed {seed} done, {time.process_time() - t0:.0f} CPU s", file=sys.stderr, flush=True)
    shape = f"{args.shape}@{args.cap}"
    lines = [f"# {command}", f"# {args.steps} steps x {args.seeds} seeds per cell; PromptPool(preset, {POOL}, seed); "
             f"stock verl routing (least in flight, random ties); EngineConfig.verl_defaults per cell's model; "
             f"noisy sigma {args.sigma}; {time.process_time() - t0:.0f} CPU s", ""]
    lines += summarize(rows, cells, shape, args.seeds)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    with open(args.out_dir / f"{stem}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
