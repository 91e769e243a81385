"""Record-planned steps (issue 48): the record's revisit line, the step planner, and the cycle that plans a later
epoch's steps from the record, aborts nothing in them and returns to the controller when they do not pay."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from tailsieve_verl.core.data.trace import Group
from tailsieve_verl.core.data.workload import PromptPool, WorkloadError, get_preset
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.simulation import sim
from tailsieve_verl.core.simulation.runners import TailSieveRunner, prompt_of
from tailsieve_verl.core.simulation.step_split import StepSplitPlanner, split_grid
from tailsieve_verl.core.tailsieve.controller import ControllerConfig, PlannedSplit
from tailsieve_verl.core.tailsieve.cycle import TailSieveCycle, spearman
from tailsieve_verl.core.tailsieve.prompt_record import PromptLengthRecord, PromptRecordError

PERF = parse_perf_model("table:h200-dense")
PLAN = ControllerConfig(record_plan=True)  # opt-in


def test_the_revisit_line_learns_the_trend_and_shrinks_noisy_measurements():
    """Prompts of true log length t (sd 0.5) measured with noise of sd 0.5 (reliability 1/2), revisited one
    step later 0.2 longer: the line maps a recorded x to 3.7 + x/2, and predictions err by about 0.61."""
    rng = np.random.default_rng(0)
    truth = rng.normal(0, 0.5, 4000)
    record = PromptLengthRecord(smoothing=1.0, trend_smoothing=1.0)
    for visit, base in enumerate((7.0, 7.2)):
        for i, t in enumerate(truth):
            record.observe(f"p{i}", [round(np.exp(base + t + rng.normal(0, 0.5)))] * 4)
        record.advance()
    a, b = record.line
    assert b == pytest.approx(0.5, abs=0.05) and a == pytest.approx(3.7, abs=0.35)
    assert record.spread == pytest.approx(np.sqrt(0.375), abs=0.04)
    measured = np.exp(7.0)
    record.observe("new", [round(measured)] * 4)  # one visit: its prediction goes through the line
    assert record.predict("new") == pytest.approx(4 * np.exp(a + b * np.log(round(measured))), rel=1e-6)
    state = json.loads(json.dumps(record.state_dict()))
    other = PromptLengthRecord()
    other.load_state_dict(state)
    assert other.line == record.line and other.spread == record.spread
    assert other.predictions(["p1", "new"]) == pytest.approx(record.predictions(["p1", "new"]), rel=1e-4)


def test_the_line_needs_enough_revisits_and_keeps_its_slope_in_0_1():
    record = PromptLengthRecord(trend_smoothing=1.0)
    for i in range(5):
        record.observe(f"p{i}", [100 * (i + 1)])
    record.advance()
    for i in range(5):
        record.observe(f"p{i}", [300 * (i + 1)])  # revisits, but fewer than the line needs
    record.advance()
    assert record.line == (0.0, 1.0) and record.spread == 0.0
    for i in range(5, 40):
        record.observe(f"p{i}", [10 * (i + 1)])
    record.advance()
    for i in range(5, 40):
        record.observe(f"p{i}", [(10 * (i + 1)) ** 2])  # revisits twice as spread out in log space
    record.advance()
    assert record.line[1] == 1.0  # never more spread than measured


def test_typical_groups_of_any_size_and_records_from_before_the_shapes():
    record = PromptLengthRecord()
    record.observe("a", [100 * (16 - j) for j in range(16)])
    assert record.typical_group("a", 16) == tuple(100 * (j + 1) for j in range(16))  # a group of 16 exactly
    assert record.typical_group("a", 2) == (450, 1250)  # its quartiles
    record.observe("b", [400, 100, 300, 200])
    assert record.typical_group("b", 4) == pytest.approx((100, 200, 300, 400), abs=10)
    assert record.typical_group("never", 4) is None and not record.known("never")
    record.observe_aborted("c", 900)  # a lower bound only: predicted, not measured
    assert record.predict("c") == 900 and not record.known("c")
    old = PromptLengthRecord()
    old.load_state_dict({"smoothing": 0.5, "prompts": {"c": [800.0, 2]}})  # a [work, seen] entry
    assert old.known("c") and old.typical_group("c", 4) == (200, 200, 200, 200)
    with pytest.raises(PromptRecordError, match="quantiles"):
        old.load_state_dict({"prompts": {"c": [800.0, 2, 0, [1.0, 2.0]]}})
    with pytest.raises(PromptRecordError, match="revisit_sums"):
        old.load_state_dict({"prompts": {}, "revisit_sums": [1.0]})


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None


def test_the_step_planner_keeps_one_shared_pool_for_equal_groups_and_splits_a_weak_tail():
    engine = EngineConfig.verl_defaults("qwen3-1.7b", PERF)
    planner = StepSplitPlanner(8, 128, PERF, (engine, engine))
    assert planner([Group(f"g{i}", (1000,) * 16, 0) for i in range(128)]) == PlannedSplit(0, 0, 1.0)
    pool = PromptPool(get_preset("weak", max_response_length=16384), 128, seed=0)
    weak = [pool.typical_group(pid, 16, 0) for pid in pool.prompt_ids]
    pick = planner(weak)
    assert pick.m >= 1 and pick.q >= pick.m and pick.relative < 0.95 and (pick.q, pick.m) in split_grid(8, 128)
    assert planner(weak, spread=0.3).relative > pick.relative  # a prediction that may err promises less


def _run(policies, steps, controller=None, **cfg):
    pool = PromptPool(get_preset("weak", max_response_length=8192), 64, seed=3)
    config = sim.SimConfig(steps=steps, n_replicas=4, batch_size=16, n=4, seed=3, policies=policies,
                           controller=controller or ControllerConfig(), **cfg)
    return sim.simulate(config, pool, PERF)


def test_later_epochs_are_planned_from_the_record_exactly_once_and_epoch_one_is_unchanged():
    """64 prompts, 16 a step: the record knows every prompt from the fifth step on."""
    on = _run(("verl", "tailsieve"), 16, PLAN).policies["tailsieve"]
    off = _run(("tailsieve",), 16).policies["tailsieve"]  # the default: record planning is opt-in
    planned = [r.step for r in on.records if r.record_planned]
    assert planned and min(planned) >= 4 and not any(r.record_planned for r in off.records)
    assert [r.makespan_s for r in on.records[:4]] == [r.makespan_s for r in off.records[:4]]  # epoch 1 unchanged
    assert all(r.wasted_tokens == 0 and r.n_requeued == 0 for r in on.records if r.record_planned)
    assert all(r.record_rho is not None for r in on.records if r.record_planned)
    assert (on.lost, on.duplicated, on.stale) == (0, 0, 0) and on.max_deferral_steps <= 1


def test_record_oracle_split_plans_every_step_from_the_truth():
    result = _run(("verl", "record-oracle-split"), 6).policies["record-oracle-split"]
    assert all(r.record_planned for r in result.records)
    assert (result.lost, result.duplicated, result.max_deferral_steps) == (0, 0, 0)
    assert result.record_rho > 0.8


def test_record_history_oracle_split_plans_every_step_from_what_the_history_tells():
    """record-oracle-split's planned steps, its record fed each prompt as history-oracle-split knows it: the
    checkpoint and trend exact, this step's prompt x checkpoint interaction not (a wider, differently placed group)."""
    result = _run(("verl", "record-history-oracle-split"), 6).policies["record-history-oracle-split"]
    assert all(r.record_planned for r in result.records)
    assert (result.lost, result.duplicated, result.max_deferral_steps) == (0, 0, 0)
    pool = PromptPool(get_preset("weak", max_response_length=8192), 64, seed=3)
    runner = sim.RecordHistoryOracleSplitRunner(sim.SimConfig(n_replicas=4, batch_size=16, n=4, seed=3), pool, PERF)
    runner.step_index = 5
    prompt = pool.prompt_ids[0]
    history = pool.typical_group(prompt, 4, 5, history_only=True).lengths
    assert runner.cycle.predictor(f"{prompt}#1") == history != pool.typical_group(prompt, 4, 5).lengths


