from __future__ import annotations

import pytest

from tailsieve_verl.core.simulation import planner
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.simulation.planner import PlanError, plan_from_trace
from tailsieve_verl.core.data.workload import generate_trace
from tailsieve_verl.core.simulation.config import SimConfig, SimError
from tailsieve_verl.core.simulation.references import static_grid


def test_plan_reports_speedup_band_and_start_point():
    trace = generate_trace("strong", 96, 4, seed=0)
    plan = plan_from_trace(trace, 4, parse_perf_model("table:h200-dense"), batch_size=16, steps=6, seeds=3)
    assert plan.band[0] <= plan.speedup <= plan.band[1]
    assert len(plan.per_seed) == 3 and all(s > 0 for s in plan.per_seed)
    assert 0 <= plan.initial_m < 4 and plan.initial_q >= 0
    assert (plan.initial_q == 0) == (plan.initial_m == 0)
    assert plan.n == 4 and plan.prompts == 96
    assert set(plan.to_json()) >= {"predicted_speedup", "band", "initial_q", "initial_m", "fixed_q", "fixed_m",
                                   "fixed_speedup"}


def test_the_fixed_split_is_never_worse_than_one_shared_pool_on_the_planned_streams():
    """One shared pool is always a candidate, so the pinned split's mean speedup on the seeds it was chosen on
    is at least its ~1.0; the split is scored again on as many seeds it was not chosen on."""
    trace = generate_trace("weak", 96, 4, seed=0)
    plan = plan_from_trace(trace, 4, parse_perf_model("table:h200-moe"), batch_size=16, steps=9, seeds=2)
    assert (plan.fixed_q == 0) == (plan.fixed_m == 0) and 0 <= plan.fixed_m < 4
    assert plan.fixed_speedup >= 0.999
    assert len(plan.fixed_out_of_sample) == 2 and plan.to_json()["scored_on_seeds"] == [2, 3]


def _seed_runs(patch) -> list:
    """Collects the plan's seed simulations as (config, result) pairs: every policy of every seed it chooses on, run
    by :func:`simulate_runs` (beside stock verl alone on the held-out seeds that score the fixed split, left out)."""
    seen, real = [], planner.simulate_runs

    def spy(runs, *args, **kwargs):
        results = real(runs, *args, **kwargs)
        seen.extend((cfg, result) for (cfg, _), result in zip(runs, results) if "tailsieve" in cfg.policies)
        return results

    patch.setattr(planner, "simulate_runs", spy)
    return seen


def test_the_planned_runs_do_not_use_the_per_prompt_record(monkeypatch):
    """A logged run's prompts recur every few steps in the planner's pool, far more often than in training;
    the record would exploit that (scripts/results/controller_vs_stock_verl/controller_v2_log.md, 2026-12-01, f610ae8),
    so the plan is a first epoch."""
    seen = _seed_runs(monkeypatch)
    plan_from_trace(generate_trace("weak", 64, 4, seed=0), 4, parse_perf_model("table:h200-moe"), batch_size=16,
                    steps=3, seeds=2)
    assert [cfg.seed for cfg, _ in seen if "tailsieve" in cfg.policies] == [0, 1]
    assert not any(cfg.prompt_record for cfg, _ in seen)


def test_plan_refuses_a_batch_larger_than_the_trace():
    trace = generate_trace("real", 20, 4, seed=0)
    with pytest.raises(PlanError, match="needs at least 21 groups"):
        plan_from_trace(trace, 4, parse_perf_model("table:h200-dense"), batch_size=21)


def test_a_trace_smaller_than_two_batches_is_planned_from_copies_of_its_groups():
    # 20 groups at a batch of 16: a step draws from 32 prompts, so each group is there twice, its copies
    # resampling the group's observed lengths
    trace = generate_trace("real", 20, 4, seed=0)
    pool = planner.prompt_pool(trace, 16, seed=0)
    assert len(pool) == 40 and {pid.rpartition("~")[0] for pid in pool.prompt_ids} == {g.prompt_id for g in trace}
    plan = plan_from_trace(trace, 4, parse_perf_model("table:h200-dense"), batch_size=16, steps=3, seeds=1)
    assert (plan.batch_size, plan.prompts, plan.prompt_copies) == (16, 20, 2)
    assert planner.prompt_copies(64, 16) == 1


