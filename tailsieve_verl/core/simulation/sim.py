"""Multi-step closed-loop simulator: routing policies side by side on one prompt stream.

Every policy consumes ``batch_size`` (B) groups × ``n`` responses per step on ``n_replicas`` (R)
replicas; lengths are drawn fresh at every (re)generation from a :class:`core.data.workload.PromptPool`
(persistent prompt difficulty), and every pool is timed by the one evaluator,
:func:`core.engine.replica.evaluate_samples`, with the given performance model and engine
(``SimConfig.engine`` on every replica; a TailSieve step puts ``tail_engine`` on its m tail replicas
and ``bulk_engine`` on the rest, :meth:`SimConfig.pool_engines`).

Policies:

* ``verl`` — stock verl 0.9.1: B fresh groups, every sample to the least-in-flight replica (a group
  spreads over all replicas). The baseline: speedups are reported against it first.
* ``verl-redraw`` — stock verl on the same prompt stream with its own, independent length draws:
  how far two runs of one policy differ by sampling alone, the noise floor of every speedup
  (opt-in). All other policies share their draws (see ``_Runner.draw_key``).
* ``uniform`` — B fresh groups round-robin over all replicas, groups atomic (the paper's baseline).
* ``tailsieve-fixed`` — TailSieve with the tail pool pinned (``fixed_tail_replicas``, default R/2)
  and only the inner q loop.
* ``tailsieve`` — TailSieve with both loops, starting from one shared pool (0, 0).
* ``best-static`` — hindsight reference for the controller: the TailSieve mechanism with every fixed
  (q, m) of :func:`static_grid` (inner loop off, (0, 0) = one shared pool included) on the same
  prompt stream; reports the one with the lowest mean makespan. What a perfect static controller
  reaches. Opt-in: one TailSieve run per grid point; ``best_static_screen`` stops all but the best
  few after the first steps (a screened grid: a lower bound on the full grid's best).
* ``verl-spec`` / ``verl-dynsd`` / ``verl-dynsd-best`` — stock verl's routing with speculative decoding
  on every replica (``SimConfig.speculation``: acceptance, draft cost): each depth of ``spec_depths``, the
  best in hindsight (its k named); vLLM's documented batch-size schedule (:func:`vllm_doc_schedule`); the
  best schedule of :func:`schedule_grid` in hindsight. With ``verl`` these are the stock configurations;
  ``best_stock`` names the fastest, the bar TailSieve must clear (opt-in).
* ``verl-tp`` — stock verl at every single tensor-parallel width of the run's GPUs (TP t × G/t replicas,
  ``SimConfig.stock_widths``), the fastest in hindsight, its width named (:class:`SingleWidthRunner`): a
  stock configuration, weighed by ``best_stock`` (opt-in; ``simulate`` and ``plan`` run it where the model
  shape gives each width's KV cache).
* ``tailsieve-spec`` — TailSieve with route-specialised speculation: the tail pool (pinned at
  ``fixed_tail_replicas``) at the deepest k, the bulk pool on vLLM's schedule; q adapts.
  ``tailsieve-dynsd`` — adaptive TailSieve with vLLM's schedule on every replica, m free (opt-in). The
  controller's prior and yardstick stay on the engine without limits (a known gap).
* ``tailsieve-auto`` — TailSieve that falls back to stock verl with speculation, decided online
  (:mod:`core.tailsieve.fallback`): each step either the split (tail pool pinned at ``fixed_tail_replicas`` at the
  deepest k, the bulk pool on the stock engine) or one shared pool with stock verl's routing and the
  stock engine on every replica. The stock engine is the stock speculative configuration
  (:func:`stock_engines`) with the least replayed makespan on the steps observed so far. The engines
  switch per step for free here; a deployment restarts them (or runs one schedule everywhere).
* ``clairvoyant-split`` — knows this step's lengths: the best of a small grid of splits, the longest
  groups on a tail pool at the deepest speculation (or on ``engine``), the rest by stock verl's
  routing on ``engine``, one shared pool included (:class:`ClairvoyantSplitRunner`; opt-in). On the
  best stock configuration's engine, the ceiling of route-specialised speculation over it.
* ``group-oracle-split`` — the same grid, routing-only (the tail pool on ``engine``), the groups ranked by
  their true tokens: the routing ceiling of a tail split (:class:`GroupOracleSplitRunner`; opt-in).
* ``prompt-oracle-split`` — the same grid, routing-only (the tail pool on ``engine``), with the groups
  ranked by each prompt's true typical length (:meth:`PromptPool.typical_length`: its median under this
  step's policy, nothing of this step's samples) instead of their true tokens: the best any per-prompt
  predictor of lengths can do (:class:`PromptOracleSplitRunner`; opt-in). The gap to
  ``clairvoyant-split`` is what per-sample chance costs; the gap from TailSieve to it, what its signal misses.
* ``history-oracle-split`` — ``prompt-oracle-split`` knowing each prompt only as far as its earlier steps
  can tell (its difficulty, the checkpoint and the trend, not this step's prompt × checkpoint
  interaction): the ceiling of any per-prompt record (:class:`HistoryOracleSplitRunner`; opt-in).
* ``record-oracle-split`` — adaptive TailSieve whose per-prompt record is replaced by the truth: every
  step planned by its step planner (:mod:`core.simulation.step_split`) on each prompt's true length
  distribution (:meth:`PromptPool.typical_group`) from the first step on (:class:`RecordOracleSplitRunner`;
  opt-in). The gap from TailSieve to it is what the record's predictions miss; its gap to
  ``prompt-oracle-split``, what the mechanism costs.
* ``record-history-oracle-split`` — the same, its record fed each prompt only as far as its earlier steps can
  tell (``history-oracle-split``'s knowledge): the most TailSieve's planned steps could reach from any
  number of visits (:class:`RecordHistoryOracleSplitRunner`; opt-in).
* ``clairvoyant-group`` / ``clairvoyant-sample`` — know this step's lengths: the B fresh groups
  (or their single samples) routed ``topk-balanced`` (:mod:`core.routing.policies`) with the best (k, m),
  searched coarse-to-fine within ``oracle_time_limit_s`` per step, on ``SimConfig.engine`` (no per-pool
  engines, no speculation unless the engine has it). References, not policies one
  can deploy. TailSieve shifts a long group by at most one step (``max_deferral_steps``), so it can
  edge past them only by that shift: a larger gap is a bug until shown otherwise (``warnings()``).

A TailSieve step (see :mod:`core.tailsieve.selector`): the tail pool (m replicas) regenerates the T top-scored
carried candidates; the bulk pool (R − m) runs the other candidates and new prompts, ``B − T + a``
groups; within each pool every sample goes to the least-in-flight replica like stock verl does
(``group_atomic``: whole groups round-robin, the paper's setting). The requeued candidates run to
completion; once ``B − C`` fresh groups have finished (the cutoff), the ``a`` fresh ones still running
are aborted, and the tokens each had generated by then are its score as a candidate next step
(:func:`core.tailsieve.selector.bulk_cutoff`). Makespan = max(tail pool done, the bulk pool's last consumed group).
When nothing is carried the tail replicas join the bulk pool, except replicas launched with a tail engine of
their own (per-pool engines on a pinned split), which stay idle as the trainer leaves them; at q = 0 (one shared pool) every
candidate runs in the bulk pool and nothing is aborted. Aborted work before the cutoff is
reported as wasted tokens. A ledger checks every prompt is consumed exactly once, by the policy
version of its step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from ..engine.perf import PerfModel
from ..tailsieve.controller import ControllerConfig
from ..data.workload import PromptPool
from .forked import forked_map
from .config import (ALL_POLICIES, BASELINE, Execute, LAUNCH_SPEC_POLICIES, POLICIES, POOL_ENGINE_POLICIES,
                     REFERENCE_SPLITS, SimConfig, SimError, SPEC_POLICIES, STOCK_POLICIES, STOCK_SPEC_POLICIES,
                     STOCK_TP)
from .results import (GroupSpan, PolicyResult, SimResult, StepRecord)
from .runners import (_Runner, FallbackRunner, Ledger, prompt_of, PromptStream, StaticRunner, step_times,
                      TailSieveRunner)
from .references import (BestStaticRunner, ClairvoyantSplitRunner, GroupOracleSplitRunner, HindsightRunner,
                         PromptOracleSplitRunner, HistoryOracleSplitRunner, RecordOracleSplitRunner,
                         RecordHistoryOracleSplitRunner, SingleWidthRunner, static_grid, static_split_runner,
                         stock_spec_runner)
from .split_planner import planner_for
from .step_split import step_planner_for
from .speculation import (DEFAULT_SPECULATION, engine_label, schedule_grid, schedule_text, SPEC_DEPTHS, spec_label,
                          stock_engines, tailsieve_spec_config, vllm_doc_schedule, with_speculation)

__all__ = ["ALL_POLICIES", "BASELINE", "BestStaticRunner", "ClairvoyantSplitRunner", "DEFAULT_SPECULATION", "GroupOracleSplitRunner",
           "Execute", "FallbackRunner", "GroupSpan", "HindsightRunner", "LAUNCH_SPEC_POLICIES", "Ledger",
           "POLICIES", "POOL_ENGINE_POLICIES", "PolicyResult", "PromptOracleSplitRunner", "PromptStream",
           "RecordHistoryOracleSplitRunner", "RecordOracleSplitRunner",
           "REFERENCE_SPLITS", "SPEC_DEPTHS", "SPEC_POLICIES", "STOCK_POLICIES", "STOCK_SPEC_POLICIES", "SimConfig",
           "SimError", "SimResult", "StaticRunner", "StepRecord", "TailSieveRunner", "engine_label", "prompt_of",
           "schedule_grid", "schedule_text", "spec_label", "static_grid", "static_split_runner", "step_times",
           "stock_engines", "stock_spec_runner", "tailsieve_spec_config", "STOCK_TP", "SingleWidthRunner", "vllm_doc_schedule",
           "with_speculation",
           "adaptive_runner", "build_runners", "planner_for", "simulate", "simulate_runs"]


def build_runners(cfg: SimConfig, pool: PromptPool, perf: PerfModel,
                  execute: Execute | None = None) -> list[_Runner | HindsightRunner]:
    runners: list[_Runner | HindsightRunner] = []
    for name in cfg.policies:
        if (name in SPEC_POLICIES or name in REFERENCE_SPLITS) and execute is not None:
            raise SimError(f"{name} runs on the engine model; a real engine (execute) is configured per launch")
        if name in StaticRunner.NAMES:
            runners.append(StaticRunner(cfg, pool, perf, name, execute))
        elif name in STOCK_SPEC_POLICIES:
            runners.append(stock_spec_runner(cfg, pool, perf, name))
        elif name == STOCK_TP:
            runners.append(SingleWidthRunner(cfg, pool, perf, name))
        elif name == "tailsieve-auto":
            runners.append(FallbackRunner(cfg, pool, perf, name))
        elif name == "clairvoyant-split":
            runners.append(ClairvoyantSplitRunner(cfg, pool, perf, name))
        elif name == "group-oracle-split":
            runners.append(GroupOracleSplitRunner(cfg, pool, perf, name))
        elif name == "prompt-oracle-split":
            runners.append(PromptOracleSplitRunner(cfg, pool, perf, name))
        elif name == "history-oracle-split":
            runners.append(HistoryOracleSplitRunner(cfg, pool, perf, name))
        elif name in ("record-oracle-split", "record-history-oracle-split"):
            adaptive = replace(cfg.controller, fixed_tail_replicas=None)
            kind = RecordOracleSplitRunner if name == "record-oracle-split" else RecordHistoryOracleSplitRunner
            runners.append(kind(cfg, pool, perf, name, planner_for(adaptive, cfg, perf)))
        elif name == "best-static":
            runners.append(BestStaticRunner(cfg, pool, perf, name, execute))
        elif name in ("tailsieve", "tailsieve-dynsd"):
            run_cfg = cfg if name == "tailsieve" else tailsieve_spec_config(cfg, name)
            runners.append(adaptive_runner(run_cfg, pool, perf, name, execute=execute))
            runners[-1].result.choice = "" if name == "tailsieve" else spec_label(run_cfg)
        else:  # tailsieve-fixed, and tailsieve-spec: per-pool engines are set at launch, so the split is pinned
            fixed = replace(cfg.controller, fixed_tail_replicas=cfg.fixed_m,
                            q_init=max(1, cfg.controller.q_init or cfg.batch_size // 16))
            run_cfg = tailsieve_spec_config(cfg, name) if name == "tailsieve-spec" else cfg
            runners.append(TailSieveRunner(run_cfg, pool, perf, fixed, name, execute))
            runners[-1].result.choice = spec_label(run_cfg) if name == "tailsieve-spec" else ""
    return runners


def adaptive_runner(cfg: SimConfig, pool: PromptPool, perf: PerfModel, name: str, controller: ControllerConfig | None = None,
                    execute: Execute | None = None) -> TailSieveRunner:
    """Adaptive TailSieve (m free) on ``controller`` (default: ``cfg.controller``), with its split planner."""
    adaptive = replace(controller or cfg.controller, fixed_tail_replicas=None)
    return TailSieveRunner(cfg, pool, perf, adaptive, name, execute, planner_for(adaptive, cfg, perf),
                           step_planner_for(adaptive, cfg, perf))


def simulate(cfg: SimConfig, pool: PromptPool, perf: PerfModel, workload_name: str = "",
             progress: Callable[[int, int], None] | None = None, execute: Execute | None = None,
             jobs: int = 1) -> SimResult:
    """Run every policy of ``cfg`` for ``cfg.steps`` steps; ``progress(done, total)`` after each step
    (with ``jobs`` > 1, after each policy's last). ``execute`` runs each step's samples (default: the
    performance model; see :data:`Execute`). ``jobs``: processes that run the policies side by side
    (the same results: a policy's run depends on nothing another does)."""
    return simulate_runs([(cfg, pool)], perf, workload_name, progress, execute, jobs)[0]


def simulate_runs(runs: Sequence[tuple[SimConfig, PromptPool]], perf: PerfModel, workload_name: str = "",
                  progress: Callable[[int, int], None] | None = None, execute: Execute | None = None,
                  jobs: int = 1) -> list[SimResult]:
    """:func:`simulate` of several runs (a plan's seeds); with ``jobs`` > 1 their policies in one pool of forked
    processes, the costliest first (:func:`_cost`), so that no process idles while another ends a long run it
    started last."""
    built = []
    for cfg, pool in runs:
        cfg.validate()
        if len(pool) < 2 * cfg.batch_size:
            raise SimError(f"the prompt pool has {len(pool)} prompts; the simulation needs at least 2 × batch = "
                           f"{2 * cfg.batch_size} (a prompt is in flight at most once)")
        runners = build_runners(cfg, pool, perf, execute)
        for runner in runners:
            if cfg.start_step:
                runner.skip_to(cfg.start_step)
        steps = range(cfg.start_step, cfg.start_step + cfg.steps)
        built.append((runners, steps, steps[-1] if cfg.gantt_step is None else cfg.gantt_step))
    total = sum(len(runners) * len(steps) for runners, steps, _ in built)
    if jobs > 1 and execute is None and sum(len(runners) for runners, _, _ in built) > 1:
        # With a run for every process, a run's policies share one (and its length draws, drawn once per step),
        # but a hindsight reference, the costliest, runs in its own; with fewer runs, every policy runs in its own.
        tasks = []
        for k, (runners, steps, _) in enumerate(built):
            alone = [j for j, r in enumerate(runners) if len(built) < jobs or isinstance(r, HindsightRunner)]
            rest = [j for j in range(len(runners)) if j not in alone]
            tasks += [[(k, j)] for j in alone] + ([[(k, j) for j in rest]] if rest else [])
        tasks.sort(key=lambda task: -sum(_cost(built[k][0][j], len(built[k][1])) for k, j in task))

        def run_task(i: int) -> list[PolicyResult]:
            k = tasks[i][0][0]
            return _run_lockstep([built[k][0][j] for _, j in tasks[i]], *built[k][1:])

        ended = forked_map(run_task, len(tasks), jobs, done=None if progress is None else lambda n: progress(
            sum(len(tasks[i]) * len(built[tasks[i][0][0]][1]) for i in range(n)), total))
        by_pair = {pair: result for task, results in zip(tasks, ended) for pair, result in zip(task, results)}
        results = [[by_pair[k, j] for j in range(len(runners))] for k, (runners, _, _) in enumerate(built)]
    else:
        done = iter(range(1, total + 1))
        results = [_run_lockstep(runners, steps, keep, None if progress is None else lambda: progress(next(done), total))
                   for runners, steps, keep in built]
    return [SimResult(cfg, workload_name or pool.spec.name, getattr(perf, "name", str(perf)),
                      {r.name: result for r, result in zip(runners, ended_results)})
            for (cfg, pool), (runners, _, _), ended_results in zip(runs, built, results)]


def _cost(runner, steps: int) -> int:
    """A runner's rough cost in pinned-split steps, to start the costliest first: a hindsight reference runs one
    runner per choice, a TailSieve run with a split planner adds the planner's race, any other one runs its steps."""
    if isinstance(runner, HindsightRunner):
        return len(runner.runners) * steps
    planner = getattr(runner.cycle.controller, "planner", None) if isinstance(runner, TailSieveRunner) else None
    return steps + (planner.pinned_steps if planner is not None else 0)


def _run_lockstep(runners: list, steps: range, keep: int, stepped: Callable[[], None] | None = None) -> list[PolicyResult]:
    """The runners' runs, step by step together (so that they share each step's length draws: ``_Runner.sample``);
    ``stepped()`` after each runner's step."""
    for t in steps:
        for runner in runners:
            runner.step(t, keep=t == keep)
            if stepped is not None:
                stepped()
    return [runner.finish() for runner in runners]


