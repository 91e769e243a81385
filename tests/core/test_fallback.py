"""TailSieve's online fallback to stock verl with speculation (``tailsieve-auto``, issue 22)."""

from __future__ import annotations

import pytest

from tailsieve_verl.core.simulation import sim
from tailsieve_verl.core.tailsieve.controller import ControllerConfig
from tailsieve_verl.core.tailsieve.cycle import TailSieveCycle
from tailsieve_verl.core.tailsieve.fallback import Arm, FallbackConfig, FallbackError, StockFallback
from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.data.workload import PromptPool, get_preset

PERF = parse_perf_model("table:h200-dense")


def _feed(switch: StockFallback, steps):
    """(ratio, had_tail) per step; the arm each step ran on."""
    arms = []
    for t, (ratio, had_tail) in enumerate(steps):
        arms.append(switch.arm)
        switch.observe(t, ratio, had_tail)
    return arms


def test_a_losing_probe_returns_to_stock_and_the_next_probe_waits_twice_as_long():
    switch = StockFallback(FallbackConfig(first_probe=2, reprobe_steps=3))
    arms = _feed(switch, [(1.0, False)] * 2 + [(0.9, False), (1.2, True)] + [(1.0, False)] * 3
                 + [(1.0, False), (1.1, True)] + [(1.0, False)] * 5)
    S, P = Arm.STOCK, Arm.SPLIT
    # a probe: a transition step without a tail pool, then one judged step; the split lost: 3 stock
    # steps, a second probe, lost again: 6 stock steps before the third
    assert arms == [S, S, P, P, S, S, S, P, P, S, S, S, S, S]
    assert switch.arm is Arm.STOCK and switch.next_probe == 9 + 6
    assert switch.probes == 2 and switch.split_steps == 4


def test_a_winning_probe_is_held_until_the_split_stops_beating_stock():
    switch = StockFallback(FallbackConfig(first_probe=1, window=2))
    arms = _feed(switch, [(1.0, False), (0.8, True), (0.8, True), (0.9, True), (1.2, True), (1.3, True), (1.0, False)])
    # held while the mean of the last two split ratios stays below stock's 1.0: (1.2 + 0.9) / 2 ≥ 1 ends it
    assert arms == [Arm.STOCK, Arm.SPLIT, Arm.SPLIT, Arm.SPLIT, Arm.SPLIT, Arm.STOCK, Arm.STOCK]


def test_the_split_must_beat_stock_by_the_margin_and_a_probe_without_a_tail_pool_is_lost():
    within_noise = StockFallback(FallbackConfig(first_probe=1, margin=0.05))
    _feed(within_noise, [(1.0, False), (0.97, True)])
    assert within_noise.arm is Arm.STOCK
    no_tail = StockFallback(FallbackConfig(first_probe=1, max_probe_steps=2))
    _feed(no_tail, [(1.0, False), (0.5, False), (0.5, False)])
    assert no_tail.arm is Arm.STOCK and no_tail.ratios[Arm.SPLIT] == []
    gated = StockFallback(FallbackConfig(first_probe=1))
    for t in range(3):
        gated.observe(t, 1.0, False, split_may_win=t == 2)  # due from step 1 on, held until the ceiling opens
    assert gated.arm is Arm.SPLIT and gated.gated == 2 and gated.probes == 1


@pytest.mark.parametrize("fields, needle", [
    ({"probe_steps": 0}, "probe_steps must be an integer >= 1"),
    ({"max_probe_steps": 1, "probe_steps": 2}, "max_probe_steps .1. must be >= probe_steps"),
    ({"margin": 1.0}, "margin must be in"),
])
def test_bad_fallback_settings_are_one_clear_line(fields, needle):
    with pytest.raises(FallbackError, match=needle):
        StockFallback(FallbackConfig(**fields))


