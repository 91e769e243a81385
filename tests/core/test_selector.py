from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from tailsieve_verl.core.selector import BULK, TAIL, SelectorError, TailSelector


def _run_step(sel: TailSelector, q: int, next_id: list[int], rng: np.random.Generator, version: int):
    plan = sel.plan_step(q)
    fresh = [f"p{next_id[0] + i}" for i in range(plan.n_fresh)]
    next_id[0] += plan.n_fresh
    finished = list(rng.permutation(fresh)[:plan.bulk_quota])
    return plan, fresh, sel.finish_step(plan, fresh, finished, policy_version=version)


def test_step_consumes_batch_and_carries_aborted_identities():
    sel = TailSelector(8)
    plan = sel.plan_step(2)
    assert plan.tail_ids == () and plan.n_fresh == 10 and plan.bulk_quota == 8 and plan.n_abort == 2
    fresh = [f"p{i}" for i in range(10)]
    out = sel.finish_step(plan, fresh, fresh[:8], policy_version=0)
    assert out.carried_ids == ("p8", "p9")
    assert len(out.consumed) == 8 and all(c.route == BULK for c in out.consumed)
    plan2 = sel.plan_step(2)
    assert plan2.tail_ids == ("p8", "p9") and plan2.bulk_quota == 6 and plan2.n_fresh == 8
    fresh2 = [f"r{i}" for i in range(8)]
    out2 = sel.finish_step(plan2, fresh2, fresh2[2:], policy_version=1)
    assert [c.prompt_id for c in out2.consumed if c.route == TAIL] == ["p8", "p9"]
    assert {c.policy_version for c in out2.consumed} == {1}
    assert out2.carried_ids == ("r0", "r1")


def test_shrinking_q_drains_every_carried_group():
    sel = TailSelector(8)
    rng = np.random.default_rng(0)
    counter = [0]
    _, _, out = _run_step(sel, 4, counter, rng, 0)
    assert len(out.carried_ids) == 4
    plan = sel.plan_step(1)
    assert set(plan.tail_ids) == set(out.carried_ids)  # all four regenerated, none dropped
    assert plan.n_fresh == 4 + 1 and plan.bulk_quota == 4


def test_exactly_once_over_1000_steps_with_random_q():
    sel, rng, counter = TailSelector(16), np.random.default_rng(1), [0]
    consumed: Counter = Counter()
    pulled: list[str] = []
    qs = rng.integers(0, 8, 1000)
    for t, q in enumerate(qs):
        _, fresh, out = _run_step(sel, int(q), counter, rng, t)
        pulled += fresh
        consumed.update(out.consumed_ids)
        assert len(out.consumed) == 16 and all(c.policy_version == t for c in out.consumed)
    assert max(consumed.values()) == 1
    assert set(pulled) == set(consumed) | set(sel.carried)
    assert not set(consumed) & set(sel.carried)


@pytest.mark.parametrize("bad", ["count", "duplicate", "overlap", "unknown", "quota"])
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
    else:
        finished = ["f", "g"]
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
    assert other.carried == sel.carried and other.step == sel.step
    assert other.plan_step(3).tail_ids == sel.plan_step(3).tail_ids
    with pytest.raises(SelectorError, match="batch_size"):
        TailSelector(16).load_state_dict(state)
