"""What can width reach? The ceiling of a tensor-parallel tail pool against stock verl at its best single width
(issue 58), on the engine model with the first-order TP step (``core.engine.perf.TensorParallel``).

On one cell's GPUs (dense: 8, MoE: 4, the main table's replicas at width 1; ``moe8``: the MoE on 8, as the
paper runs its large models), one JSON line per (cell, shape, seed)
with the mean makespan of:

* ``verl-tp{t}``: stock verl at single width t (G/t replicas of t GPUs), verl's rollout defaults at that width
  (KV cache of one weight copy over t GPUs), ``max_num_seqs`` at verl's 256 (``seqs256``) and at 256·t
  (``seqs{256t}``: the same running requests per GPU, what a user widening the replicas would set);
* ``split-b{b}t{t}``: clairvoyant-split's grid (``core.simulation.references.ClairvoyantSplitRunner``, this step's
  lengths known, the q heaviest groups on m tail replicas, one shared pool among the candidates) with tail
  replicas of width t on m·t of the GPUs and the bulk at width b on the rest (t >= b, max_num_seqs 256·width);
  ``split-b1t1`` is the routing-only split (group-oracle-split's grid), ``split-b1t{t}`` the issue's wide tail
  beside a width-1 bulk;
* ``pat-from{b}``: PAT's re-shard at the drain: stock verl at width b (max_num_seqs 256·b) until a fraction f of the step's
  requests is left, then every unfinished request moves to G/t replicas of width t > b (max_num_seqs 256·t) and decodes
  there to its end; the best (f, t) per step in hindsight (PAT predicts it) or no switch. Charged: the KV of every
  moved request (prompt and tokens so far) over NVLink, all G GPUs sending at once, plus ``--switch-s`` for the
  switch itself (1 s: NCCL groups and CUDA graphs of the wide layout built at launch, the engines' pause and the
  scheduler's hand-over; PAT's own figure not read; ``pat_free_switch_s`` keeps each run with it at 0). Prefill
  of the moved requests is not charged (their KV moves).

With ``--tailsieve`` (into ``tp_tailsieve.jsonl``) instead: stock verl at every single width (max_num_seqs 256·t) and
``tailsieve-tp{t}``, TailSieve's default adaptive controller with every replica at width t, at each width leaving it
two replicas or more: TailSieve on top of each stock width, deployable (no hindsight inside a run).

Every configuration runs on the same prompts and length draws (one stream per seed); hindsight picks (the split
grid's per step, PAT's switch per step) make these ceilings, not deployable policies.

    python scripts/experiments/tp_ceiling.py --model                       # the TP step model's table
    python scripts/experiments/tp_ceiling.py --cells dense8b-real,moe-real --shapes 512x16@32768 --seeds 2 --steps 4
    python scripts/experiments/tp_ceiling.py --tailsieve --cells dense8b-real,moe-real,moe8-real --seeds 2 --steps 8
    python scripts/experiments/tp_ceiling.py --report
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from strongest_stock import SETUPS as MAIN_SETUPS
from tailsieve_verl.core.data.workload import PromptPool, get_preset
from tailsieve_verl.core.engine.engine import H200_MODELS, EngineConfig
from tailsieve_verl.core.engine.perf import NVLINK_BYTES_PER_S, parse_perf_model
from tailsieve_verl.core.engine.replica import Evaluation, simulate_replica
from tailsieve_verl.core.routing.policies import least_inflight_assignment
from tailsieve_verl.core.simulation import sim
from tailsieve_verl.core.simulation.references import ClairvoyantSplitRunner
from tailsieve_verl.core.simulation.runners import StaticRunner
from tailsieve_verl.core.simulation.step_split import split_grid

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the docs' table renderer
from docs_numbers import tp_ceiling_table, tp_model_table, tp_tailsieve_table  # noqa: E402

OUT = Path("scripts/results/tp_ceiling")
SETUPS = {**MAIN_SETUPS, "moe8": ("table:h200-moe", 8, "qwen3-30b-a3b")}  # moe8: the MoE on 8 GPUs, as the paper
DRAIN_FRACTIONS = (1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64)  # requests left when pat-from{b} may switch


def widths(gpus: int, model: str) -> list[int]:
    """The widths a replica of ``model`` can take on ``gpus`` GPUs: dividing both the GPUs and its KV heads."""
    return [t for t in (1, 2, 4, 8) if gpus % t == 0 and H200_MODELS[model].kv_heads % t == 0]


def wide_engine(model: str, perf, t: int, max_num_seqs: int | None = None, **changes) -> EngineConfig:
    """verl's rollout defaults at width t, ``max_num_seqs`` 256·t unless given."""
    return EngineConfig.verl_defaults(model, perf, tensor_parallel_size=t, max_num_seqs=max_num_seqs or 256 * t, **changes)


