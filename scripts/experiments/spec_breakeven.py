"""When does speculation on every replica pay? The break-even acceptance and overhead, from the engine model.

The engine model (``core.engine.scheduler.step_seconds``) prices a verify step of k draft tokens per
request at ``T(b·(k+1), 0) + T(b, c) − T(b, 0)`` — first order, never measured on a GPU — plus
``k · draft_cost · T(b, c)`` for drafting; at a flat acceptance a per draft position a request gains
``τ = 1 + a + … + a^k`` tokens per step. So a step pays when τ exceeds ρ, the speculative step's cost
in plain decode steps. Two tables, on the bundled H200 tables (dense Qwen3-1.7B and -8B, MoE
Qwen3-30B-A3B):

1. per step (b requests at context c, k = 1..4): ρ, the flat acceptance a* at which τ = ρ (draft cost
   0 and 1/28, a one-layer MTP head of a 28-layer model), and at the acceptance the simulator assumes
   when none is given (0.85, 0.80, 0.75, k = 3) the per-step speedup and the overhead per draft token
   (beyond the first-order verify, in decode steps) at which it stops paying;
2. per rollout step (makespan ratio 1.0): one step of the ``real`` preset (64 × 8 and 512 × 16, samples
   spread over the replicas round-robin, as stock verl's least-in-flight dispatch does at the start of
   a step) under verl 0.9.1's rollout defaults (``EngineConfig.verl_defaults``: 256 running requests,
   8192-token chunked prefill, KV cache at gpu_memory_utilization 0.5), with speculation on every
   replica: a* where the makespan equals plain decoding's, and at the assumed acceptance the speedup
   and the break-even overhead per draft token.

    python scripts/experiments/spec_breakeven.py --out scripts/results/speculation   # ~100 CPU-s
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from tailsieve_verl.core.data.workload import generate_trace, get_preset
from tailsieve_verl.core.engine.engine import EngineConfig, SpeculativeConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.engine.replica import evaluate_samples
from tailsieve_verl.core.engine.scheduler import step_seconds
from tailsieve_verl.core.simulation.sim import DEFAULT_SPECULATION

SETUPS = {"dense 1.7B": ("table:h200-dense", "qwen3-1.7b", 8), "dense 8B": ("table:h200-dense:qwen3-8b", "qwen3-8b", 8),
          "MoE 30B-A3B": ("table:h200-moe", "qwen3-30b-a3b", 4)}
BATCHES = (1, 16, 64, 128, 256)
CONTEXTS = (1024, 4096, 16384)
DEPTHS = (1, 2, 3, 4)
MTP_DRAFT_COST = DEFAULT_SPECULATION.draft_cost  # 1/28
SHAPES = {"64x8": (64, 8, 16384), "512x16": (512, 16, 32768)}  # groups, samples per group, response cap
SEARCH_STEPS = 11  # bisection halvings: acceptance to 0.0005, overhead to 0.002 decode steps


def tokens_per_step(acceptance: tuple[float, ...], k: int) -> float:
    """1 + Σᵢ Πⱼ≤ᵢ αⱼ, the last acceptance repeating (as ``SpeculativeConfig`` reads it)."""
    return float(SpeculativeConfig(k, acceptance).tokens_per_step(k, 0.0))


def flat_break_even(cost_ratio: float, k: int) -> float | None:
    """The flat acceptance a at which 1 + a + … + a^k equals ``cost_ratio`` (None: not even a = 1 pays)."""
    if cost_ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(k + 1)) < cost_ratio else (lo, mid)
    return round(hi, 4)


def per_step_rows(perf, setup: str) -> list[dict]:
    rows = []
    for b in BATCHES:
        for c in CONTEXTS:
            plain = float(perf.step_time(b, c))
            for k in DEPTHS:
                engine = EngineConfig(speculative=SpeculativeConfig(k, (1.0,)))
                one = np.array([float(b)])
                verify = float(step_seconds(perf, engine, one, one * c, one * (k + 1), np.array([k]), np.zeros(1))[0])
                rho = verify / plain
                row = {"setup": setup, "batch": b, "context": c, "k": k, "verify_over_decode": round(rho, 4),
                       "break_even_acceptance": flat_break_even(rho, k),
                       "break_even_acceptance_mtp_draft": flat_break_even(rho + k * MTP_DRAFT_COST, k)}
                if k == DEFAULT_SPECULATION.num_speculative_tokens:
                    tau = tokens_per_step(DEFAULT_SPECULATION.acceptance, k)
                    row["assumed_speedup"] = round(tau / (rho + k * MTP_DRAFT_COST), 4)
                    row["assumed_break_even_overhead"] = round((tau - rho) / k, 4)
                rows.append(row)
    return rows


def makespan(groups, n_replicas: int, perf, engine: EngineConfig) -> float:
    spread = np.arange(sum(g.n for g in groups)) % n_replicas  # round-robin over replicas, sample by sample
    return evaluate_samples(groups, spread, n_replicas, perf, engine).makespan_s


def bisect(pays, lo: float, hi: float) -> float:
    """The boundary between ``lo`` (``pays(lo)`` False) and ``hi`` (True)."""
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pays(mid) else (mid, hi)
    return (lo + hi) / 2


def rollout_rows(perf_spec: str, model: str, n_replicas: int, setup: str) -> list[dict]:
    perf = parse_perf_model(perf_spec)
    plain = EngineConfig.verl_defaults(model, perf)
    rows = []
    for shape, (groups, n, cap) in SHAPES.items():
        workload = get_preset("real", max_response_length=cap)
        steps = [generate_trace(workload, groups, n, seed=seed).groups for seed in ((0, 1) if groups <= 64 else (0,))]
        base = sum(makespan(step, n_replicas, perf, plain) for step in steps)

        def ratio(spec: SpeculativeConfig) -> float:
            """Makespan with speculation over plain decoding's (below 1: speculation pays)."""
            engine = replace(plain, speculative=spec)
            return sum(makespan(step, n_replicas, perf, engine) for step in steps) / base

        for k in DEPTHS:
            row = {"setup": setup, "shape": shape, "replicas": n_replicas, "cap": cap, "k": k}
            for key, draft in (("break_even_acceptance", 0.0), ("break_even_acceptance_mtp_draft", MTP_DRAFT_COST)):
                at = lambda a: ratio(SpeculativeConfig(k, (a,), draft_cost=draft))  # noqa: E731
                row[key] = None if at(1.0) >= 1.0 else round(bisect(lambda a: at(a) < 1.0, 0.0, 1.0), 3)
            rows.append(row)
        assumed = DEFAULT_SPECULATION
        speedup = 1.0 / ratio(assumed)
        ceiling = 4.0
        over = lambda d: ratio(replace(assumed, draft_cost=d))  # noqa: E731
        overhead = None if over(ceiling) < 1.0 else round(bisect(lambda d: over(d) < 1.0, ceiling, 0.0), 3)
        rows.append({"setup": setup, "shape": shape, "replicas": n_replicas, "cap": cap, "k": assumed.num_speculative_tokens,
                     "assumed_acceptance": list(assumed.acceptance), "assumed_speedup": round(speedup, 3),
                     "assumed_break_even_overhead": overhead})
    return rows


