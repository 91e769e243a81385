"""The controller's online split planner: what it plans from measured steps, and how the controller
probes, holds and leaves a planned split."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tailsieve_verl.core.data.workload import PromptPool, get_preset
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.kinds import DecisionKind
from tailsieve_verl.core.simulation.config import SimConfig
from tailsieve_verl.core.simulation.sim import simulate
from tailsieve_verl.core.simulation.split_planner import OnlineSplitPlanner, planner_for, run_planner
from tailsieve_verl.core.tailsieve.controller import (AbortedGroup, ControllerConfig, ControllerError, GroupRecord,
                                                      HierarchicalController, PlannedSplit, StepObservation, _work_arrays)
from tailsieve_verl.core.tailsieve.fluid import ConsumedBatch
from tailsieve_verl.core.engine.engine import EngineConfig
from tailsieve_verl.core.errors import TailSieveError

PERF = parse_perf_model("table:h200-dense")
B, R, N = 32, 4, 8
CFG = SimConfig(n_replicas=R, batch_size=B, n=N)


def _batch(lengths: list[tuple[int, ...]]) -> ConsumedBatch:
    return ConsumedBatch(np.array([x for g in lengths for x in g], dtype=np.int64),
                         np.array([len(g) for g in lengths], dtype=np.int64))


def _measured(preset: str, seed: int) -> list[ConsumedBatch]:
    """Two consumed batches of a preset's prompts, as one shared pool would have measured them."""
    pool = PromptPool(get_preset(preset, max_response_length=16384), 4 * B, seed=seed)
    rng = np.random.default_rng(seed)
    ids = pool.prompt_ids
    return [_batch([pool.sample_group(ids[i], N, 0, rng).lengths for i in range(k * B, (k + 1) * B)]) for k in range(2)]


