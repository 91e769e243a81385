"""core.tailsieve.cycle: the one TailSieve step the simulator and the verl trainer both run."""

import pytest

from tailsieve_verl.core.tailsieve.controller import AbortedGroup, ControllerConfig, GroupRecord
from tailsieve_verl.core.tailsieve.cycle import TailSieveCycle
from tailsieve_verl.core.engine.perf import LinearPerf
from tailsieve_verl.core.tailsieve.selector import SelectorError, bulk_cutoff

PERF = LinearPerf(0.01, 0.0001)
B, R = 4, 4
PINNED = ControllerConfig(fixed_tail_replicas=1, q_init=1, inner_loop=False, candidate_factor=2.0)


def _key(identity: str) -> str:
    return identity.split("#")[0]  # "p3#2" = prompt p3 pulled in epoch 2


def _run_step(cycle: TailSieveCycle, fresh: list[str], lengths: dict[str, int], version: int):
    """Finish in order of length (the cutoff rule: requeued groups run on, the longest fresh ones are
    aborted) with half their length as score."""
    plan, m = cycle.plan(fresh, R)
    bulk = list(plan.requeued_ids) + list(plan.bulk_fresh_ids)
    cut = bulk_cutoff([lengths[_key(i)] for i in bulk], len(plan.requeued_ids), plan.fresh_quota)
    done = [bulk[i] for i in cut.consumed]
    scores = {bulk[i]: lengths[_key(bulk[i])] // 2 for i in cut.aborted}
    record = lambda i: (i, GroupRecord((lengths[_key(i)],), lengths[_key(i)] / 100))  # noqa: E731
    outcome, obs = cycle.finish(plan, done, scores, tail=[record(i) for i in plan.tail_ids],
                                bulk=[record(i) for i in done], m=m, cutoff_s=max(lengths[_key(i)] for i in done) / 100,
                                prompt_len=0.0, policy_version=version,
                                aborted={i: AbortedGroup((score,), (True,)) for i, score in scores.items()})
    return plan, m, outcome, obs


def test_without_a_record_the_plan_is_the_selectors_own():
    cycle = TailSieveCycle(B, R, PINNED, PERF, record=False, prompt_key=_key)
    lengths = {f"p{i}": 10 * (i + 1) for i in range(8)}
    first, m, outcome, obs = _run_step(cycle, [f"p{i}#0" for i in range(cycle.n_fresh())], lengths, 0)
    assert m == 0 and not first.tail_ids and len(outcome.consumed) == B and obs.n_aborted == 2
    carried = list(cycle.selector.carried)
    plan, m, _, _ = _run_step(cycle, [f"p{i}#1" for i in range(cycle.n_fresh())], lengths, 1)
    assert plan.tail_ids == tuple(carried[:1]) and m == 1 and not plan.fresh_tail_ids


def test_a_fresh_prompt_the_record_knows_to_be_heavy_goes_straight_to_the_tail_pool():
    cycle = TailSieveCycle(B, R, PINNED, PERF, prompt_key=_key)
    lengths = {"p0": 5, "p1": 6, "p2": 7, "p3": 500, "p4": 8, "p5": 9}
    _run_step(cycle, ["p0#0", "p1#0", "p2#0", "p3#0", "p4#0", "p5#0"], lengths, 0)  # p3 and p5 aborted
    assert cycle.record.predict("p3") == 250  # the abort score: a lower bound on its work
    _run_step(cycle, ["p0#1", "p1#1", "p2#1", "p4#1"], lengths, 1)  # p3#0 regenerated in the tail pool
    assert cycle.record.predict("p3") > 250  # its full length, observed once it ran to the end
    plan, m, _, _ = _run_step(cycle, [f"p{i}#2" for i in (0, 1, 2, 3)][:cycle.n_fresh()], lengths, 2)
    assert "p3#2" in plan.fresh_tail_ids and plan.tail_ids[0] == "p3#2" and m == 1


def test_finish_checks_exactly_once_and_feeds_the_controller():
    cycle = TailSieveCycle(B, R, ControllerConfig(), PERF, prompt_key=_key)
    assert cycle.decision.split == (0, 0)  # controller v2 starts from one shared pool
    plan, m = cycle.plan([f"p{i}#0" for i in range(cycle.n_fresh())], R)
    with pytest.raises(SelectorError):
        cycle.finish(plan, ["p0#0"], {}, tail=[], bulk=[], m=m, cutoff_s=1.0, prompt_len=0.0, policy_version=0)


def test_stop_only_mode_keeps_one_shared_pool_and_records_nothing_it_cannot():
    cycle = TailSieveCycle(B, R, PINNED, PERF, adaptive=False, prompt_key=_key)
    lengths = {f"p{i}": 10 * (i + 1) for i in range(12)}
    for step in range(3):
        plan, m, outcome, _ = _run_step(cycle, [f"p{4 * step + i}#0" for i in range(cycle.n_fresh())], lengths, step)
        assert (plan.q, m, len(plan.tail_ids), len(outcome.carried_ids)) == (0, 0, 0, 0)
    assert cycle.decision.split == (0, 0)


def test_state_round_trip_keeps_carried_queue_record_and_decision():
    cycle = TailSieveCycle(B, R, PINNED, PERF, prompt_key=_key)
    lengths = {f"p{i}": 10 * (i + 1) for i in range(8)}
    _run_step(cycle, [f"p{i}#0" for i in range(cycle.n_fresh())], lengths, 0)
    restored = TailSieveCycle(B, R, PINNED, PERF, prompt_key=_key)
    restored.load_state_dict(cycle.state_dict())
    assert restored.selector.carried == cycle.selector.carried
    assert restored.record.state_dict() == cycle.record.state_dict()
    assert restored.decision.split == cycle.decision.split


def test_the_record_replaces_the_aborts_for_the_prompts_it_knows():
    """record_replaces_aborts: a step whose fresh prompts the record all knows aborts nothing the next
    step; the tail is then the record's heaviest fresh prompt, named at the step's start, and every
    prompt is still consumed exactly once. A first-epoch pull (nothing known) aborts as before."""
    lengths = {f"p{i}": 10 * (i + 1) for i in range(6)}
    lengths["p2"] = 900
    cycle = TailSieveCycle(B, R, PINNED, PERF, prompt_key=_key, record_replaces_aborts=True)
    plain = TailSieveCycle(B, R, PINNED, PERF, prompt_key=_key)
    for c in (cycle, plain):  # epoch 0: nothing known, q = 1 and candidate_factor 2 abort 2
        _, _, _, obs = _run_step(c, [f"p{i}#0" for i in range(c.n_fresh())], lengths, 0)
        assert obs.n_aborted == 2
    assert cycle.abort_share == 1.0  # the first pull was unknown to the record
    # epoch 1, the prompts the record saw come back: the next step's abort share falls to what it does not know
    _run_step(cycle, [f"p{i}#1" for i in range(cycle.n_fresh())], lengths, 1)
    assert 0.0 <= cycle.abort_share < 1.0
    steps = 0
    while cycle.abort_share > 0.0 and steps < 5:
        _run_step(cycle, [f"p{i}#{2 + steps}" for i in range(cycle.n_fresh())], lengths, 2 + steps)
        steps += 1
    assert cycle.abort_share == 0.0
    epoch = 9
    plan, m, outcome, obs = _run_step(cycle, [f"p{i}#{epoch}" for i in range(cycle.n_fresh())], lengths, epoch)
    assert plan.n_abort == 0 and obs.n_aborted == 0
    assert plan.tail_ids[0].startswith("p2#") and m == 1  # the record's heaviest, at the step's start
    assert len(outcome.consumed) == B and len(set(outcome.consumed)) == B
    # the plain cycle keeps aborting in every epoch
    _, _, _, plain_obs = _run_step(plain, [f"p{i}#1" for i in range(plain.n_fresh())], lengths, 1)
    assert plain_obs.n_aborted == 2


def test_the_abort_share_survives_a_checkpoint_and_a_malformed_one_is_refused():
    cycle = TailSieveCycle(B, R, PINNED, PERF, prompt_key=_key, record_replaces_aborts=True)
    cycle.abort_share = 0.25
    restored = TailSieveCycle(B, R, PINNED, PERF, prompt_key=_key, record_replaces_aborts=True)
    restored.load_state_dict(cycle.state_dict())
    assert restored.abort_share == 0.25 and restored.n_fresh() == cycle.n_fresh()
    older = {k: v for k, v in cycle.state_dict().items() if k != "abort_share"}
    restored.load_state_dict(older)
    assert restored.abort_share == 1.0  # a checkpoint from before it: every candidate aborted
    with pytest.raises(SelectorError, match="abort_share"):
        restored.load_state_dict(dict(cycle.state_dict(), abort_share=1.5))