class WideTailSplitRunner(ClairvoyantSplitRunner):
    """clairvoyant-split's grid with its tail replicas at ``tail``'s width, on the GPUs they take from the bulk."""

    def __init__(self, cfg, pool, perf, tail: EngineConfig):
        super().__init__(cfg, pool, perf)
        self.wide = tail

    def candidates(self):
        gpus = self.cfg.n_replicas * self.cfg.engine.width
        return [(q, m, self.wide) for q, m in split_grid(self.cfg.n_replicas, self.cfg.batch_size)
                if m * self.wide.width < gpus]


class PatLikeRunner(StaticRunner):
    """Stock verl on ``cfg``'s replicas, re-sharded to a wider layout at the step's drain point (the module
    docstring)."""

    def __init__(self, cfg, pool, perf, model: str, switch_s: float):
        super().__init__(cfg, pool, perf, "verl")  # stock verl's routing
        self.switch_s = switch_s
        self.gpus = cfg.n_replicas * cfg.engine.width
        self.kv_bytes = H200_MODELS[model].kv_bytes_per_token
        self.wide = {t: wide_engine(model, perf, t, max_num_batched_tokens=None, prefill_s_per_token=0.0)
                     for t in widths(self.gpus, model) if t > cfg.engine.width}
        self.wide_rng = np.random.default_rng([cfg.seed, 31])  # apart from the stock phase's routing draws
        self.free_s: list[float] = []  # each step's best with the switch itself free (the KV move still charged)
        self.picks: list[str] = []

    def run(self, groups, samples, m):
        ev = super().run(groups, samples, m)
        finish = np.concatenate(ev.response_finish_s)
        lengths = np.fromiter((x for g in groups for x in g.lengths), dtype=np.int64, count=len(finish))
        prompts = np.repeat([g.prompt_len for g in groups], [g.n for g in groups])
        generated = np.zeros(len(finish))
        best, free, pick, best_finish = ev.makespan_s, ev.makespan_s, "no switch", finish
        for f in DRAIN_FRACTIONS:
            tau = float(np.sort(finish)[len(finish) - math.ceil(f * len(finish)) - 1])
            for r in np.unique(samples):
                members = np.flatnonzero(samples == r)
                generated[members] = ev.progress[r].tokens_at(tau)  # the scheduler's path: progress is kept
            left = np.flatnonzero(finish > tau)
            if not len(left):  # the last requests finish together: nothing left to move
                continue
            context = prompts[left] + generated[left]
            move_s = float(context.sum()) * self.kv_bytes / (self.gpus * NVLINK_BYTES_PER_S)
            for t, engine in self.wide.items():
                wide_replica = least_inflight_assignment(len(left), self.gpus // t, rng=self.wide_rng)
                done = np.zeros(len(left))
                for w in range(self.gpus // t):
                    on = np.flatnonzero(wide_replica == w)
                    if len(on):
                        done[on] = simulate_replica((lengths[left] - generated[left])[on].astype(np.int64), self.perf,
                                                    context[on].astype(np.int64), engine).finish_s
                end = tau + move_s + float(done.max())
                free = min(free, end)
                if end + self.switch_s < best:
                    best, pick = end + self.switch_s, f"f=1/{round(1 / f)}, t={t}"
                    best_finish = finish.copy()
                    best_finish[left] = tau + move_s + self.switch_s + done
        self.free_s.append(free)
        self.picks.append(pick)
        times = [float(best_finish[samples == r].max(initial=0.0)) for r in range(self.cfg.n_replicas)]
        return Evaluation.from_sample_finish(groups, samples, best_finish, times)


def runners(job: dict) -> tuple[dict, object]:
    """Every configuration of the job's cell on its GPUs, sharing one prompt stream and its length draws."""
    setup, preset = job["cell"].split("-")
    perf_name, gpus, model = SETUPS[setup]
    perf = parse_perf_model(perf_name)
    shape, cap = job["shape"].split("@")
    batch, n = (int(x) for x in shape.split("x"))
    pool = PromptPool(get_preset(preset, max_response_length=int(cap)), job["pool"], seed=job["seed"])
    cfg = sim.SimConfig(steps=job["steps"], n_replicas=gpus, batch_size=batch, n=n, seed=job["seed"],
                        policies=("verl",), engine=EngineConfig.verl_defaults(model, perf))
    out = {"verl-tp1": StaticRunner(cfg, pool, perf, "verl")}
    if job.get("tailsieve"):  # TailSieve on top of each stock width
        for t in widths(gpus, model):
            at_t = replace(cfg, n_replicas=gpus // t, engine=wide_engine(model, perf, t))
            if t > 1:
                out[f"verl-tp{t}-seqs{256 * t}"] = StaticRunner(at_t, pool, perf, "verl")
            if gpus // t >= 2:
                out[f"tailsieve-tp{t}"] = sim.adaptive_runner(at_t, pool, perf, "tailsieve")
        return out, perf
    at = {1: cfg}  # each width's stock layout: G/t replicas, max_num_seqs 256·t
    for t in widths(gpus, model)[1:]:
        for seqs in (256, 256 * t):
            out[f"verl-tp{t}-seqs{seqs}"] = StaticRunner(
                replace(cfg, n_replicas=gpus // t, engine=wide_engine(model, perf, t, seqs)), pool, perf, "verl")
        at[t] = out[f"verl-tp{t}-seqs{256 * t}"].cfg
    for b in widths(gpus, model)[:-1]:  # bulk at width b, the tail at t >= b, some GPUs left to the bulk
        for t in widths(gpus, model):
            if t >= b and t < gpus:
                out[f"split-b{b}t{t}"] = WideTailSplitRunner(at[b], pool, perf, at[t].engine)
    for b in widths(gpus, model)[:-1]:
        out[f"pat-from{b}"] = PatLikeRunner(at[b], pool, perf, model, job["switch_s"])
    return out, perf


def run(job: dict) -> dict:
    t0 = time.process_time()
    built, _ = runners(job)
    cpu = dict.fromkeys(built, 0.0)
    for step in range(job["steps"]):
        for name, runner in built.items():
            start = time.process_time()
            runner.step(step, keep=False)
            cpu[name] += time.process_time() - start
    results = {name: runner.finish() for name, runner in built.items()}
    pats = {name: r for name, r in built.items() if name.startswith("pat-")}
    return {**job, "cpu_s": time.process_time() - t0, "cpu_s_by_config": cpu,
            "mean_makespan_s": {name: r.mean_makespan_s for name, r in results.items()},
            "pat_free_switch_s": {name: float(np.mean(r.free_s)) for name, r in pats.items()},
            "pat_picks": {name: r.picks for name, r in pats.items()},
            "split_choice": {name: r.choice for name, r in results.items() if name.startswith("split-")},
            "max_deferral_steps": {name: r.max_deferral_steps for name, r in results.items()
                                   if name.startswith("tailsieve-")}}


def model_table() -> dict:
    """The TP step model's numbers beside the one-GPU table rows they derive from."""
    rows = []
    for setup in ("dense8b", "moe"):
        perf_name, gpus, model = SETUPS[setup]
        perf = parse_perf_model(perf_name)
        cal = perf.calibration
        for t in (1, 2, 4, 8):
            if H200_MODELS[model].kv_heads % t:
                continue
            engine = EngineConfig.verl_defaults(model, perf, tensor_parallel_size=t)
            step = engine.step_model(perf)
            for context in (4096, 16384):
                for batch in (1, 16, 64, 256):
                    measured = cal.step_s[(cal.batch == batch) & (cal.context == context)]
                    rows.append({"setup": setup, "model": model, "width": t, "batch": batch, "context": context,
                                 "table_ms": 1000 * float(measured[0]) if len(measured) else None,
                                 "one_gpu_ms": 1000 * float(perf.step_time(batch, context)),
                                 "step_ms": 1000 * float(step.step_time(batch, context)),
                                 "allreduce_ms": 1000 * float(engine.tensor_parallel.allreduce_s(batch)),
                                 "floor_ms": 1000 * engine.tensor_parallel.floor_s,
                                 "kv_tokens": int(engine.capacity_tokens)})
    return {"constants": {"hbm_bytes_per_s": 4.8e12, "nvlink_bytes_per_s": NVLINK_BYTES_PER_S,
                          "allreduce_latency_s": EngineConfig.verl_defaults(
                              "qwen3-8b", parse_perf_model("table:h200-dense:qwen3-8b"),
                              tensor_parallel_size=2).tensor_parallel.allreduce_latency_s},
            "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="dense8b-real,moe-real")
    ap.add_argument("--shapes", default="512x16@32768,256x16@16384", help="BxN@CAP, comma-separated")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pool", type=int, default=17000, help="prompts in the dataset (a first epoch)")
    ap.add_argument("--switch-s", type=float, default=1.0,
                    help="pat-from{b}: seconds charged per switch beyond the KV move")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--model", action="store_true", help="write the TP step model's table (tp_model.json) and print it")
    ap.add_argument("--tailsieve", action="store_true",
                    help="TailSieve at each single width against stock verl at it (default --out: tp_tailsieve.jsonl)")
    ap.add_argument("--report", action="store_true", help="print the table of --out without running")
    args = ap.parse_args()
    if args.model:
        (OUT / "tp_model.json").write_text(json.dumps(model_table(), indent=1) + "\n")
        print(tp_model_table())
        return 0
    args.out = args.out or OUT / ("tp_tailsieve.jsonl" if args.tailsieve else "tp_ceiling.jsonl")
    if not args.report:
        jobs = [{"cell": c, "shape": s, "seed": seed, "steps": args.steps, "pool": args.pool, "switch_s": args.switch_s,
                 "tailsieve": args.tailsieve}
                for s in args.shapes.split(",") for c in args.cells.split(",")
                for seed in range(args.first_seed, args.first_seed + args.seeds)]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with ProcessPoolExecutor(args.jobs) as workers, args.out.open("a") as f:
            for row in workers.map(run, jobs):
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(row["cell"], row["shape"], row["seed"], f"{row['cpu_s']:.0f} CPU s", flush=True)
    print((tp_tailsieve_table if args.tailsieve else tp_ceiling_table)((args.out,)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
