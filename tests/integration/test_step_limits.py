"""What may end a TailSieve step, on verl's real rollout path with simulated replicas: a long healthy
step completes (only the drain after the abort is bounded), a tool loop's next turn after the cutoff
is never stranded, per-prompt sample counts and late reports never break the controller."""

from __future__ import annotations

import importlib.util
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
    """drain_timeout_s never ends a step: a tail that runs well past it is healthy."""
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
    h = harness_factory([f"data.train_files={data}", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
                         f"trainer.default_local_dir={tmp_path}"])
    wanted = {info["prompt_id"]: n for info, n in zip(frame["extra_info"], frame["__rollout_n__"])}
    for _ in range(3):
        result = h.step()
        per_prompt = Counter(result["prompt_ids"])
        assert len(per_prompt) == B and all(per_prompt[p] == wanted[p] for p in per_prompt)
        assert h.trainer.cycle.controller.state.steps == h.trainer.global_steps  # observed every step


def test_a_report_that_never_comes_is_measured_from_the_trainers_own_view(harness_factory, tmp_path):
    """A consumed group whose agent-loop report is lost: the step still completes, the controller
    observes B groups (that group's lengths from TransferQueue), the carried queue stays whole."""
    h = harness_factory(["+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
                         f"trainer.default_local_dir={tmp_path}"])
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


def _test_agents():
    """The agent-loop module the workers load (agents/ is on their path, not on the test's)."""
    spec = importlib.util.spec_from_file_location("tailsieve_test_agents", AGENTS_YAML.parent / "tailsieve_test_agents.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _agent(name: str) -> list[str]:
    return [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENTS_YAML}",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={name}", "data.shuffle=false"]


def _number(prompt_id: str) -> int:
    return int(prompt_id[1:])  # conftest's prompt_id p<i>


def test_a_group_whose_tool_fails_is_trained_with_what_succeeded_as_stock_verl_does(harness_factory, tmp_path):
    """A group whose agent loop raises (a tool error: no engine refusal, no dead replica) is neither
    retried nor the end of the run: as in verl 0.9.1's sync replay buffer it counts as one of the B
    groups, trained with the samples that succeeded (none when every sample failed); under verl's
    trainer.v1.sampler.sync_refill_failed_groups a group left with no trajectory gives its slot to a
    fresh prompt, as verl's refill does."""
    agents = _test_agents()
    h = harness_factory(FIXED_TAIL + _agent("tool_error") + [f"trainer.default_local_dir={tmp_path}/keep"])
    trained: list[str] = []
    partial = empty = 0
    for _ in range(3):
        result = h.step()
        assert len(result["outcome"].consumed) == B and result["metrics"]["tailsieve/redispatched_groups"] == 0
        samples = Counter(result["prompt_ids"])  # trajectories of each trained prompt
        for prompt, count in samples.items():
            number = _number(prompt)
            assert not agents.every_sample_fails(number)
            assert count == (N - 1 if agents.one_sample_fails(number) else N), prompt
        partial += sum(agents.one_sample_fails(_number(p)) for p in samples)
        empty += B - len(samples)  # consumed, every sample failed: nothing to train
        trained += list(samples)
    assert partial > 0 and empty > 0
    assert len(trained) == len(set(trained))  # exactly once
    h.close()

    refill = harness_factory(FIXED_TAIL + _agent("tool_error") + ["trainer.v1.sampler.sync_refill_failed_groups=true",
                                                                    f"trainer.default_local_dir={tmp_path}/refill"])
    trained = []
    for _ in range(3):
        result = refill.step()
        samples = Counter(result["prompt_ids"])
        assert len(samples) == B and not any(agents.every_sample_fails(_number(p)) for p in samples)
        trained += list(samples)
    assert len(trained) == len(set(trained))


def test_an_aborted_group_in_a_long_tool_call_does_not_hold_the_step(harness_factory, tmp_path):
    """The abort cannot interrupt a tool call: the step closes without waiting for the aborted groups
    still in one (their prompts are carried: trained once in a later step); their late trajectories are
    never consumed and are cleared from TransferQueue once they settle. The step waits drain_timeout_s
    (3 s here; the tool takes 12 s) for them, no longer."""
    import transfer_queue as tq

    agents = _test_agents()
    h = harness_factory(FIXED_TAIL + _agent("slow_tool") + ["tailsieve.drain_timeout_s=3",
                                                            f"trainer.default_local_dir={tmp_path}"])
    result = h.step()  # the old code waited here for the tool calls, then stopped past the drain timeout
    settling = set(h.trainer.settling_aborts)  # aborted groups still in their tool call when the step closed
    assert settling and result["metrics"]["tailsieve/aborted_groups"] == 4
    first = set(result["prompt_ids"])
    assert len(first) == B and len(result["batch"].keys) == B * N
    assert not {_number(p) for p in first} & agents.SLOW_TOOL_PROMPTS
    carried = set(result["outcome"].carried_ids)

    result = h.step()  # the carried slow prompts run their tool in full here (12 s): the first ones settle meanwhile
    second = Counter(result["prompt_ids"])
    assert len(second) == B and set(second.values()) == {N}
    assert agents.SLOW_TOOL_PROMPTS <= {_number(p) for p in second}  # carried, trained once, whole
    regenerated = list(result["outcome"].consumed_ids) + list(result["outcome"].carried_ids)
    assert all(regenerated.count(identity) == 1 for identity in carried)
    assert not first & set(second)
    assert not set(h.trainer.settling_aborts) & settling  # settled and cleared
    left = (tq.kv_list("train") or {}).get("train", {})
    assert not {key for key in left if key.split("_")[0] in settling}  # prompt keys and late trajectories gone