def render(per_step: list[dict], rollout: list[dict], seconds: float, cpu_seconds: float, command: str) -> str:
    acc = ", ".join(f"{a:g}" for a in DEFAULT_SPECULATION.acceptance)
    lines = [
        "When speculation on every replica pays, from the engine model (bundled H200 tables; the verify step priced",
        "first order, T(b(k+1),0) + T(b,c) - T(b,0), never measured on a GPU). a* = the flat per-position acceptance",
        f"at break-even (draft cost 0 / 1/28 of a decode step per draft token); assumed = the simulator's default",
        f"acceptance {acc} at k = 3 with draft cost 1/28: its speedup, and the overhead per draft token (decode",
        "steps, beyond the first-order verify) at which it stops paying.",
        "",
        "Per step: b requests at context c.",
        f"{'setup':<12} {'b':>4} {'ctx':>6} " + " ".join(f"{'k=' + str(k) + ' rho':>9} {'a*':>11}" for k in DEPTHS)
        + f" {'assumed':>8} {'overhead':>9}",
    ]
    for setup in SETUPS:
        for b in BATCHES:
            for c in CONTEXTS:
                cells = {r["k"]: r for r in per_step if (r["setup"], r["batch"], r["context"]) == (setup, b, c)}
                def a_star(r):
                    pair = [r["break_even_acceptance"], r["break_even_acceptance_mtp_draft"]]
                    return "/".join("never" if a is None else f"{a:.2f}" for a in pair)
                k3 = cells[DEFAULT_SPECULATION.num_speculative_tokens]
                lines.append(f"{setup:<12} {b:>4} {c:>6} " + " ".join(f"{cells[k]['verify_over_decode']:>9.2f} {a_star(cells[k]):>11}"
                                                                    for k in DEPTHS)
                             + f" {k3['assumed_speedup']:>7.2f}x {k3['assumed_break_even_overhead']:>9.2f}")
    lines += ["", "Per rollout step (makespan ratio 1.0): the real preset under verl 0.9.1's rollout defaults, samples "
              "round-robin over the replicas.",
              f"{'setup':<12} {'shape':>7} {'R':>2} " + " ".join(f"{'a* k=' + str(k):>11}" for k in DEPTHS)
              + f" {'assumed':>8} {'overhead':>9}"]
    for setup in SETUPS:
        for shape in SHAPES:
            cells = [r for r in rollout if (r["setup"], r["shape"]) == (setup, shape)]
            by_k = {r["k"]: r for r in cells if "assumed_speedup" not in r}
            assumed = next(r for r in cells if "assumed_speedup" in r)
            fmt = lambda a: "never" if a is None else f"{a:.3f}"  # noqa: E731
            overhead = "> 4" if assumed["assumed_break_even_overhead"] is None else f"{assumed['assumed_break_even_overhead']:.2f}"
            lines.append(f"{setup:<12} {shape:>7} {assumed['replicas']:>2} "
                         + " ".join(f"{fmt(by_k[k]['break_even_acceptance']) + '/' + fmt(by_k[k]['break_even_acceptance_mtp_draft']):>11}"
                                    for k in DEPTHS)
                         + f" {assumed['assumed_speedup']:>7.2f}x {overhead:>9}")
    lines += ["", f"wall {seconds:.0f} s, CPU {cpu_seconds:.0f} s (one process)", f"command: {command}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory: writes breakeven.json and breakeven.txt there")
    args = p.parse_args(argv)
    t0, cpu0 = time.time(), time.process_time()
    per_step, rollout = [], []
    for setup, (perf_spec, model, n_replicas) in SETUPS.items():
        per_step += per_step_rows(parse_perf_model(perf_spec), setup)
        rollout += rollout_rows(perf_spec, model, n_replicas, setup)
        print(f"{setup}: done at {time.time() - t0:.0f} s", file=sys.stderr)
    seconds, cpu_seconds = time.time() - t0, time.process_time() - cpu0
    command = "python scripts/experiments/spec_breakeven.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out) / "breakeven"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"method": __doc__.split("\n\n")[0], "assumed_acceptance": list(DEFAULT_SPECULATION.acceptance),
           "mtp_draft_cost": MTP_DRAFT_COST, "per_step": per_step, "per_rollout_step": rollout,
           "wall_s": round(seconds, 1), "cpu_s": round(cpu_seconds, 1), "command": command}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    text = render(per_step, rollout, seconds, cpu_seconds, command)
    out.with_suffix(".txt").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
