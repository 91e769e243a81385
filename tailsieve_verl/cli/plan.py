"""`tailsieve plan`: from a logged run (a trace or verl rollout dump), or one step of a bundled
workload preset, predict TailSieve's speedup on that workload with an uncertainty band, the (q, m) to
start the controller from, and the fixed (q, m) to pin instead where that pays more. With the engine's
speculation (--spec-acceptance, and --num-speculative-tokens, --spec-draft-cost, ...) it also chooses the
engines: the best stock configuration (stock verl with or without speculation), and TailSieve
routing-only, tailsieve-spec or tailsieve-dynsd where one beats it, else the fallback to it."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import numpy as np

from ..core.engine.perf import DEFAULT_PERF_MODEL, parse_perf_model
from ..core.simulation.planner import Configuration, EnginePlan, Plan, plan_from_trace, trace_batch
from ..core.data.trace import Trace, read_trace
from ..core.data.workload import PRESETS, LengthProfile, generate_trace
from .checks import MAX_COUNT, IntRule
from .engine_args import (PLANNING_ENGINE, add_engine_args, add_width_arg, engine_config_from_args, engine_shape,
                          speculation_from_args, stock_widths)
from .lengths import add_length_cap_args, capped, preset
from .recommend import from_plan, pin_overrides, plan_overrides, switch_pays, tp_overrides
from .trace import profile_json, profile_lines

PRESET_GROUP_SIZE = 8  # a preset's groups when --n is not given (the recipes' n)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="predict TailSieve's speedup over stock verl and its starting (q, m) from a logged run",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="JSONL/Parquet trace or verl rollout-dump directory")
    source.add_argument("--workload", choices=sorted(PRESETS),
                        help="instead of a trace: one logged step of this bundled preset (--pool-size groups of --n)")
    p.add_argument("--pool-size", type=IntRule(2, MAX_COUNT), default=512, help="--workload: prompt groups in the generated step")
    p.add_argument("--replicas", "-R", type=int, default=8)
    add_width_arg(p)
    p.add_argument("--batch", "-B", type=int, default=None,
                   help="prompt groups per step (default: the trace's groups where it holds one step, i.e. every "
                        "group has as many samples; else min(64, prompts/2))")
    p.add_argument("--n", type=int, default=None, help="responses per group (default: the trace's median)")
    p.add_argument("--perf-model", default=DEFAULT_PERF_MODEL)
    p.add_argument("--steps", type=int, default=30, help="simulated steps per seed")
    p.add_argument("--seeds", type=int, default=5,
                   help="independent simulations behind the band; the fixed split is chosen on them and scored on "
                        "as many more (stock verl and the split only)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="processes simulating the seeds' policies side by side (the same plan; default: 2, or 1 on one CPU)")
    add_length_cap_args(p)
    add_engine_args(p, defaults=PLANNING_ENGINE)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    trace = (capped(read_trace(args.trace), args) if args.trace else
             generate_trace(preset(args.workload, args), args.pool_size, args.n or PRESET_GROUP_SIZE,
                            name=f"preset:{args.workload}"))
    perf = parse_perf_model(args.perf_model)
    speculating = args.spec_acceptance is not None  # the engine speculates: the plan chooses how
    engine = engine_config_from_args(args, perf, spec_policies=speculating)
    speculation = speculation_from_args(args) if speculating else None
    assumed = _assumptions(args, trace, perf)
    profile = _length_profile(args, trace)
    if not args.json:  # said before the minutes of simulation, so a wrong assumption can be stopped
        print(assumed["line"], flush=True)
        for line in profile_lines(profile, cap_given=args.max_response_length is not None or bool(args.workload)):
            print(line)
    plan = plan_from_trace(trace, args.replicas, perf, batch_size=args.batch, n=args.n, steps=args.steps,
                           seeds=args.seeds, engine=replace(engine, speculative=None) if speculating else engine,
                           speculation=speculation, jobs=args.jobs,
                           widths=None if speculating else stock_widths(args, perf, engine))
    recommendation = from_plan(plan, args.perf_model)
    if args.json:
        print(json.dumps(plan.to_json() | _engines_json(plan.engines, args.perf_model) | {
            "assumed": {k: v for k, v in assumed.items() if k != "line"}, "lengths": profile_json(profile),
            "recommendation": recommendation}))
        return 0
    lo, hi = plan.band
    print(f"trace {trace.name}: {plan.prompts} prompt groups; simulated {len(plan.per_seed)} "
          f"× {plan.steps} steps of B={plan.batch_size}×{plan.n} on {plan.n_replicas} replicas")
    if plan.prompt_copies > 1:
        print(f"fewer groups than 2 × batch (a prompt is in flight at most once): the steps draw their fresh prompts "
              f"from {plan.prompt_copies} copies of each logged group, lengths resampled from its observed ones")
    if plan.above_prompt_oracle:
        print(f"predicted TailSieve speedup over stock verl: at most {max(1.0, plan.prompt_oracle_speedup):.3f}×, the "
              f"per-prompt oracle's (or none): the simulation's {plan.speedup:.3f}× (band {lo:.3f}–{hi:.3f}×) is above it, an artefact "
              "of too few steps until shown otherwise (raise --steps)")
    else:
        print(f"predicted TailSieve speedup over stock verl: {plan.speedup:.3f}× (10–90 % band {lo:.3f}–{hi:.3f}×)")
    if plan.prompt_oracle_speedup is not None:
        share = plan.share_of_prompt_oracle_gain
        print(f"the best a per-prompt length predictor could do (prompt-oracle-split, a reference): "
              f"{plan.prompt_oracle_speedup:.3f}×" + (f"; TailSieve reaches {100 * share:.0f} % of its gain" if share is not None
                                                     else "; no gain for a per-prompt signal to win here"))
    print(f"start the controller at q={plan.initial_q}, m={plan.initial_m} "
          f"(tailsieve.q0 / tailsieve.tail_replicas in the verl config)")
    for line in fixed_split_lines(plan):
        print(line)
    for line in width_lines(plan):
        print(line)
    if plan.engines:
        _print_engines(plan.engines)
    print(recommendation)
    return 0


def fixed_split_lines(plan: Plan) -> list[str]:
    """The fixed split the seeds chose, named "best" and offered to pin only where it is faster than stock
    verl on the seeds it was not chosen on."""
    if plan.fixed_m == 0:
        return [f"best fixed split: one shared pool (stock verl's routing), {plan.fixed_speedup:.3f}× on the seeds "
                "it was chosen on"]
    chosen, out_of_sample = plan.seeds_chosen_on, plan.fixed_out_of_sample_speedup
    scored = (f"(chosen on seeds 0–{chosen - 1} at {plan.fixed_speedup:.3f}×, scored on seeds "
              f"{chosen}–{2 * chosen - 1})")
    if out_of_sample <= 1:
        return [f"no fixed split is faster than stock verl: q={plan.fixed_q}, m={plan.fixed_m}, the seeds' pick, "
                f"{out_of_sample:.3f}× out of sample {scored}"]
    return [f"best fixed split: q={plan.fixed_q}, m={plan.fixed_m}, {out_of_sample:.3f}× out of sample {scored}; "
            f"to pin it: {pin_overrides(plan.fixed_q, plan.fixed_m)}",
            "  on strong tails the plan can overrate isolation (there 4 of 10 picked splits lost 3.4 %): "
            "check it against stock verl with `tailsieve compare` before keeping it"]


def width_lines(plan: Plan) -> list[str]:
    """Stock verl at every single width of the plan's GPUs and the strongest (with the overrides that switch to it),
    and TailSieve measured on it where it is not the plan's own."""
    w = plan.widths
    if w is None:
        return []
    runs = ", ".join(f"TP{t} × {w.gpus // t} {x:.3f}×" for t, x in sorted(w.speedups.items()))
    lines = [f"stock verl at each single width of {w.gpus} GPUs, over TP{w.width} × {w.gpus // w.width}: {runs}; "
             + (f"the strongest, TP{w.best}, to switch: {tp_overrides(w.best, w.best_max_num_seqs)}" if switch_pays(w)
                else f"the strongest: TP{w.width}, as planned" if not w.switch else
                f"TP{w.best} within the seeds' noise of TP{w.width}: no switch")]
    if w.switch and w.tailsieve:
        lo, hi = _band_of(w.tailsieve)
        lines.append(f"TailSieve on TP{w.best}: {w.tailsieve_speedup:.3f}× stock verl at TP{w.best} (band {lo:.3f}–"
                     f"{hi:.3f}×), {np.mean(w.tailsieve_vs_width):.3f}× stock verl at TP{w.width}; TailSieve at "
                     f"TP{w.width}: {plan.speedup / w.speedups[w.best]:.3f}× stock verl at TP{w.best}")
    return lines


