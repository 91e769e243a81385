"""No starvation through verl's rollout path (issue 20): a prompt aborted at step t is regenerated
at step t + 1 — in the tail pool or drained through the bulk pool, where it is never aborted again —
and consumed there; every step consumes B whole groups, each prompt exactly once."""

from __future__ import annotations

from collections import Counter

B, N = 8, 2


def test_a_carried_prompt_is_consumed_in_the_next_step_and_never_aborted_twice(harness_factory, tmp_path):
    # q = 2 with candidate_factor 2: four groups aborted per step, the two heaviest regenerated in the
    # tail pool, the other two requeued into the bulk pool next to the fresh groups
    h = harness_factory(["+tailsieve.mode=fixed", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
                         "+tailsieve.controller.inner_loop=false", "tailsieve.sim.time_scale=30",
                         f"trainer.default_local_dir={tmp_path}"])
    consumed: list[str] = []
    carried_prev: tuple[str, ...] = ()
    requeued_total = 0
    for _ in range(4):
        result = h.step()
        outcome, m = result["outcome"], result["metrics"]
        groups = Counter(key.split("_")[0] for key in result["batch"].keys)
        assert len(groups) == B and set(groups.values()) == {N}  # B whole groups
        routes = {c.prompt_id: c.route for c in outcome.consumed}
        assert set(carried_prev) <= set(routes)  # every prompt carried last step is consumed now
        requeued = [p for p in carried_prev if routes[p] == "bulk"]
        assert len(requeued) == m["tailsieve/requeued_groups"] == len(carried_prev[2:])
        requeued_total += len(requeued)
        assert not set(outcome.carried_ids) & set(carried_prev)  # aborted at most once
        assert m["tailsieve/max_deferral_steps"] == (1 if carried_prev else 0)
        assert m["tailsieve/aborted_groups"] == len(outcome.carried_ids) == 4
        consumed += sorted(set(result["prompt_ids"]))
        carried_prev = outcome.carried_ids
    assert requeued_total == 6  # three steps with two requeued groups each, none of them aborted
    assert len(consumed) == len(set(consumed)) == 4 * B  # exactly once
