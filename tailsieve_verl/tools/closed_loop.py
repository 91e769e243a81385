"""Closed-loop fidelity on a real engine (``tailsieve closed-loop``).

The simulator's policies (:mod:`core.simulation.sim`: stock verl's routing and TailSieve's selector, controller,
per-prompt record and pools) run step by step on one prompt stream with persistent prompt
difficulty, but every step's samples run for real on vLLM OpenAI servers, with forced lengths as
in ``tailsieve bench``. The measured finish times then drive everything downstream: the cutoff, which
groups are aborted and carried, their abort scores and the controller's observations. The loop is
closed on the engine, not on the model.

Next to every measured step the performance model (a calibration measured on the same server)
predicts the same step: same lengths, same assignment, same cutoff rule. The report gives:

* ``median_prediction_error`` and ``worst_prediction_error``: |predicted − measured| / measured over
  every step of every policy;
* ``measured_speedup`` and ``predicted_speedup``: TailSieve over stock verl, as ratios of mean
  makespans over the steps after ``warmup``;
* ``share_of_predicted_gain``: (measured speedup − 1) / (predicted speedup − 1);
* ``simulated_speedup``: the same run with the model in place of the engine, i.e. what
  ``tailsieve simulate`` predicts for this workload.

Replicas of a synchronous step are independent, so R replicas may share fewer servers and run one
after another (see :func:`tools.bench.run_assignment`). Aborted bulk groups run to their end there;
that costs bench time but no measured time, because nothing before the cutoff depends on the abort.
verl's agent loop, Ray and the weight update are not in this loop: the E2E test tier runs them.
"""

from __future__ import annotations

import datetime as _dt
import statistics
from dataclasses import asdict
from typing import Callable, Sequence

import numpy as np

from ..core.engine.engine import EngineConfig
from ..core.errors import TailSieveError
from ..core.engine.perf import PerfModel
from ..core.engine.replica import NO_LIMITS, Evaluation, evaluate_samples
from ..core.simulation.sim import BASELINE, SimConfig, simulate, step_times
from ..core.data.trace import Group
from ..core.data.workload import PromptPool
from .bench import run_assignment
from .openai_client import OpenAIServer

POLICIES = ("verl", "uniform", "tailsieve", "tailsieve-fixed")  # deployable ones: no clairvoyant search


class ClosedLoopError(TailSieveError):
    """A closed-loop run that cannot go as asked."""


def check_run(cfg: SimConfig, warmup: int) -> None:
    """What :func:`closed_loop` refuses, checkable before any server is contacted."""
    unknown = [p for p in cfg.policies if p not in POLICIES]
    if unknown or BASELINE not in cfg.policies:
        raise ClosedLoopError(f"policies must include {BASELINE} (stock verl, the baseline) and come from "
                              f"{', '.join(POLICIES)}; got {', '.join(cfg.policies)}")
    if not 0 <= warmup < cfg.steps:
        raise ClosedLoopError(f"warmup {warmup} leaves no step of {cfg.steps} to measure speedups on; "
                              f"give 0..{cfg.steps - 1}")


def closed_loop(cfg: SimConfig, pool: PromptPool, servers: Sequence[OpenAIServer], perf: PerfModel,
                warmup: int = 0, on_step: Callable[[str, int, float], None] | None = None) -> dict:
    """Run ``cfg``'s policies on the servers; a JSON-able report (see the module docstring).
    ``cfg.engine`` describes the servers' engine (max_num_seqs, KV blocks, token budget) for the
    prediction, which runs every replica under it.
    ``on_step(policy, step, seconds)`` after every step's run (until its last replica is done; the
    step's makespan, cut at the abort, is in the report)."""
    check_run(cfg, warmup)
    if not servers:
        raise ClosedLoopError("need at least one server URL")
    measured: dict[str, list[Evaluation]] = {p: [] for p in cfg.policies}
    runs: dict[str, list[tuple[list, list, list]]] = {p: [] for p in cfg.policies}  # groups and assignment per step

    def execute(name: str, groups: Sequence[Group], samples: np.ndarray) -> Evaluation:
        step = len(measured[name])
        runs[name].append(([list(g.lengths) for g in groups], [g.prompt_len for g in groups], [int(r) for r in samples]))
        run = run_assignment(servers, groups, samples, cfg.n_replicas, run_key=f"{name}:{step}")
        measured[name].append(run.evaluation(groups, samples))
        if on_step:
            on_step(name, step, run.makespan_s)
        return measured[name][-1]

    result = simulate(cfg, pool, perf, execute=execute)
    modelled = simulate(cfg, pool, perf)  # the same stream with the model in place of the engine
    rows, audit = [], {}
    for name, res in result.policies.items():
        for rec, meas, (lengths, prompt_lens, replicas) in zip(res.records, measured[name], runs[name]):
            makespan = _makespan(meas, rec.n_tail, rec.n_requeued, cfg.batch_size)
            if not np.isclose(makespan, rec.makespan_s):
                raise ClosedLoopError(f"{name} step {rec.step}: the recorded makespan {rec.makespan_s:.3f}s is not "
                                      f"the measured step's {makespan:.3f}s (a cutoff rule out of step)")
            rows.append({"policy": name, "step": rec.step, "measured_makespan_s": rec.makespan_s,
                         "q": rec.q, "m": rec.m, "tail_groups": rec.n_tail, "requeued_groups": rec.n_requeued,
                         "tail_s": rec.tail_s,
                         "bulk_cutoff_s": rec.bulk_s, "wasted_tokens": rec.wasted_tokens,
                         "measured_replica_s": list(meas.replica_times_s),
                         "group_lengths": lengths, "group_prompt_len": prompt_lens, "sample_replica": replicas})
        audit[name] = {"lost": res.lost, "duplicated": res.duplicated,
                       "mean_simulated_makespan_s": float(np.mean(modelled.policies[name].makespans[warmup:]))}
    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": {k: v for k, v in asdict(cfg).items() if k != "controller"} | {"warmup": warmup},
        "controller": asdict(cfg.controller),
        "workload": asdict(pool.spec) | {"prompts": len(pool)},
        "servers": [s.url for s in servers],
        "server_model": servers[0].model,
        "steps": rows,
        "policies": audit,
    }
    return predict(report, perf, cfg.engine)