def _band_of(samples) -> tuple[float, float]:
    return float(np.percentile(samples, 10)), float(np.percentile(samples, 90))


def _assumptions(args: argparse.Namespace, trace: Trace, perf) -> dict:
    """What the plan takes from the trace and what it assumes, and the one line that says so."""
    if args.batch is not None:
        batch, why_batch = args.batch, "--batch"
    else:
        batch, why_batch = trace_batch(trace)
    n, why_n = (args.n, "--n") if args.n is not None else (
        int(np.median([g.n for g in trace])), "the trace's median samples per group")
    if args.max_response_length is not None:
        cap, why_cap = args.max_response_length, "--max-response-length"
    elif args.workload:
        cap, why_cap = preset(args.workload, args).max_response_length, "the preset's"
    else:
        cap, why_cap = max(trace.lengths), "none given: the trace's longest response"
    shape = engine_shape(args.engine_defaults, perf)
    engine = (f"verl 0.9.1's rollout defaults for {shape} on one H200 (--engine-defaults {args.engine_defaults})"
              if shape else f"no limit binds (--engine-defaults {args.engine_defaults})")
    overridden = [f"--{name.replace('_', '-')}" for name in ("max_num_seqs", "num_gpu_blocks", "block_size",
                                                             "max_num_batched_tokens") if getattr(args, name) is not None]
    if overridden:
        engine += " with " + ", ".join(overridden)
    line = (f"assumed: B={batch} ({why_batch}), n={n} ({why_n}), R={args.replicas} (--replicas), "
            f"response cap {cap} ({why_cap}), engine: {engine}, perf model {args.perf_model}")
    return {"batch": batch, "batch_from": why_batch, "n": n, "n_from": why_n, "replicas": args.replicas,
            "response_cap": cap, "response_cap_from": why_cap, "engine_defaults": shape, "perf_model": args.perf_model,
            "line": line}


