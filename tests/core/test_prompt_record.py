from __future__ import annotations

import json

import numpy as np
import pytest

from tailsieve_verl.core.engine.perf import parse_perf_model
from tailsieve_verl.core.tailsieve.prompt_record import (_LEVELS, PromptLengthRecord, PromptRecordError,
                                                        _hazen_quantiles)
from tailsieve_verl.core.tailsieve.selector import SelectorError, TailSelector
from tailsieve_verl.core.simulation.sim import BestStaticRunner, SimConfig, simulate, static_grid
from tailsieve_verl.core.data.workload import PromptPool, get_preset


def test_record_smooths_completed_groups_and_raises_on_aborts():
    rec = PromptLengthRecord(smoothing=0.5)
    assert rec.predict("a") is None
    rec.observe("a", [100, 300])
    rec.observe("a", [200, 200])
    assert rec.predict("a") == pytest.approx(400.0)
    rec.observe_aborted("a", 1000)  # a lower bound above the estimate raises it
    rec.observe_aborted("a", 10)  # one below never lowers it
    assert rec.predict("a") == 1000.0
    rec.observe_aborted("b", 50)
    assert rec.predictions(["a", "b", "c"]) == {"a": 1000.0, "b": 50.0}
    other = PromptLengthRecord()
    other.load_state_dict(json.loads(json.dumps(rec.state_dict())))
    assert other.predictions(["a", "b"]) == rec.predictions(["a", "b"])
    with pytest.raises(PromptRecordError):
        other.load_state_dict({"prompts": {"a": "x"}})


def test_the_records_shape_is_numpys_hazen_quantiles_to_the_bit():
    rng = np.random.default_rng(7)
    for n in range(1, 70):
        for values in (rng.integers(0, 40_000, n), rng.lognormal(7, 1.5, n), np.full(n, 512)):
            values = np.sort(values.astype(float))
            assert _hazen_quantiles(values).tobytes() == np.quantile(values, _LEVELS, method="hazen").tobytes(), n


def test_selector_sends_predicted_long_fresh_prompts_to_the_tail_pool():
    sel = TailSelector(8, candidate_factor=2.0)
    plan = sel.plan_step(2)
    fresh = [f"f{i}" for i in range(plan.n_fresh)]
    out = sel.finish_step(plan, fresh, fresh[:plan.bulk_quota], 0, scores={"f8": 50.0, "f9": 10.0, "f10": 5.0,
                                                                          "f11": 1.0})
    assert out.carried_ids == ("f8", "f9", "f10", "f11")
    pulled = [f"g{i}" for i in range(sel.n_fresh_needed(2))]
    assert len(pulled) == 8 + 4 - 4
    # g3 is known to be very long, g5 short; carried f8 has a prediction above its abort score
    plan = sel.plan_step(2, pulled, {"g3": 900.0, "g5": 1.0, "f9": 60.0})
    assert plan.tail_ids == ("g3", "f9") and plan.fresh_tail_ids == ("g3",)
    assert set(plan.requeued_ids) == {"f8", "f10", "f11"}
    assert len(plan.bulk_fresh_ids) == plan.n_fresh and "g3" not in plan.bulk_fresh_ids
    bulk = list(plan.requeued_ids) + list(plan.bulk_fresh_ids)
    out = sel.finish_step(plan, plan.bulk_fresh_ids, bulk[:plan.bulk_quota], 1)
    assert len(out.consumed) == 8 and set(out.consumed_ids) | set(out.carried_ids) <= set(bulk) | {"g3", "f9"}
    with pytest.raises(SelectorError, match="fresh prompts"):
        sel.plan_step(2, ["only-one"], {})


def test_multi_epoch_run_with_the_record_is_exactly_once_and_isolates_without_aborting():
    """A 256-prompt pool, batch 16: 8 epochs. Every prompt consumed once per epoch; from the
    second epoch on, fresh prompts go straight to the tail pool."""
    perf = parse_perf_model("table:h200-dense")
    pool = PromptPool(get_preset("strong", max_response_length=4096), 64, seed=1)
    cfg = SimConfig(steps=32, n_replicas=4, batch_size=16, n=2, seed=1, policies=("tailsieve-fixed",))
    from tailsieve_verl.core.simulation.sim import build_runners
    runner = build_runners(cfg, pool, perf)[0]
    fresh_in_tail = 0
    orig = runner.cycle.selector.plan_step

    def spy(*a, **k):
        nonlocal fresh_in_tail
        plan = orig(*a, **k)
        fresh_in_tail += len(plan.fresh_tail_ids)
        return plan
    runner.cycle.selector.plan_step = spy
    for t in range(cfg.steps):
        runner.step(t, keep=False)
    r = runner.finish()
    assert (r.lost, r.duplicated, r.stale) == (0, 0, 0)
    assert fresh_in_tail > 10


def test_best_static_is_the_best_grid_point_in_hindsight():
    assert static_grid(4, 16)[0] == (0, 0)
    assert all(q >= m >= 1 for q, m in static_grid(4, 16)[1:])
    perf = parse_perf_model("table:h200-dense")
    pool = PromptPool("real", 64, seed=0)
    cfg = SimConfig(steps=4, n_replicas=4, batch_size=16, n=2, seed=0, policies=("verl", "best-static"),
                    best_static_screen=(0, 0))
    result = simulate(cfg, pool, perf)
    best = result.policies["best-static"]
    assert (best.lost, best.duplicated) == (0, 0)
    # the same grid run by hand: best-static is its minimum
    runner = BestStaticRunner(cfg, pool, perf)
    for t in range(cfg.steps):
        runner.step(t, keep=False)
    runner.finish()
    assert best.mean_makespan_s == pytest.approx(min(runner.grid.values()))
    assert result.speedup_vs("verl")["best-static"] > 0.95  # (0, 0) is in the grid: ~stock verl at worst


def test_a_predictor_seeds_the_record_and_measurements_are_smoothed_into_it():
    """A length predictor's estimates (a previous run's record, a model of the prompt text) are the
    record's prediction for prompts not measured yet; a measured prompt keeps its measurement, and a
    later measurement is smoothed into the seed (here with smoothing 1: replaces it). Nonsense
    predictions are refused."""
    rec = PromptLengthRecord(smoothing=1.0)
    rec.observe("a", [100, 100])
    rec.seed({"a": 9000.0, "b": 700.0})
    assert rec.predictions(["a", "b", "c"]) == {"a": 200.0, "b": 700.0}
    rec.observe("b", [50, 50])
    assert rec.predict("b") == 100.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(PromptRecordError, match="must be a number >= 0"):
            rec.seed({"c": bad})