def test_a_held_cycle_runs_one_shared_pool_drains_the_carried_and_leaves_the_controller_alone():
    cycle = TailSieveCycle(8, 4, ControllerConfig(fixed_tail_replicas=1, q_init=2), PERF, record=False)
    cycle.selector.carried = ["a", "b", "c"]  # as a split step leaves them
    cycle.selector.scores = {"a": 9, "b": 5, "c": 1}
    cycle.selector.pulled_at = {"a": 0, "b": 0, "c": 0}
    cycle.hold_shared(True)
    assert (cycle.decision.q, cycle.decision.m) == (0, 0)
    plan, m = cycle.plan([f"f{i}" for i in range(cycle.n_fresh())], 4)
    assert m == 0 and plan.tail_ids == () and plan.requeued_ids == ("a", "b", "c") and plan.n_abort == 0
    steps_before = cycle.controller.state.steps
    from tailsieve_verl.core.tailsieve.controller import GroupRecord
    ids = list(plan.requeued_ids) + list(plan.bulk_fresh_ids)
    outcome, _ = cycle.finish(plan, ids, {}, tail=[], bulk=[(i, GroupRecord((10, 20), 1.0)) for i in ids], m=0,
                              cutoff_s=1.0, prompt_len=10.0, policy_version=1)
    assert set(outcome.consumed_ids) == set(ids) and outcome.carried_ids == ()
    assert cycle.controller.state.steps == steps_before and (cycle.decision.q, cycle.decision.m) == (0, 0)
    cycle.hold_shared(False)
    assert (cycle.decision.q, cycle.decision.m) == (2, 1)  # the controller's split comes back


STRONG = PromptPool(get_preset("strong", max_response_length=2048), 256, seed=3)
LOSING = sim.SimConfig(steps=12, n_replicas=4, batch_size=16, n=4, seed=3, fixed_tail_replicas=2,
                       policies=("verl-spec", "tailsieve-spec", "tailsieve-auto"))


def test_tailsieve_auto_stays_on_stock_where_even_the_splits_ceiling_loses():
    result = sim.simulate(LOSING, STRONG, PERF)
    vs_stock = result.speedup_vs("verl-spec")
    assert vs_stock["tailsieve-spec"] < 0.8  # the split with per-pool speculation loses here...
    assert vs_stock["tailsieve-auto"] >= 0.99  # ...and the fallback never tries it: its ceiling loses too
    auto = result.policies["tailsieve-auto"]
    assert auto.choice == "stock k=6; split (tail k=6) on 0 of 12 steps, 0 probes, 11 held by the ceiling"
    assert (auto.lost, auto.duplicated, auto.stale) == (0, 0, 0) and auto.max_deferral_steps == 0


def test_a_lost_probe_drains_what_the_split_carried_and_loses_no_prompt(monkeypatch):
    monkeypatch.setattr(sim.FallbackRunner, "split_ceiling_s", lambda self, groups: 0.0)  # the gate always open
    result = sim.simulate(LOSING, STRONG, PERF)
    vs_stock = result.speedup_vs("verl-spec")
    assert vs_stock["tailsieve-spec"] < vs_stock["tailsieve-auto"] < 1.0  # the probes cost, the fallback holds
    auto = result.policies["tailsieve-auto"]
    assert (auto.lost, auto.duplicated, auto.stale) == (0, 0, 0) and auto.max_deferral_steps <= 1
    assert auto.choice.startswith("stock k=6; split (tail k=6) on 2 of 12 steps, 2 probes")
    records = auto.records
    # the probe ran a tail pool; the next step is a shared pool that drains what the split carried
    probe = next(i for i, r in enumerate(records) if r.m > 0)
    assert records[probe + 1].m == 0 and records[probe + 1].n_requeued > 0 and records[probe + 1].wasted_tokens == 0
    assert records[probe + 2].n_requeued == 0


def test_tailsieve_auto_judges_every_step_against_the_stock_engine_it_replays(monkeypatch):
    pool = PromptPool(get_preset("real", max_response_length=2048), 128, seed=3)
    cfg = sim.SimConfig(steps=4, n_replicas=4, batch_size=16, n=4, seed=3, fixed_tail_replicas=1)
    runner = sim.FallbackRunner(cfg, pool, PERF)
    seen = []
    real = runner.switch.observe
    monkeypatch.setattr(runner.switch, "observe", lambda t, ratio, had_tail, split_may_win:
                        seen.append(ratio) or real(t, ratio, had_tail, split_may_win))
    for t in range(cfg.steps):
        runner.step(t, keep=False)
    # stock steps: the replay of stock verl's routing with the same engine is the step itself, up to
    # routing tie-breaks
    assert seen[0] == pytest.approx(1.0, abs=0.05) and seen[1] == pytest.approx(1.0, abs=0.05)
    assert len(runner.replayed) == sim.FallbackRunner.SCREEN_KEEP and runner.stock_pick in runner.replayed
    assert set(sim.stock_engines(cfg)) >= {"k=1", "k=6", "1-64:3,65-128:1,129-256:0"}
