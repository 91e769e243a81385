from __future__ import annotations

import pytest

from tailsieve_verl.core.perf import parse_perf_model
from tailsieve_verl.core.planner import PlanError, plan_from_trace
from tailsieve_verl.core.workload import generate_trace


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
    """One shared pool is always a candidate, so the pinned split's mean speedup is at least its ~1.0;
    on weak tails, where isolation pays, a split with a tail pool wins."""
    trace = generate_trace("weak", 96, 4, seed=0)
    plan = plan_from_trace(trace, 4, parse_perf_model("table:h200-moe"), batch_size=16, steps=9, seeds=2)
    assert (plan.fixed_q == 0) == (plan.fixed_m == 0) and 0 <= plan.fixed_m < 4
    assert plan.fixed_speedup >= 0.999
    assert plan.fixed_m > 0  # the docstring's second half: a tail pool wins on weak tails


def test_the_planned_runs_do_not_use_the_per_prompt_record(monkeypatch):
    """A logged run's prompts recur every few steps in the planner's pool, far more often than in training;
    the record would exploit that (scripts/results/controller_vs_stock_verl/controller_v2_log.md, session 9),
    so the plan is a first epoch."""
    from tailsieve_verl.core import planner

    configs, real_simulate = [], planner.simulate

    def spy(cfg, *args, **kwargs):
        configs.append(cfg)
        return real_simulate(cfg, *args, **kwargs)

    monkeypatch.setattr(planner, "simulate", spy)
    plan_from_trace(generate_trace("weak", 64, 4, seed=0), 4, parse_perf_model("table:h200-moe"), batch_size=16,
                    steps=3, seeds=2)
    assert len(configs) == 2 and not any(cfg.prompt_record for cfg in configs)


def test_plan_refuses_a_trace_too_small_for_the_batch():
    trace = generate_trace("real", 20, 4, seed=0)
    with pytest.raises(PlanError, match="at least 32"):
        plan_from_trace(trace, 4, parse_perf_model("table:h200-dense"), batch_size=16)
