"""Score a recorded `tailsieve closed-loop` run again under another performance model.

    python scripts/experiments/closed_loop_rescore.py RUN.json --calibration cal.json [ENGINE FLAGS] --out RUN_rescored.json

The run's steps keep their measured makespans; predictions, errors and speedups are recomputed from
the recorded lengths and assignments (tools.closed_loop.predict), e.g. with a calibration that
covers the contexts the run reached, or with the server's engine (``tailsieve`` engine flags: e.g.
``--max-num-seqs``, ``--num-gpu-blocks``, ``--block-size``) so KV pressure and preemption are modelled.

Recorded results: scripts/results/real_engine_vllm_cpu/ (re-scores the closed-loop runs there); every table and its command: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tailsieve_verl.core.engine.perf import Calibration, TablePerf
from tailsieve_verl.cli.engine_args import add_engine_args, engine_config_from_args
from tailsieve_verl.tools.closed_loop import predict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a closed-loop report JSON")
    parser.add_argument("--calibration", required=True, help="calibration JSON for the prediction")
    parser.add_argument("--out", type=Path, required=True, help="report JSON to write (not the run itself)")
    add_engine_args(parser)
    args = parser.parse_args()
    if args.out.resolve() == args.run.resolve():
        parser.error("--out is the recorded run; write the rescored report elsewhere")
    perf = TablePerf(Calibration.load(args.calibration))
    report = predict(json.loads(args.run.read_text()), perf, engine_config_from_args(args, perf))
    report["calibration"], report["rescored_from"] = args.calibration, str(args.run)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.run.name} under {report['perf_model']}: median prediction error "
          f"{report['median_prediction_error']:.1%}, worst {report['worst_prediction_error']:.1%}, TailSieve "
          f"measured {report.get('measured_speedup', 1.0):.3f}x vs predicted {report.get('predicted_speedup', 1.0):.3f}x")


if __name__ == "__main__":
    main()