def _length_profile(args: argparse.Namespace, trace: Trace) -> LengthProfile:
    cap = args.max_response_length or (preset(args.workload, args).max_response_length if args.workload else None)
    return LengthProfile.of(trace.lengths, cap)


def _engines_json(engines: EnginePlan | None, perf_spec: str) -> dict:
    """The plan's engines with the overrides that deploy each configuration ({} without speculation)."""
    if engines is None:
        return {}
    def with_overrides(c: Configuration) -> dict:
        return c.to_json() | {"overrides": plan_overrides(c, perf_spec)}
    return engines.to_json() | {"best_stock": with_overrides(engines.best_stock),
                                "candidates": [with_overrides(c) for c in engines.candidates],
                                "choice": with_overrides(engines.choice) | {"fallback": engines.fallback},
                                "overrides": plan_overrides(engines.choice, perf_spec)}


def _print_engines(engines: EnginePlan) -> None:
    stock, choice = engines.best_stock, engines.choice
    print(f"best stock configuration: {_name(stock)}, {stock.speedup_vs_verl:.3f}× stock verl "
          f"(band {stock.band_vs_verl[0]:.3f}–{stock.band_vs_verl[1]:.3f}×); verl-spec and verl-dynsd-best pick "
          "their k or schedule per seed in hindsight, which flatters stock")
    for c in engines.candidates:
        lo, hi = c.band_vs_best_stock
        print(f"  {_name(c)}: {c.speedup_vs_best_stock:.3f}× the best stock configuration (band {lo:.3f}–{hi:.3f}×), "
              f"{c.speedup_vs_verl:.3f}× stock verl")
    pools = f"tail pool {choice.engines['tail']}, bulk pool {choice.engines['bulk']}"
    if engines.fallback:
        print(f"choice: fall back to the best stock configuration, {_name(stock)} ({pools}): no TailSieve "
              "configuration beat it")
        return
    lo, hi = choice.band_vs_best_stock
    print(f"choice: {_name(choice)} ({pools}, q={choice.q}, m={choice.m}): {choice.speedup_vs_verl:.3f}× stock verl "
          f"(band {choice.band_vs_verl[0]:.3f}–{choice.band_vs_verl[1]:.3f}×), {choice.speedup_vs_best_stock:.3f}× the "
          f"best stock configuration (band {lo:.3f}–{hi:.3f}×)")


def _name(c: Configuration) -> str:
    return f"{c.name} ({c.label})" if c.label else c.name
