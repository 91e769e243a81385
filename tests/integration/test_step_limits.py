"""What may end a TailSieve step, on verl's real rollout path with simulated replicas: a long healthy
step completes (only the drain after the abort is bounded), a tool loop's next turn after the cutoff
is never stranded, per-prompt sample counts and late reports never break the controller."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pandas as pd

AGENTS_YAML = Path(__file__).parent / "agents" / "agents.yaml"  # the test agent loops (see conftest.ray_session)

B, N, R = 8, 2, 4
FIXED_TAIL = ["+tailsieve.mode=fixed", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
              "+tailsieve.controller.inner_loop=false"]


def _consumed_groups(result: dict) -> Counter:
    return Counter(key.split("_")[0] for key in result["batch"].keys)


def test_a_step_longer_than_the_drain_timeout_completes(harness_factory, tmp_path):
    """drain_timeout_s bounds the abort → settled drain only: a tail that runs well past it is healthy."""
    h = harness_factory(FIXED_TAIL + ["tailsieve.sim.time_scale=60", "tailsieve.drain_timeout_s=1",
                                      f"trainer.default_local_dir={tmp_path}"])
    for _ in range(2):  # the second step regenerates the first step's carried tails
        result = h.step()
        assert len(set(result["prompt_ids"])) == B and len(result["batch"].keys) == B * N
    m = result["metrics"]
    assert m["tailsieve/carried_groups"] == 2 and m["tailsieve/aborted_groups"] == 4
    assert m["tailsieve/tail_makespan_s"] > 1.0  # the tail ran past the drain bound, and the step completed


def test_a_two_turn_tool_loop_through_the_cutoff_never_strands_a_turn(harness_factory, tmp_path):
    """Aborted groups whose tool call returns after the cutoff send their second turn then; it must
    come back aborted at once (not wait behind a paused engine), so the step settles."""
    h = harness_factory(FIXED_TAIL + [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENTS_YAML}",
                                      "actor_rollout_ref.rollout.agent.default_agent_loop=two_turn_tool",
                                      "tailsieve.drain_timeout_s=20", f"trainer.default_local_dir={tmp_path}"])
    consumed: list[str] = []
    for _ in range(3):
        result = h.step()
        groups = _consumed_groups(result)
        assert len(groups) == B and set(groups.values()) == {N}
        assert result["metrics"]["tailsieve/aborted_groups"] == 4
        assert all(tag.get("response_len", 0) >= 1 for tag in result["batch"].tags)
        consumed += sorted(set(result["prompt_ids"]))
    assert len(consumed) == len(set(consumed)) == 3 * B  # exactly once
    assert sum(s["aborted"] for s in h.server_stats()) > 0


def test_per_prompt_sample_counts_are_reported_and_observed(harness_factory, assets, tmp_path):
    """verl's per-row ``__rollout_n__``: each group is reported once all of its own samples settled,
    and adaptive mode's controller observes all B groups every step."""
    frame = pd.read_parquet(assets.data)
    frame["__rollout_n__"] = [1 + i % 3 for i in range(len(frame))]
    data = tmp_path / "varied_n.parquet"
    frame.to_parquet(data)
    h = harness_factory([f"data.train_files={data}", "+tailsieve.q0=2", f"trainer.default_local_dir={tmp_path}"])
    wanted = {info["prompt_id"]: n for info, n in zip(frame["extra_info"], frame["__rollout_n__"])}
    for _ in range(3):
        result = h.step()
        per_prompt = Counter(result["prompt_ids"])
        assert len(per_prompt) == B and all(per_prompt[p] == wanted[p] for p in per_prompt)
        assert h.trainer.cycle.controller.state.steps == h.trainer.global_steps  # observed every step


def test_a_report_that_never_comes_is_measured_from_the_trainers_own_view(harness_factory, tmp_path):
    """A consumed group whose agent-loop report is lost: the step still completes, the controller
    observes B groups (that group's lengths from TransferQueue), the carried queue stays whole."""
    h = harness_factory(["+tailsieve.q0=2", f"trainer.default_local_dir={tmp_path}"])
    collect = h.trainer._collect_reports
    lost: list[str] = []

    def lose_one(*args, **kwargs):
        reports = collect(*args, **kwargs)
        finished = [uid for uid, r in reports.items() if not r["aborted"]]
        lost.append(finished[0])
        return {uid: r for uid, r in reports.items() if uid != lost[-1]}

    h.trainer._collect_reports = lose_one
    for _ in range(2):
        result = h.step()
        assert len(set(result["prompt_ids"])) == B
        assert h.trainer.cycle.controller.state.steps == h.trainer.global_steps
        selector = h.trainer.cycle.selector
        assert set(h.trainer.carried_rows) == set(selector.carried)
        assert len(selector.carried) == result["metrics"]["tailsieve/aborted_groups"]
    assert len(lost) == 2
