"""A sample's work — the tokens the model generated for it over all its turns (what response_mask
marks 1), an aborted turn's partial tokens included — on verl's real rollout path with simulated
replicas and a two-turn tool loop: one count for the length record, the abort score,
``tailsieve/aborted_tokens`` and the length-bias reference; agent loops that return several outputs
(issue 31)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import ray
import transfer_queue as tq

AGENTS_YAML = Path(__file__).parent / "agents" / "agents.yaml"  # the test agent loops (see conftest.ray_session)
B, N = 8, 2
TOOL_LOOP = ["+tailsieve.mode=fixed", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
             "+tailsieve.controller.inner_loop=false", f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENTS_YAML}"]
SETTLED = ["tailsieve.drain_timeout_s=20"]  # the step waits for its aborted groups (a 2 s tool call) to settle


def _watch(trainer) -> list[dict]:
    """What each step hands the core (the consumed groups' work, the abort scores) and the response
    masks of the trajectories it consumes, read from TransferQueue before verl trains on them."""
    steps: list[dict] = []
    finish, selected = trainer.cycle.finish, trainer.replay_buffer.selected_batch

    def selected_batch(uids):
        batch = selected(uids)
        masks = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                select_fields=["response_mask"])["response_mask"]
        work: dict[str, Counter] = {}
        for key, mask in zip(batch.keys, masks.unbind(0)):
            uid, session, _ = key.rsplit("_", 2)
            work.setdefault(uid, Counter())[int(session)] += int(mask.sum())
        outputs = Counter(key.rsplit("_", 2)[0] + "_" + key.rsplit("_", 2)[1] for key in batch.keys)
        steps.append({"masked_work": sorted(tuple(c[s] for s in sorted(c)) for c in work.values()),
                      "outputs_per_session": Counter(outputs.values())})
        return batch

    def record_finish(plan, finished, scores, **kwargs):
        steps[-1].update(scores=dict(scores), consumed=[g.lengths for _, g in kwargs["tail"] + kwargs["bulk"]])
        return finish(plan, finished, scores, **kwargs)

    trainer.replay_buffer.selected_batch, trainer.cycle.finish = selected_batch, record_finish
    return steps


def _slow_tool_prompts() -> frozenset[int]:
    """The prompts whose tool call is slow (the agent-loop module the workers load; not on the test's path)."""
    spec = importlib.util.spec_from_file_location("tailsieve_test_agents", AGENTS_YAML.parent / "tailsieve_test_agents.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SLOW_TOOL_PROMPTS


def _engine_tokens(h) -> int:
    return sum(s["tokens"] for s in h.server_stats())


def test_a_tool_loops_work_leaves_out_tool_output_and_every_generated_token_is_counted_once(harness_factory,
                                                                                           tmp_path):
    """Consumed groups count their model tokens only (tool output is masked out); an aborted group
    counts all its samples' tokens — finished samples whole, the first turn of one cut while its tool
    ran — so each step's engine tokens are exactly the consumed work plus tailsieve/aborted_tokens."""
    h = harness_factory(TOOL_LOOP + SETTLED + ["actor_rollout_ref.rollout.agent.default_agent_loop=two_turn_tool",
                                     "actor_rollout_ref.rollout.full_determinism=true",
                                     f"trainer.default_local_dir={tmp_path}"])
    steps = _watch(h.trainer)
    for _ in range(2):
        before = _engine_tokens(h)
        metrics = h.step()["metrics"]
        seen = steps[-1]
        assert sorted(seen["consumed"]) == seen["masked_work"]  # the record's lengths: response_mask == 1
        assert metrics["tailsieve/aborted_tokens"] == sum(seen["scores"].values()) > 0
        assert _engine_tokens(h) - before == sum(map(sum, seen["consumed"])) + metrics["tailsieve/aborted_tokens"]
    assert metrics["tailsieve/aborted_groups"] == 4
    assert metrics["tailsieve/bias/censored_share"] > 0  # the reference holds the aborted samples, as lower bounds
    assert ray.get(h.trainer.router.get_status.remote())["full_determinism"]  # rollout.full_determinism reached the pools


def test_an_aborted_sample_in_a_long_tool_call_still_counts_its_finished_turns(harness_factory, tmp_path):
    """The slow prompts' groups are aborted while their samples wait on a 12 s tool call, and the step
    closes without them after drain_timeout_s (they settle later): their abort score is still the work of the turns they had
    finished, so the step's engine tokens are again exactly the consumed work plus aborted_tokens."""
    h = harness_factory(TOOL_LOOP + ["actor_rollout_ref.rollout.agent.default_agent_loop=slow_tool", "data.shuffle=false",
                                     "tailsieve.drain_timeout_s=3",  # the step stops waiting for the 12 s tool calls
                                     f"trainer.default_local_dir={tmp_path}"])
    steps = _watch(h.trainer)
    before = _engine_tokens(h)
    metrics = h.step()["metrics"]
    seen = steps[-1]
    assert h.trainer.settling_aborts  # the slow groups were still in their tool call when the step closed
    assert _engine_tokens(h) - before == sum(map(sum, seen["consumed"])) + metrics["tailsieve/aborted_tokens"]
    slow = {identity for identity, row in h.trainer.carried_rows.items()
            if int(row["extra_info"][0]["prompt_id"][1:]) in _slow_tool_prompts()}
    assert slow and all(seen["scores"][identity] > 0 for identity in slow)


def test_an_agent_loop_returning_several_outputs_is_measured_and_trained_whole(harness_factory, tmp_path):
    """verl's TransferQueue worker stores every output of a loop that returns a list; TailSieve reports
    the sample once, its work over all outputs, and the step consumes B whole groups. A consumed group
    whose report is lost is measured from TransferQueue the same way (every output's response_mask)."""
    h = harness_factory(TOOL_LOOP + SETTLED + ["actor_rollout_ref.rollout.agent.default_agent_loop=two_outputs",
                                     f"trainer.default_local_dir={tmp_path}"])
    steps = _watch(h.trainer)
    collect = h.trainer._collect_reports

    def lose_one_report(*args, **kwargs):  # a finished group's (almost every sample takes two turns)
        reports = collect(*args, **kwargs)
        lost = next(uid for uid, r in reports.items() if not r["aborted"])
        return {uid: r for uid, r in reports.items() if uid != lost}

    h.trainer._collect_reports = lose_one_report
    for _ in range(2):
        result = h.step()
        assert len(set(result["prompt_ids"])) == B and result["metrics"]["tailsieve/aborted_groups"] == 4
        seen = steps[-1]
        assert sorted(seen["consumed"]) == seen["masked_work"]
        assert seen["outputs_per_session"][2] > 0  # two-turn samples: two trajectories each