def _makespan(ev: Evaluation, n_tail: int, n_requeued: int, batch_size: int) -> float:
    """A step's makespan under the cutoff rule, from its groups' finish times (tail, requeued, fresh)."""
    tail_s, cut = step_times(ev, n_tail, n_requeued, batch_size - n_tail - n_requeued)
    return max(tail_s, cut.bulk_end_s)


def predict(report: dict, perf: PerfModel, engine: EngineConfig = NO_LIMITS) -> dict:
    """Fill ``report``'s predictions, errors and speedups from its recorded steps (lengths,
    assignment, tail groups) under ``perf`` and every replica's ``engine``: how :func:`closed_loop`
    scores a run, and how a recorded run is scored again under another model (e.g. a calibration that
    covers more contexts, or the engine's KV capacity)."""
    cfg, warmup = report["config"], report["config"]["warmup"]
    for row in report["steps"]:
        # reports recorded before group_prompt_len existed: a preset pool's prompts all have its prompt_len
        prompt_lens = row.get("group_prompt_len") or [report["workload"]["prompt_len"]] * len(row["group_lengths"])
        groups = [Group(f"g{i}", tuple(lengths), prompt_len)
                  for i, (lengths, prompt_len) in enumerate(zip(row["group_lengths"], prompt_lens))]
        pred = evaluate_samples(groups, np.asarray(row["sample_replica"]), cfg["n_replicas"], perf, engine)
        # reports recorded before requeued_groups existed ran the old cutoff, which requeued nothing apart
        row["predicted_makespan_s"] = _makespan(pred, row["tail_groups"], row.get("requeued_groups", 0),
                                                cfg["batch_size"])
        row["prediction_error"] = (row["predicted_makespan_s"] - row["measured_makespan_s"]) / row["measured_makespan_s"]
        row["predicted_replica_s"] = list(pred.replica_times_s)
    summary = report["policies"]
    for name, s in summary.items():
        mine = [r for r in report["steps"] if r["policy"] == name]
        kept = mine[warmup:]
        s["mean_measured_makespan_s"] = statistics.fmean(r["measured_makespan_s"] for r in kept)
        s["mean_predicted_makespan_s"] = statistics.fmean(r["predicted_makespan_s"] for r in kept)
        s["median_prediction_error"] = statistics.median(abs(r["prediction_error"]) for r in mine)
    errors = [abs(r["prediction_error"]) for r in report["steps"]]
    report.update({"perf_model": perf.name, "engine": asdict(engine),
                   "median_prediction_error": statistics.median(errors), "worst_prediction_error": max(errors)})
    base = summary[BASELINE]
    for name, s in summary.items():
        if name == BASELINE:
            continue
        s["measured_speedup"] = base["mean_measured_makespan_s"] / s["mean_measured_makespan_s"]
        s["predicted_speedup"] = base["mean_predicted_makespan_s"] / s["mean_predicted_makespan_s"]
        s["simulated_speedup"] = base["mean_simulated_makespan_s"] / s["mean_simulated_makespan_s"]
        gain = s["predicted_speedup"] - 1.0
        s["share_of_predicted_gain"] = (s["measured_speedup"] - 1.0) / gain if abs(gain) > 1e-9 else None
    if "tailsieve" in summary:
        for key in ("measured_speedup", "predicted_speedup", "simulated_speedup", "share_of_predicted_gain"):
            report[key] = summary["tailsieve"][key]
    return report