def test_weak_tails_plan_a_split_and_equal_lengths_plan_one_shared_pool():
    planner = OnlineSplitPlanner(CFG, PERF)
    assert all(m <= R // 2 for _, m in planner.grid) and (0, 0) in planner.grid
    weak = planner(_measured("weak", 2), 200.0)
    assert weak.m >= 1 and weak.q >= weak.m and weak.relative < 0.97
    assert planner(_measured("weak", 2), 200.0) == weak  # fixed stream seeds: a plan is reproducible
    equal = planner([_batch([(1000,) * N] * B)] * 2, 200.0)
    assert equal.relative >= 0.99  # nothing to isolate: no split beats one shared pool by a margin


def test_the_screen_keeps_the_full_search_pick_and_refuses_bad_rounds():
    """Successive halving on the first draw (the default screen) plans what every split run in full plans,
    its predicted makespan included: the survivors run the same steps on the same draws."""
    screened, full = OnlineSplitPlanner(CFG, PERF), OnlineSplitPlanner(CFG, PERF, screen=())
    assert screened.screen and len(screened.grid) > 1 + min(keep for _, keep in screened.screen)  # the screen drops splits
    for preset, seed in (("weak", 2), ("weak", 5), ("real", 1)):
        assert screened(_measured(preset, seed), 200.0) == full(_measured(preset, seed), 200.0)
    for screen in (((0, 4),), ((10, 4),), ((2, 0),), ((2, 4), (1, 2))):
        with pytest.raises(TailSieveError, match="screen"):
            OnlineSplitPlanner(CFG, PERF, screen=screen)


def test_the_race_costs_the_pinned_steps_it_says(monkeypatch):
    """``pinned_steps``, what the simulator weighs a TailSieve run's planner by, counts the steps the race runs."""
    from tailsieve_verl.core.simulation import runners

    stepped, real_step = [], runners.TailSieveRunner.step
    monkeypatch.setattr(runners.TailSieveRunner, "step", lambda self, t, keep: stepped.append(t) or real_step(self, t, keep))
    for screen in (((1, 16), (4, 6)), ((2, 3),), ()):
        planner, stepped[:] = OnlineSplitPlanner(CFG, PERF, screen=screen), []
        planner(_measured("weak", 2), 200.0)
        assert len(stepped) == planner.pinned_steps
    assert OnlineSplitPlanner(CFG, PERF, screen=()).pinned_steps == len(planner.grid) * 10 * 2


def test_the_planner_is_built_only_where_the_controller_plans():
    assert planner_for(ControllerConfig(), CFG, PERF) is not None
    assert planner_for(ControllerConfig(plan_probe=False), CFG, PERF) is None
    assert planner_for(ControllerConfig(fixed_tail_replicas=1, q_init=2), CFG, PERF) is None
    tail, bulk = EngineConfig(max_num_seqs=32), EngineConfig(max_num_seqs=256)
    run = run_planner(ControllerConfig(), R, B, N, PERF, (tail, bulk), per_sample=False)
    assert run.cfg.tail_and_bulk_engines == (tail, bulk) and run.cfg.group_atomic and run.cfg.n == N


def _shared_step(batch: ConsumedBatch, makespan_s: float) -> StepObservation:
    groups = tuple(GroupRecord(tuple(int(x) for x in row[:size]), makespan_s * (i + 1) / len(batch.sizes))
                   for i, (row, size) in enumerate(zip(batch.by_group, batch.sizes)))
    return StepObservation(m=0, tail_makespan_s=0.0, bulk_cutoff_s=makespan_s, tail_groups=(), bulk_groups=groups,
                           prompt_len=200.0)


def _split_step(batch: ConsumedBatch, q: int, m: int, makespan_s: float) -> StepObservation:
    groups = [GroupRecord(tuple(int(x) for x in row[:size]), makespan_s * (i + 1) / len(batch.sizes))
              for i, (row, size) in enumerate(zip(batch.by_group, batch.sizes))]
    return StepObservation(m=m, tail_makespan_s=makespan_s, bulk_cutoff_s=makespan_s, tail_groups=tuple(groups[:q]),
                           bulk_groups=tuple(groups[q:]), prompt_len=200.0,
                           aborted_groups=tuple(AbortedGroup(g.lengths, (False,) * len(g.lengths)) for g in groups[:q]))


def _planned_controller(plan: PlannedSplit, calls: list) -> HierarchicalController:
    def planner(history, prompt_len):
        calls.append((len(history), prompt_len))
        return plan

    return HierarchicalController(ControllerConfig(), R, B, PERF, planner=planner)


def test_the_controller_probes_the_planned_split_holds_its_q_and_plans_once():
    calls: list = []
    ctl = _planned_controller(PlannedSplit(6, 1, 0.85), calls)
    batches = _measured("weak", 1)
    assert ctl.observe(_shared_step(batches[0], 100.0)).split == (0, 0)
    probe = ctl.observe(_shared_step(batches[1], 100.0))
    assert probe.split == (6, 1) and probe.kind == DecisionKind.OUTER and calls == [(2, 200.0)]
    for step in range(6):  # tail and bulk far from balance: the inner loop would move q; a planned split holds it
        decision = ctl.observe(_split_step(batches[step % 2], 6, 1, 80.0))
        assert decision.split == (6, 1)
    assert len(calls) == 1


def test_a_planned_split_that_measures_worse_than_one_shared_pool_goes_back_and_stays():
    calls: list = []
    ctl = _planned_controller(PlannedSplit(6, 1, 0.9), calls)
    batches = _measured("weak", 2)
    for batch in batches:
        ctl.observe(_shared_step(batch, 100.0))
    assert ctl.decision.split == (6, 1)
    splits = [ctl.observe(_split_step(batches[step % 2], 6, 1, 150.0)).split for step in range(4)]
    assert (0, 0) in splits
    back = splits.index((0, 0))
    assert back >= 1  # one measured step is outweighed by the plan's prediction (plan_weight = 2)
    for step in range(4):
        assert ctl.observe(_shared_step(batches[step % 2], 100.0)).split == (0, 0)
    assert len(calls) == 1


def test_no_probe_where_the_plan_misses_the_margin_and_the_plan_survives_a_checkpoint():
    calls: list = []
    ctl = _planned_controller(PlannedSplit(6, 1, 0.98), calls)
    batches = _measured("weak", 3)
    for step in range(6):
        assert ctl.observe(_shared_step(batches[step % 2], 100.0)).split == (0, 0)
    assert len(calls) == 1
    restored = _planned_controller(PlannedSplit(6, 1, 0.5), calls)
    restored.load_state_dict(ctl.state_dict())
    assert restored.state.planned == PlannedSplit(6, 1, 0.98)
    assert restored.observe(_shared_step(batches[0], 100.0)).split == (0, 0) and len(calls) == 1


def _carried_step(batch: ConsumedBatch, q: int, m: int, makespan_s: float, heavier: float) -> StepObservation:
    """A split step that pulled ``batch`` (its first q groups aborted, the rest consumed) and consumed, in the
    tail pool, q groups carried from the step before that run ``heavier`` times as long: the carry filled the
    consumed batch with slow groups the pull did not hold."""
    groups = [GroupRecord(tuple(int(x) for x in row[:size]), makespan_s * (i + 1) / len(batch.sizes))
              for i, (row, size) in enumerate(zip(batch.by_group, batch.sizes))]
    carried = tuple(GroupRecord(tuple(int(x * heavier) for x in g.lengths), makespan_s) for g in groups[:q])
    aborted = tuple(AbortedGroup(tuple(x // 2 for x in g.lengths), (True,) * len(g.lengths)) for g in groups[:q])
    return StepObservation(m=m, tail_makespan_s=makespan_s, bulk_cutoff_s=makespan_s, tail_groups=carried,
                           bulk_groups=tuple(groups[q:]), aborted_groups=aborted, prompt_len=200.0,
                           fresh_groups=tuple(groups[q:]))


def test_a_split_is_priced_on_what_it_pulled_not_on_what_the_carry_filled_its_batch_with():
    """Split steps whose makespan matches what one shared pool would take on their consumed batches (the batch
    the carry filled with the last step's slowest groups) but exceeds stock verl's price of what they pulled:
    the price of the consumed batch reads parity and holds the split; stock verl's price of the pulls (the
    aborted groups' lengths drawn past the abort) resolves the loss and returns to one shared pool."""
    calls: list = []
    ctl = _planned_controller(PlannedSplit(6, 1, 0.9), calls)
    batches = _measured("weak", 4)
    for batch in batches:
        ctl.observe(_shared_step(batch, 100.0))
    assert ctl.decision.split == (6, 1)
    shared = ctl.state.splits[0].relative_makespan.value
    decisions = []
    for step in range(8):
        obs = _carried_step(batches[step % 2], 6, 1, 1.0, heavier=3.0)
        consumed = ConsumedBatch(*_work_arrays(obs.tail_groups + obs.bulk_groups))
        obs = replace(obs, tail_makespan_s=0.99 * shared * ctl.yardstick_s(consumed, 200.0))  # parity, a little under
        obs = replace(obs, bulk_cutoff_s=obs.tail_makespan_s)
        assert ctl.stock_price_s(obs) < 0.9 * ctl.yardstick_s(consumed, 200.0)  # the pull prices well below
        decisions.append(ctl.observe(obs))
        if decisions[-1].split == (0, 0):
            break
    assert decisions[-1].split == (0, 0) and "stock verl's run of its pulls" in decisions[-1].reason
    assert len(decisions) <= 4  # resolved within a few steps


def test_a_plan_whose_gain_is_within_its_noise_is_not_probed():
    for spread, probed in ((0.1, False), (0.05, True)):
        ctl = _planned_controller(PlannedSplit(6, 1, 0.9, spread), [])
        for batch in _measured("weak", 5):
            ctl.observe(_shared_step(batch, 100.0))
        assert (ctl.decision.split == (6, 1)) is probed  # 0.9 + probe_z (1) × spread against 1 − plan_margin = 0.97


@pytest.mark.parametrize("kwargs", [{"plan_margin": 1.0}, {"plan_margin": -0.1}, {"plan_weight": -1.0},
                                    {"probe_z": -1.0}, {"leave_z": -0.5}])
def test_bad_plan_settings_are_refused(kwargs):
    with pytest.raises(ControllerError, match="plan"):
        HierarchicalController(ControllerConfig(**kwargs), R, B, PERF)


def test_simulated_tailsieve_probes_its_plan_and_loses_no_prompt():
    """The simulator's adaptive TailSieve (dense weak 64 x 8 under verl's rollout defaults, a dataset-sized
    pool) plans after two steps of one shared pool and, with the plan's noise not weighed (``probe_z`` 0), runs
    the planned split with its q held; exactly-once and one-step deferral hold; without the planner the
    controller takes another path."""
    pool = PromptPool(get_preset("weak", max_response_length=16384), 17000, seed=0)
    cfg = SimConfig(steps=12, n_replicas=8, batch_size=64, n=8, seed=0, policies=("verl", "tailsieve"),
                    engine=EngineConfig.verl_defaults("qwen3-1.7b", PERF), controller=ControllerConfig(probe_z=0.0))
    result = simulate(cfg, pool, PERF)
    run = result.policies["tailsieve"]
    assert (run.lost, run.duplicated, run.stale) == (0, 0, 0) and run.max_deferral_steps <= 1
    splits = [(r.next_q, r.next_m) for r in run.records]
    assert splits[0] == (0, 0) and splits[1] != (0, 0)  # the plan's probe after two measured steps
    assert len({s for s in splits[1:] if s != (0, 0)}) == 1  # q held at the plan's value until any way back
    unplanned = simulate(replace(cfg, controller=ControllerConfig(plan_probe=False)), pool, PERF)
    assert [(r.next_q, r.next_m) for r in unplanned.policies["tailsieve"].records] != splits