def _planned(monkeypatch, preset: str, speculation, **kwargs):
    """A small plan with speculation (4 replicas, 16 x 4, 6 steps, 2 seeds) and the simulations behind it."""
    seen = _seed_runs(monkeypatch)
    plan = plan_from_trace(generate_trace(preset, 96, 4, seed=0), 4, parse_perf_model("table:h200-dense"),
                           batch_size=16, steps=6, seeds=2, speculation=speculation, **kwargs)
    return plan, [result for _, result in seen]


def _mean_steady(results, name, steps=6):
    import numpy as np

    return float(np.mean([r.policies[name].window_mean_s(slice(steps // 3, None)) for r in results]))


def test_the_plan_with_speculation_names_the_fastest_stock_configuration_and_chooses_the_fastest(monkeypatch):
    """Every stock configuration and TailSieve candidate runs on the same seeds; the best stock configuration is
    the stock policy with the least mean steady-state makespan, the choice the fastest of all."""
    from tailsieve_verl.core.simulation.sim import DEFAULT_SPECULATION, STOCK_POLICIES

    plan, results = _planned(monkeypatch, "strong", DEFAULT_SPECULATION)
    assert len(results) == 2 and all(set(STOCK_POLICIES) | {"tailsieve-spec", "tailsieve-dynsd"} <= set(r.policies)
                                     for r in results)
    engines = plan.engines
    fastest_stock = min(STOCK_POLICIES, key=lambda name: _mean_steady(results, name))
    assert engines.best_stock.name == fastest_stock
    assert engines.best_stock.label == results[0].policies[fastest_stock].choice  # both seeds pick it here
    names = [c.name for c in engines.candidates]
    assert names == ["tailsieve", "tailsieve-spec", "tailsieve-dynsd"]
    fastest = min([fastest_stock, *names], key=lambda name: _mean_steady(results, name))
    assert engines.choice.name == fastest and engines.fallback == (fastest == fastest_stock)
    # either the best stock configuration itself (at 1.0) or a candidate that beats it: on these 6 steps of
    # strong tails no split pays the controller's probe margin, and the plan falls back
    assert (engines.choice == engines.best_stock and engines.choice.speedup_vs_best_stock == 1.0 if engines.fallback
            else engines.choice.speedup_vs_best_stock > 1)
    lo, hi = engines.choice.band_vs_best_stock
    assert lo <= engines.choice.speedup_vs_best_stock <= hi
    spec = next(c for c in engines.candidates if c.name == "tailsieve-spec")
    assert spec.engines == {"tail": "k=6", "bulk": "1-64:3,65-128:1,129-256:0"} and spec.m == 2
    assert set(plan.to_json()) >= {"best_stock", "speedup_vs_best_stock", "choice"}


def test_the_plan_falls_back_to_stock_speculation_where_tailsieve_cannot_win(monkeypatch):
    """Near-perfect acceptance at no draft cost: the deepest k on every replica is far ahead, no TailSieve
    candidate beats it, and the plan says to fall back to it, with its overrides."""
    from tailsieve_verl.cli.recommend import from_plan, stock_speculation_overrides
    from tailsieve_verl.core.engine.engine import SpeculativeConfig

    plan, results = _planned(monkeypatch, "real", SpeculativeConfig(3, (0.99,), draft_cost=0.0))
    engines = plan.engines
    assert engines.fallback and engines.choice == engines.best_stock
    assert engines.best_stock.name == "verl-spec" and engines.best_stock.label == "k=6"
    assert all(c.speedup_vs_best_stock < 1 for c in engines.candidates)
    assert all(_mean_steady(results, c.name) > _mean_steady(results, "verl-spec") for c in engines.candidates)
    line = from_plan(plan, "table:h200-dense")
    assert line.startswith("recommendation: fall back to stock verl (verl-spec k=6)")
    assert line.endswith(stock_speculation_overrides(6))


def test_without_speculation_the_plan_does_not_choose_engines():
    plan = plan_from_trace(generate_trace("weak", 64, 4, seed=0), 4, parse_perf_model("table:h200-dense"),
                           batch_size=16, steps=3, seeds=1)
    assert plan.engines is None and "best_stock" not in plan.to_json()


def test_the_plan_refuses_an_engine_that_already_speculates():
    from tailsieve_verl.core.engine.engine import EngineConfig
    from tailsieve_verl.core.simulation.sim import DEFAULT_SPECULATION

    with pytest.raises(PlanError, match="give the engine without it"):
        plan_from_trace(generate_trace("weak", 64, 4, seed=0), 4, parse_perf_model("table:h200-dense"), batch_size=16,
                        steps=3, seeds=1, engine=EngineConfig(speculative=DEFAULT_SPECULATION),
                        speculation=DEFAULT_SPECULATION)


def test_the_plan_measures_tailsieve_against_the_best_per_prompt_predictor():
    """prompt-oracle-split runs on the planned streams: its speedup is the one the simulation measured,
    and the share of its gain TailSieve reaches is (TailSieve - 1) / (oracle - 1)."""
    trace = generate_trace("weak", 96, 4, seed=0)
    with pytest.MonkeyPatch.context() as patch:
        seen = _seed_runs(patch)
        plan = plan_from_trace(trace, 4, parse_perf_model("table:h200-moe"), batch_size=16, steps=6, seeds=2, jobs=1)
    steady = slice(2, None)
    expected = sum(r.speedup_vs("verl", steady)["prompt-oracle-split"] for _, r in seen) / len(seen)
    assert plan.prompt_oracle_speedup == pytest.approx(expected)
    assert plan.prompt_oracle_speedup > 1.01  # weak tails on the MoE table: per-prompt isolation pays
    assert plan.share_of_prompt_oracle_gain == pytest.approx((plan.speedup - 1) / (plan.prompt_oracle_speedup - 1))
    assert plan.to_json()["prompt_oracle_speedup"] == plan.prompt_oracle_speedup


def test_seeds_simulated_side_by_side_give_the_same_plan():
    trace = generate_trace("real", 64, 4, seed=1)
    args = dict(batch_size=16, steps=3, seeds=2)
    alone = plan_from_trace(trace, 4, parse_perf_model("table:h200-dense"), jobs=1, **args)
    forked = plan_from_trace(trace, 4, parse_perf_model("table:h200-dense"), jobs=2, **args)
    assert forked.to_json() == alone.to_json()


def test_the_plan_searches_the_coarse_grid_a_subset_of_the_full_one():
    full, coarse = static_grid(8, 512), static_grid(8, 512, coarse=True)
    assert coarse[0] == (0, 0) and set(coarse) < set(full)
    assert {m for _, m in coarse[1:]} == {1, 2, 3, 4, 6} and max(q for q, _ in coarse) == 128
    assert len(coarse) < 0.6 * len(full)
    with pytest.raises(SimError, match="best_static_grid must be 'full' or 'coarse'"):
        SimConfig(best_static_grid="fine").validate()


def test_the_fixed_split_is_scored_on_best_statics_own_runs(monkeypatch):
    """Best-static ran every split of its grid on every seed (6 steps: its screen, after 8, never stops one): the
    fixed-split search reads each seed's best split and one shared pool on every seed from those runs (the same
    makespans as a pinned run of the split) and simulates none; only the seeds it scores the pick on run it pinned."""
    rerun = []
    real_runner = planner.static_split_runner

    def spy(cfg, pool, perf, split, name, *args):
        rerun.append((split, cfg.seed))
        return real_runner(cfg, pool, perf, split, name, *args)

    monkeypatch.setattr(planner, "static_split_runner", spy)
    captured = {}
    real_best = planner._best_fixed_split

    def capture(runs, *args):
        captured["runs"] = runs
        return real_best(runs, *args)

    monkeypatch.setattr(planner, "_best_fixed_split", capture)
    seen = _seed_runs(monkeypatch)
    trace = generate_trace("weak", 96, 4, seed=0)
    plan = plan_from_trace(trace, 4, parse_perf_model("table:h200-moe"), batch_size=16, steps=6, seeds=2)
    runs = captured["runs"]
    splits = {(0, 0)} | {run.best_split for run in runs}
    assert (plan.fixed_q, plan.fixed_m) in splits
    steady = slice(2, None)
    for seed, run in enumerate(runs):  # a split's makespans from best-static's grid are a pinned run's
        for split in splits:
            cfg = next(cfg for cfg, _ in seen if cfg.seed == seed)
            pinned = real_runner(cfg, planner.prompt_pool(trace, 16, seed), parse_perf_model("table:h200-moe"), split, "fixed")
            for t in range(cfg.steps):
                pinned.step(t, keep=False)
            assert run.split_s[split] == pinned.finish().window_mean_s(steady)
    # scored on seeds 2 and 3, which it was not chosen on, and nothing else run again
    assert rerun == [((plan.fixed_q, plan.fixed_m), 2), ((plan.fixed_q, plan.fixed_m), 3)]
    assert len(plan.fixed_out_of_sample) == 2


def test_splits_best_statics_screen_stopped_are_run_pinned_for_the_fixed_split(monkeypatch):
    """Where best-static's screen stopped a split on a seed (here after 2 steps, keeping 1), the fixed-split search
    runs it pinned there: the pick and its speedup are those of every (split, seed) pair run pinned."""
    trace, perf = generate_trace("strong", 96, 4, seed=0), parse_perf_model("table:h200-dense")
    captured, real_best, rerun, real_runner = {}, planner._best_fixed_split, [], planner.static_split_runner

    def capture(runs, *args):
        captured["runs"] = [run._replace(split_s=dict(run.split_s)) for run in runs]  # as best-static left them
        return real_best(runs, *args)

    def spy(cfg, pool, perf, split, name, *args):
        rerun.append((split, cfg.seed))
        return real_runner(cfg, pool, perf, split, name, *args)

    monkeypatch.setattr(planner, "_best_fixed_split", capture)
    monkeypatch.setattr(planner, "static_split_runner", spy)
    monkeypatch.setattr(planner, "SimConfig", lambda **kw: SimConfig(**kw, best_static_screen=(2, 1)))
    plan = planner.plan_from_trace(trace, 4, perf, batch_size=16, steps=6, seeds=2)
    runs = captured["runs"]
    splits = sorted({(0, 0)} | {run.best_split for run in runs})
    missing = {(split, seed) for split in splits for seed, run in enumerate(runs) if split not in run.split_s}
    assert missing and {pair for pair in rerun if pair[1] < 2} == missing
    speedup = {split: sum(run.stock_s / planner._pinned_steady_mean(run.cfg, run.pool, perf, split, slice(2, None))
                          for run in runs) / len(runs) for split in splits}
    pick = max(speedup, key=speedup.get)
    assert (plan.fixed_q, plan.fixed_m) == pick and plan.fixed_speedup == pytest.approx(speedup[pick], rel=1e-12)


def test_a_short_plan_charges_the_work_it_defers_past_its_last_step():
    """64 prompts of real tails, 3 steps at B = 64 (issue 47): the adaptive controller splits on the last step
    only, aborting the long groups. Uncharged, seed 1 read 1.213x (mean 1.106x) over stock verl, above the
    per-prompt oracle (0.995x); the last step paid as if it ran its aborted groups to their end, not."""
    plan = plan_from_trace(generate_trace("real", 64, 8, seed=0), 8, parse_perf_model("table:h200-dense"),
                           batch_size=64, steps=3, seeds=2)
    assert max(plan.per_seed) < 1.02 and not plan.above_prompt_oracle


def test_the_window_mean_pays_the_last_steps_deferred_work():
    from tailsieve_verl.core.simulation.results import PolicyResult, StepRecord

    def record(t, makespan, deferred):
        return StepRecord(step=t, makespan_s=makespan, q=1, m=1, n_tail=1, tail_s=0.0, bulk_s=makespan,
                          wasted_tokens=0, consumed_tokens=1, consumed_lengths=(1,), replica_busy_s=(makespan,),
                          next_q=1, next_m=1, deferred_s=deferred)

    run = PolicyResult("tailsieve", [record(0, 10.0, 4.0), record(1, 8.0, 6.0), record(2, 7.0, 5.0)])
    assert run.window_mean_s(slice(1, None)) == pytest.approx((8 + 7 + 5) / 2)  # carried-in work is paid inside
    assert run.window_mean_s(slice(0, 2)) == pytest.approx((10 + 8 + 6) / 2)
    assert run.mean_makespan_s == pytest.approx((10 + 8 + 7 + 5) / 3)
    with pytest.raises(ValueError, match="holds none"):
        run.window_mean_s(slice(5, None))


def test_one_logged_step_is_planned_at_its_own_batch():
    from tailsieve_verl.core.data.trace import Group, Trace

    step = generate_trace("real", 48, 8, seed=0)
    assert planner.trace_batch(step) == (48, "the trace's groups: it holds one step")
    pool = Trace(tuple(Group(f"p{i}", (100,) * (8 * (1 + i % 3))) for i in range(48)), name="pool")
    batch, why = planner.trace_batch(pool)
    assert batch == 24 and "several steps" in why
