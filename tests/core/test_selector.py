from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from tailsieve_verl.core.kinds import Pool
from tailsieve_verl.core.tailsieve.selector import SelectorError, TailSelector, bulk_cutoff, fresh_cutoff, group_work


def _run_step(sel: TailSelector, q: int, next_id: list[int], rng: np.random.Generator, version: int):
    """One step with random finish times through the cutoff rule, and random abort scores."""
    plan = sel.plan_step(q)
    fresh = [f"p{next_id[0] + i}" for i in range(plan.n_fresh)]
    next_id[0] += plan.n_fresh
    bulk = list(plan.requeued_ids) + fresh
    cut = bulk_cutoff(rng.exponential(1.0, len(bulk)), len(plan.requeued_ids), plan.fresh_quota)
    scores = {bulk[i]: float(rng.integers(0, 1000)) for i in cut.aborted}
    return plan, fresh, sel.finish_step(plan, fresh, [bulk[i] for i in cut.consumed], policy_version=version,
                                        scores=scores)


def test_step_consumes_batch_and_carries_aborted_identities():
    sel = TailSelector(8)
    plan = sel.plan_step(2)
    assert plan.tail_ids == () and plan.n_fresh == 10 and plan.bulk_quota == 8 and plan.n_abort == 2
    fresh = [f"p{i}" for i in range(10)]
    out = sel.finish_step(plan, fresh, fresh[:8], policy_version=0)
    assert out.carried_ids == ("p8", "p9")
    assert len(out.consumed) == 8 and all(c.route == Pool.BULK for c in out.consumed)
    plan2 = sel.plan_step(2)
    assert plan2.tail_ids == ("p8", "p9") and plan2.bulk_quota == 6 and plan2.n_fresh == 8
    fresh2 = [f"r{i}" for i in range(8)]
    out2 = sel.finish_step(plan2, fresh2, fresh2[2:], policy_version=1)
    assert [c.prompt_id for c in out2.consumed if c.route == Pool.TAIL] == ["p8", "p9"]
    assert {c.policy_version for c in out2.consumed} == {1}
    assert out2.carried_ids == ("r0", "r1")


def test_shrinking_q_drains_the_other_candidates_through_the_bulk_pool():
    sel = TailSelector(8)
    rng = np.random.default_rng(0)
    counter = [0]
    _, _, out = _run_step(sel, 4, counter, rng, 0)
    assert len(out.carried_ids) == 4
    plan = sel.plan_step(1)
    assert plan.tail_ids == out.carried_ids[:1]  # the highest abort score isolated
    assert plan.requeued_ids == out.carried_ids[1:]  # the rest regenerated in the bulk pool, none dropped
    assert plan.bulk_quota == 7 and plan.n_abort == 1 and plan.n_bulk == 8 and plan.n_fresh == 5
    uniform = TailSelector(8)
    _run_step(uniform, 3, counter, rng, 0)
    back = uniform.plan_step(0)  # back to uniform routing: everything runs in the bulk pool, nothing aborted
    assert back.tail_ids == () and len(back.requeued_ids) == 3 and back.n_abort == 0 and back.n_bulk == 8


def test_candidates_are_ranked_by_abort_score_and_oversampled():
    sel = TailSelector(8, candidate_factor=2.0)
    plan = sel.plan_step(2)
    assert plan.n_abort == 4 and plan.n_fresh == 12 and plan.bulk_quota == 8
    fresh = [f"p{i}" for i in range(12)]
    scores = {"p8": 10.0, "p9": 400.0, "p10": 30.0, "p11": 400.0}
    out = sel.finish_step(plan, fresh, fresh[:8], 0, scores=scores)
    assert out.carried_ids == ("p9", "p11", "p10", "p8")  # heaviest first, ties in bulk order
    plan = sel.plan_step(2)
    assert plan.tail_ids == ("p9", "p11") and plan.requeued_ids == ("p10", "p8")
    assert plan.bulk_quota == 6 and plan.n_abort == 4 and plan.n_bulk == 10 and plan.n_fresh == 8
    with pytest.raises(SelectorError, match="candidate_factor"):
        TailSelector(8, candidate_factor=0.5)
    assert TailSelector(8, candidate_factor=3.0).n_abort(5) == 7  # never the whole batch


@pytest.mark.parametrize("factor", [1.0, 2.0, 3.0])
def test_exactly_once_and_one_step_deferral_over_1000_steps_with_random_q(factor):
    """Random q (up to B − 1), finish order and abort scores: every prompt is consumed exactly once,
    B per step, on-policy, and within one step of its abort (the old drain could abort a requeued
    prompt again and again)."""
    sel, rng, counter = TailSelector(16, candidate_factor=factor), np.random.default_rng(1), [0]
    consumed: Counter = Counter()
    pulled: list[str] = []
    aborted_at: dict[str, int] = {}
    qs = rng.integers(0, 16, 1000)
    for t, q in enumerate(qs):
        _, fresh, out = _run_step(sel, int(q), counter, rng, t)
        pulled += fresh
        consumed.update(out.consumed_ids)
        assert len(out.consumed) == 16 and all(c.policy_version == t for c in out.consumed)
        assert all(t - aborted_at.pop(p, t) <= 1 for p in out.consumed_ids)  # regenerated in the very next step
        assert not aborted_at, f"step {t}: carried prompts {sorted(aborted_at)[:3]} were not consumed"
        aborted_at = dict.fromkeys(out.carried_ids, t)
        assert out.max_deferral_steps <= 1
    assert max(consumed.values()) == 1
    assert set(pulled) == set(consumed) | set(sel.carried)
    assert not set(consumed) & set(sel.carried)


