"""The one line that ends `tailsieve simulate` and `tailsieve plan`: which configuration to run, and the
verl overrides that turn it on, or stay with stock verl when no deployable configuration beats it by
more than the run's own noise (a few per cent is below what one simulated run resolves). A stock
speculation configuration (MTP on every replica, at a fixed depth or on vLLM's batch-size schedule) is
a candidate like TailSieve: when it is the fastest, it is what the line recommends.

Every printed key takes Hydra's ``++`` (add, or override where it is set): the line is appended to a command or
a recipe that may already set the key (the shipped recipes set ``tailsieve.mode``, ``q0``, ``tail_replicas`` and
``perf_model``), where ``+`` stops Hydra with "Could not append to config"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.engine.engine import parse_spec_schedule
from ..core.engine.perf import DEFAULT_PERF_MODEL
from ..core.simulation.sim import LAUNCH_SPEC_POLICIES, STOCK_TP, engine_label

TRAINER_MODE = "trainer.v1.trainer_mode=tailsieve"
MTP_ON = "actor_rollout_ref.model.mtp.enable=true actor_rollout_ref.model.mtp.enable_rollout=true"
# verl 0.9.1 merges rollout.engine_kwargs.vllm.speculative_config into the MTP speculative config
# (workers/rollout/vllm_rollout/utils.py build_mtp_speculative_config)
SCHEDULE_KEY = "++actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens_per_batch_size"
ROUTING_ONLY = ("tailsieve", "tailsieve-fixed", "best-static")  # candidates on the clairvoyant reference's engine


@dataclass(frozen=True)
class Candidate:
    """A configuration a user can deploy, its speedup over stock verl, the noise on that speedup (None: not
    measured), and the overrides that turn it on. ``identical``: it never left stock routing (one shared pool
    on every step, stock verl's makespans), so it is stock verl, not a candidate. ``scored``: how the
    speedup was measured, printed after it (e.g. "out of sample"). ``above_reference``: the clairvoyant
    per-sample reference's speedup, where the candidate's is above it (an artefact of a run too short to
    pay for what it deferred): named, not weighed."""

    name: str
    speedup: float
    noise: float | None
    overrides: str
    identical: bool = False
    scored: str = ""
    above_reference: float | None = None


def two_standard_errors(samples) -> float | None:
    """Noise on a mean: two standard errors of ``samples``; None (not measured) where fewer than two or they
    do not vary (a spread of 0 measures nothing: a policy that ran stock verl's routing throughout)."""
    x = np.asarray(samples, dtype=float)
    noise = float(2 * x.std(ddof=1) / np.sqrt(len(x))) if len(x) >= 2 else 0.0
    return noise if noise > 0 else None


def pin_overrides(q: int, m: int) -> str:
    """Overrides that pin the split (q, m): no replica moves, no q adaptation."""
    return (f"++tailsieve.mode=fixed ++tailsieve.q0={q} ++tailsieve.tail_replicas={m} "
            "++tailsieve.controller.inner_loop=false")


def parse_schedule(text: str) -> list[list[int]]:
    """A schedule as the simulator names it (``1-64:3,65-128:1``) in vLLM's list form."""
    return [list(entry) for entry in parse_spec_schedule(text)]


def stock_speculation_overrides(k: int, schedule: list[list[int]] | None = None) -> str:
    """Stock verl with MTP at depth k on every replica, and vLLM's batch-size schedule when given
    (shell-quoted: the list has brackets)."""
    overrides = f"{MTP_ON} actor_rollout_ref.model.mtp.num_speculative_tokens={k}"
    if schedule:
        overrides += f" '{SCHEDULE_KEY}=[{','.join(f'[{lo},{hi},{k}]' for lo, hi, k in schedule)}]'"
    return overrides


def pool_speculation_overrides(pool: str, label: str) -> str:
    """One TailSieve pool's speculation (``off``, ``k=K`` or a schedule, as the simulator names it) as
    ``tailsieve.<pool>`` overrides (shell-quoted where the list has brackets)."""
    if label == "off":
        return f"++tailsieve.{pool}.num_speculative_tokens=0"
    if label.startswith("k="):
        return f"++tailsieve.{pool}.num_speculative_tokens={label.removeprefix('k=')}"
    schedule = parse_schedule(label)
    return (f"++tailsieve.{pool}.num_speculative_tokens={max(k for _, _, k in schedule)} "
            f"'++tailsieve.{pool}.spec_schedule=[{','.join(f'[{lo},{hi},{k}]' for lo, hi, k in schedule)}]'")


def tp_overrides(width: int, max_num_seqs: int | None) -> str:
    """The verl overrides that launch every rollout replica at ``width`` GPUs admitting ``max_num_seqs`` requests."""
    seqs = f" actor_rollout_ref.rollout.max_num_seqs={max_num_seqs}" if max_num_seqs else ""
    return f"actor_rollout_ref.rollout.tensor_model_parallel_size={width}{seqs}"


def adaptive_start(q: int, m: int) -> str:
    """The adaptive controller's start at (q, m); at m = 0, one shared pool, nothing is carried (q0 stays 0)."""
    return f"++tailsieve.q0={q} ++tailsieve.tail_replicas={m}" if m else "++tailsieve.tail_replicas=0"


def speculation_policy_overrides(name: str, choice: str, q: int, m: int, common: str,
                                 start_shared: bool = False) -> str:
    """The overrides that deploy a speculation policy of :mod:`core.simulation.sim` (``verl-spec``, ``verl-dynsd``,
    ``verl-dynsd-best``, ``tailsieve-spec``, ``tailsieve-dynsd``) with its pick ``choice`` (``k=K``, a
    schedule, ``tail K / bulk SCHEDULE``); ``stock verl`` (``verl``) needs none. TailSieve's start at
    (q, m) after ``common`` (trainer mode, perf model); ``start_shared``: tailsieve-dynsd starts at one shared pool."""
    if name == "verl":
        return ""
    if name == "verl-spec":
        return stock_speculation_overrides(int(choice.removeprefix("k=")))
    if name in ("verl-dynsd", "verl-dynsd-best", "tailsieve-dynsd"):
        schedule = parse_schedule(choice)
        stock = stock_speculation_overrides(max(k for _, _, k in schedule), schedule)
        if name != "tailsieve-dynsd":
            return stock
        start = adaptive_start(0, 0) if start_shared else adaptive_start(q, m)
        return f"{common} {start} {stock}"
    if name == "tailsieve-spec":
        tail, bulk = choice.removeprefix("tail ").split(" / bulk ")
        return (f"{common} ++tailsieve.mode=fixed ++tailsieve.q0={max(q, m)} ++tailsieve.tail_replicas={m} "
                f"actor_rollout_ref.model.mtp.enable=true {pool_speculation_overrides('tail', tail)} "
                f"{pool_speculation_overrides('bulk', bulk)}")
    raise ValueError(f"{name} is not a speculation policy")


def perf_model_override(spec: str) -> str:
    """The controller's performance model, Hydra-quoted where the spec needs it; empty for the default."""
    if spec == DEFAULT_PERF_MODEL:
        return ""
    return f"\"++tailsieve.perf_model='{spec}'\"" if any(c in spec for c in "=,") else f"++tailsieve.perf_model={spec}"


def recommendation(candidates: list[Candidate]) -> str:
    """The fastest candidate that beats stock verl by more than its measured noise, as one line; else stay
    with stock verl, naming the best other candidate (with its noise, or "noise not measured") where it is
    faster than stock verl, the closest where none is, those identical to stock verl, and those above the
    clairvoyant reference."""
    same = [c.name for c in candidates if c.identical]
    artefacts = [c for c in candidates if not c.identical and c.above_reference is not None]
    others = [c for c in candidates if not c.identical and c.above_reference is None]
    winners = [c for c in others if c.noise is not None and c.speedup - 1 > c.noise]
    if winners:
        best = max(winners, key=lambda c: c.speedup)
        return (f"recommendation: {best.name} is fastest for this workload, {best.speedup:.3f}× stock verl"
                f"{' ' + best.scored if best.scored else ''} (noise ±{best.noise:.3f}); add to your verl command: "
                f"{best.overrides}")
    reasons = []
    if others:
        best = max(others, key=lambda c: c.speedup)
        scored = f" {best.scored}" if best.scored else ""
        if best.speedup > 1:
            noise = f"noise ±{best.noise:.3f}" if best.noise is not None else "noise not measured: no resolved gain"
            reasons.append(f"nothing here beat it by more than the noise (best: {best.name} {best.speedup:.3f}×"
                           f"{scored}, {noise})")
        else:
            reasons.append(f"nothing here is faster than stock verl (closest: {best.name} "
                           f"{best.speedup:.3f}×{scored})")
    for c in artefacts:
        reasons.append(f"{c.name}'s {c.speedup:.3f}× is above the clairvoyant per-sample reference's "
                       f"{c.above_reference:.3f}×, an artefact of too few steps: not weighed (raise --steps)")
    if same:
        reasons.append(f"{', '.join(same)} never left one shared pool (q = m = 0 on every step): identical to stock verl")
    if not candidates:
        reasons.append("no configuration that can replace it ran here (add tailsieve to --policies)")
    return "recommendation: stay with stock verl: " + "; ".join(reasons)


def width_engine(cfg, choice: str):
    """The engine of ``verl-tp``'s pick ``choice`` (``tp=T``) among a simulation's widths."""
    width = int(choice.removeprefix("tp="))
    return next(e for e in (cfg.engine, *cfg.stock_widths) if e.width == width)


def never_left_stock(r, stock) -> bool:
    """A run that stayed in one shared pool on every step with stock verl's makespans: stock verl itself."""
    return (all(rec.m == 0 and rec.q == 0 and rec.n_tail == 0 for rec in r.records)
            and np.allclose(r.makespans, stock.makespans, rtol=1e-12, atol=0.0))


def from_simulation(result, perf_spec: str) -> str:
    """Recommend from a `tailsieve simulate` run. Policies share their length draws, so each candidate's
    noise is two standard errors of its per-step makespan difference to stock verl (relative to stock
    verl's mean), or verl-redraw's distance from 1 where that is larger (the run's sampling noise). A
    policy that never left stock routing is named identical to stock verl, not weighed."""
    if "verl" not in result.policies:
        return "recommendation: none: add verl to --policies to measure against stock verl"
    stock_run = result.policies["verl"]
    stock = stock_run.makespans
    redraw = abs(1 - result.speedup_vs("verl")["verl-redraw"]) if "verl-redraw" in result.policies else None
    reference = result.speedup_vs("verl").get("clairvoyant-sample")  # routing knowing every length, one step at a time
    common = " ".join(x for x in (TRAINER_MODE, perf_model_override(perf_spec),
                                  "++tailsieve.group_atomic=true" if result.config.group_atomic else "") if x)
    cfg = result.config
    pools = " ".join(pool_speculation_overrides(pool, engine_label(engine))
                     for pool, engine in (("tail", cfg.tail_engine), ("bulk", cfg.bulk_engine)) if engine is not None)
    pools = f" actor_rollout_ref.model.mtp.enable=true {pools}" if pools else ""  # the --tail-*/--bulk-* engines
    candidates = []
    for name, r in result.policies.items():
        last, label = r.records[-1], name
        if name == "tailsieve":
            if pools:
                continue  # per-pool engines are set at launch: the trainer pins the split, so no adaptive m
            overrides = f"{common} {adaptive_start(0, 0)}"  # where the simulation started it
        elif name == "tailsieve-fixed":
            overrides = (f"{common} ++tailsieve.mode=fixed ++tailsieve.q0={max(last.next_q, last.next_m)} "
                         f"++tailsieve.tail_replicas={last.next_m}{pools}")
        elif name == "best-static" and last.next_m > 0:
            overrides = f"{common} {pin_overrides(last.next_q, last.next_m)}{pools}"
            label = f"best-static (q={last.next_q}, m={last.next_m}, the best fixed split in hindsight)"
        elif name in LAUNCH_SPEC_POLICIES:
            overrides = speculation_policy_overrides(name, r.choice, last.next_q, last.next_m, common,
                                                     start_shared=True)
            if name == "verl-spec":
                label = f"stock verl with MTP {r.choice} on every replica (verl-spec, the best depth in hindsight)"
            elif name.startswith("verl-dynsd"):
                label = f"stock verl with MTP on vLLM's batch-size schedule {r.choice} ({name})"
        elif name == STOCK_TP:
            engine = width_engine(cfg, r.choice)
            overrides = tp_overrides(engine.width, engine.max_num_seqs)
            label = f"stock verl at TP{engine.width} ({name}, the best single width in hindsight)"
        else:
            continue  # stock verl itself, group round-robin, or a reference no rollout layer can run
        noises = [x for x in (two_standard_errors((stock - r.makespans) / stock.mean()), redraw) if x]
        speedup = stock_run.mean_makespan_s / r.mean_makespan_s
        # routing alone cannot beat knowing every length (the run's warning); speculation's engines can
        above = (reference if reference is not None and speedup > reference and not pools
                 and name in ROUTING_ONLY else None)
        candidates.append(Candidate(label, speedup, max(noises, default=None), overrides,
                                    identical=never_left_stock(r, stock_run), above_reference=above))
    if pools or set(result.policies) & set(LAUNCH_SPEC_POLICIES):  # the line says where the acceptance came from
        from .engine_args import acceptance_source, assumed_acceptance_refusal
        source = acceptance_source(cfg.speculation)
        if source is None:  # no speculation advice on an assumed acceptance
            candidates = [c for c in candidates if "actor_rollout_ref.model.mtp.enable=true" not in c.overrides]
        return f"{recommendation(candidates)}; " + (f"speculation's acceptance {source}" if source
                                                     else assumed_acceptance_refusal())
    return recommendation(candidates)


def plan_overrides(choice, perf_spec: str) -> str:
    """The overrides that deploy a configuration a plan chose (:class:`core.simulation.planner.Configuration`): TailSieve
    routing-only from its start (q, m), a TailSieve speculation policy, or the stock configuration it
    falls back to ("" for stock verl without speculation)."""
    common = " ".join(x for x in (TRAINER_MODE, perf_model_override(perf_spec)) if x)
    if choice.name == "tailsieve":
        return f"{common} {adaptive_start(choice.q, choice.m)}"
    return speculation_policy_overrides(choice.name, choice.label, choice.q, choice.m, common)


def from_plan(plan, perf_spec: str) -> str:
    """Recommend from a `tailsieve plan`: with speculation, the configuration the plan chose (the best stock
    one where no TailSieve candidate beats it); without, the adaptive controller (its noise: two standard
    errors of its per-seed speedups; identical to stock verl where it never left one shared pool) and the
    best fixed split, quoted out of sample: its speedup on the seeds it was not chosen on, its noise their
    two standard errors. A predicted speedup above the per-prompt oracle's is quoted at the oracle's."""
    if plan.engines is not None:
        choice, stock = plan.engines.choice, plan.engines.best_stock
        overrides = plan_overrides(choice, perf_spec)
        if plan.engines.fallback:
            run = f"stock verl ({choice.name} {choice.label})" if choice.label else "stock verl without speculation"
            return (f"recommendation: fall back to {run}: no TailSieve configuration beat it here"
                    + (f"; add to your verl command: {overrides}" if overrides else ""))
        return (f"recommendation: {choice.name} ({choice.label or 'routing only'}) is fastest for this workload, "
                f"{choice.speedup_vs_best_stock:.3f}× the best stock configuration ({stock.name} {stock.label}); "
                f"add to your verl command: {overrides}")
    adaptive = " ".join(x for x in (TRAINER_MODE, perf_model_override(perf_spec),
                                    adaptive_start(plan.initial_q, plan.initial_m)) if x)
    speedup, capped = plan.speedup, ""
    if plan.above_prompt_oracle:
        speedup, capped = max(1.0, plan.prompt_oracle_speedup), "(capped at the per-prompt oracle)"
    candidates = [Candidate("TailSieve adaptive", speedup, two_standard_errors(plan.per_seed), adaptive,
                            identical=not plan.adaptive_left_stock, scored=capped)]
    if plan.fixed_m > 0 and plan.fixed_out_of_sample:
        scored = f"out of sample (seeds {plan.seeds_chosen_on}–{2 * plan.seeds_chosen_on - 1})"
        candidates.append(Candidate(f"TailSieve pinned at q={plan.fixed_q}, m={plan.fixed_m}",
                                    plan.fixed_out_of_sample_speedup, two_standard_errors(plan.fixed_out_of_sample),
                                    f"{TRAINER_MODE} {pin_overrides(plan.fixed_q, plan.fixed_m)}", scored=scored))
    if plan.widths is not None and plan.widths.switch:
        candidates += width_candidates(plan.widths, perf_spec)
    return recommendation(candidates)


def switch_pays(widths) -> bool:
    """A plan's strongest single width (:class:`core.simulation.planner.WidthPlan`) is not its own and beats stock
    verl at its own by more than two standard errors over the seeds."""
    noise = two_standard_errors(widths.best_per_seed)
    return widths.switch and noise is not None and np.mean(widths.best_per_seed) - 1 > noise


def width_candidates(widths, perf_spec: str) -> list[Candidate]:
    """Stock verl switched to a plan's strongest single width, and adaptive TailSieve on it where it left one shared
    pool there, each over stock verl at the plan's own width (noise: two standard errors over the seeds)."""
    switch = tp_overrides(widths.best, widths.best_max_num_seqs)
    out = [Candidate(f"stock verl at TP{widths.best}", float(np.mean(widths.best_per_seed)),
                     two_standard_errors(widths.best_per_seed), switch)]
    if widths.tailsieve_left_stock:
        adaptive = " ".join(x for x in (TRAINER_MODE, perf_model_override(perf_spec), adaptive_start(0, 0)) if x)
        out.append(Candidate(f"TailSieve adaptive on TP{widths.best}", float(np.mean(widths.tailsieve_vs_width)),
                             two_standard_errors(widths.tailsieve_vs_width), f"{adaptive} {switch}"))
    return out