def test_a_run_that_starts_in_a_later_epoch_holds_the_earlier_steps_in_its_record():
    """Every prompt is known from the start, but the record plans only once the controller has settled (measured
    one shared pool, planned and probed its split): the planned steps are weighed against that."""
    result = _run(("verl", "tailsieve"), 10, PLAN, start_step=4)
    assert [r.step for r in result.policies["verl"].records] == list(range(4, 14))
    records = result.policies["tailsieve"].records
    first = next(i for i, r in enumerate(records) if r.record_planned)
    assert first >= 2  # every prompt known from the start, yet the controller measures first
    assert result.policies["tailsieve"].max_deferral_steps <= 1
    with pytest.raises(sim.SimError, match="start_step"):
        _run(("verl",), 1, start_step=-1)
    with pytest.raises(WorkloadError, match="length_trend"):
        get_preset("weak", length_trend=2.0)


def test_the_guard_returns_to_the_controller_when_planned_splits_measure_worse():
    """A planner that promises half of one shared pool's makespan with most replicas on a tail of one group:
    the measured steps say otherwise, and the cycle stops planning."""
    pool = PromptPool(get_preset("weak", max_response_length=8192), 64, seed=1)
    engine = EngineConfig.verl_defaults("qwen3-1.7b", PERF)  # 13 groups of 32 on one replica queue at its cap
    cfg = sim.SimConfig(steps=12, n_replicas=4, batch_size=16, n=32, seed=1, policies=("tailsieve",), engine=engine)
    promise = lambda groups, spread: PlannedSplit(3, 3, 0.5)  # noqa: E731
    runner = TailSieveRunner(cfg, pool, PERF, PLAN, "tailsieve", step_planner=promise)
    for t in range(12):
        runner.step(t, keep=False)
    planned = [r.step for r in runner.result.records if r.record_planned]
    assert planned and runner.cycle.guard.off.startswith("record-planned steps measured")
    assert max(planned) < 11 and not runner.cycle.planning
    state = json.loads(json.dumps(runner.cycle.state_dict()))
    fresh = TailSieveCycle(16, 4, PLAN, PERF, prompt_key=prompt_of, step_planner=promise, group_size=32)
    fresh.load_state_dict(state)
    assert fresh.guard == runner.cycle.guard and fresh.record.state_dict() == runner.cycle.record.state_dict()
    fresh.load_state_dict({k: v for k, v in state.items() if k != "record_plan"})  # a checkpoint from before it
    assert not fresh.guard.off and not fresh.planning
    with pytest.raises(Exception, match="record_plan"):
        fresh.load_state_dict({**state, "record_plan": {"bogus": 1}})
    with pytest.raises(Exception, match="record_plan_coverage"):
        replace(ControllerConfig(), record_plan_coverage=0.0).validate(4, 16)