def test_the_cutoff_consumes_every_requeued_group_and_the_first_fresh_ones():
    # bulk order: 2 requeued, then 4 fresh; 2 fresh to finish
    cut = bulk_cutoff([9.0, 1.0, 3.0, 2.0, 8.0, 5.0], n_requeued=2, fresh_quota=2)
    assert cut.consumed == (0, 1, 3, 2) and cut.aborted == (4, 5)
    assert cut.cutoff_s == 3.0 and cut.bulk_end_s == 9.0  # the slow requeued group ends the bulk pool
    with pytest.raises(SelectorError, match="fresh_quota"):
        bulk_cutoff([1.0, 2.0], n_requeued=1, fresh_quota=2)


def test_the_trainers_online_cutoff_is_the_simulators_rule():
    """The trainer sees fresh groups finish a poll at a time (fresh_cutoff); the simulator knows every
    finish time (bulk_cutoff). However the finishes are polled, both consume and abort the same groups."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        n_requeued, n_fresh = int(rng.integers(0, 4)), int(rng.integers(1, 12))
        quota = int(rng.integers(1, n_fresh + 1))
        finish = rng.exponential(1.0, n_requeued + n_fresh)
        cut = bulk_cutoff(finish, n_requeued, quota)
        order = list(n_requeued + np.argsort(finish[n_requeued:], kind="stable"))
        taken, due, seen = [], False, 0
        while not due:  # polls that each see a random number of new finishes
            polled = order[seen: seen + int(rng.integers(1, 4))]
            seen += len(polled)
            taken, due = fresh_cutoff(taken, polled, quota)
        assert tuple(range(n_requeued)) + tuple(taken) == cut.consumed
        assert tuple(sorted(set(order) - set(taken))) == cut.aborted


def test_an_outcome_counts_the_aborted_groups_whole_work_as_wasted():
    sel = TailSelector(4)
    plan = sel.plan_step(1)
    fresh = [f"p{i}" for i in range(plan.n_fresh)]
    work = {fresh[-1]: group_work([30, 12, 0])}  # a finished sample, one cut mid-turn, one never started
    out = sel.finish_step(plan, fresh, fresh[:plan.bulk_quota], policy_version=0, scores=work)
    assert out.carried_ids == (fresh[-1],) and out.aborted_work == 42 == sel.scores[fresh[-1]]


@pytest.mark.parametrize("bad", ["count", "duplicate", "overlap", "unknown", "quota", "requeued"])
def test_contract_violations_are_refused(bad):
    sel = TailSelector(4)
    plan = sel.plan_step(1)
    sel.finish_step(plan, ["a", "b", "c", "d", "e"], ["a", "b", "c", "d"], 0)  # carries e
    plan = sel.plan_step(1)  # tail e, 3 to finish, 4 fresh
    fresh, finished = ["f", "g", "h", "i"], ["f", "g", "h"]
    if bad == "count":
        fresh = fresh[:3]
    elif bad == "duplicate":
        fresh = ["f", "f", "h", "i"]
    elif bad == "overlap":
        fresh = ["e", "g", "h", "i"]
    elif bad == "unknown":
        finished = ["f", "g", "zzz"]
    elif bad == "quota":
        finished = ["f", "g"]
    else:  # a requeued (drained) candidate aborted again
        sel = TailSelector(4, candidate_factor=2.0)
        plan = sel.plan_step(1)
        sel.finish_step(plan, ["a", "b", "c", "d", "e", "f"], ["a", "b", "c", "d"], 0, scores={"e": 5, "f": 1})
        plan = sel.plan_step(1)  # tail e, requeued f, 3 bulk to consume
        assert plan.requeued_ids == ("f",) and plan.fresh_quota == 2
        fresh = [f"n{i}" for i in range(plan.n_fresh)]
        finished = fresh[:3]
        with pytest.raises(SelectorError, match="never aborted again"):
            sel.finish_step(plan, fresh, finished, 1)
        return
    with pytest.raises(SelectorError):
        sel.finish_step(plan, fresh, finished, 1)


def test_plan_and_finish_must_alternate_and_q_is_bounded():
    sel = TailSelector(4)
    with pytest.raises(SelectorError, match="0..3"):
        sel.plan_step(4)
    plan = sel.plan_step(0)
    with pytest.raises(SelectorError, match="not finished"):
        sel.plan_step(0)
    with pytest.raises(SelectorError, match="checkpoint"):
        sel.state_dict()
    sel.finish_step(plan, ["a", "b", "c", "d"], ["a", "b", "c", "d"], 0)


def test_state_dict_roundtrip_is_json_and_checks_batch_size():
    sel, rng, counter = TailSelector(8), np.random.default_rng(2), [0]
    _run_step(sel, 3, counter, rng, 0)
    state = json.loads(json.dumps(sel.state_dict()))
    other = TailSelector(8)
    other.load_state_dict(state)
    assert other.carried == sel.carried and other.step == sel.step and other.scores == sel.scores
    assert other.plan_step(3).tail_ids == sel.plan_step(3).tail_ids
    with pytest.raises(SelectorError, match="batch_size"):
        TailSelector(16).load_state_dict(state)
