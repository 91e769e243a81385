"""A request the engine refuses, on verl's real rollout path with simulated replicas whose request
validation refuses a long prompt as vLLM does (VLLMValidationError): the step stops at once naming the
prompt and the engine's reason, or (on_refused_request=skip) drops the prompt, counted, and trains a
fresh one in its place: exactly B groups, none twice. A prompt that fails verl's own check instead
(its ValueError when no room is left under max_model_len) is no refusal: its group is kept, as stock
verl keeps a failed group, and the run goes on."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tailsieve_verl.integration.agent_loop import refusal_reason
from tailsieve_verl.integration.trainer import RolloutStepError

B, N = 8, 2
LONG = "p2"  # ~50 prompt tokens, over a limit of 40: refused; the others (~27 tokens) fit


@pytest.fixture(scope="module")
def refusing_data(assets):
    import pandas as pd

    def text(i: int) -> str:
        return " ".join(["a long question about numbers"] * 2) if f"p{i}" == LONG else f"prompt number {i}: the sum of {i} and 3"

    rows = [{"data_source": "tailsieve_test", "prompt": [{"role": "user", "content": text(i)}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)},
             "extra_info": {"split": "train", "index": i, "prompt_id": f"p{i}"}} for i in range(40)]
    path = assets.root / "refusing.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


def _overrides(data, tmp_path, *extra: str, limit: str = "+tailsieve.sim.max_prompt_tokens=40") -> list[str]:
    return [f"data.train_files={data}", "data.shuffle=false", limit,
            "+tailsieve.mode=fixed", "+tailsieve.q0=2", "+tailsieve.tail_replicas=1",
            "+tailsieve.controller.inner_loop=false", f"trainer.default_local_dir={tmp_path}", *extra]


def test_a_refused_prompt_stops_the_step_at_once_naming_it_and_the_engines_reason(harness_factory, refusing_data,
                                                                                  tmp_path):
    h = harness_factory(_overrides(refusing_data, tmp_path))
    start = time.monotonic()
    with pytest.raises(RolloutStepError) as error:
        h.step()
    line = str(error.value)
    assert "\n" not in line
    assert "the engine refused fresh prompt" in line and "'a long question about numbers a long" in line
    assert "VLLMValidationError: The prompt (length" in line and "(40 tokens)" in line
    assert "+tailsieve.on_refused_request=skip" in line
    assert h.trainer.step_state.redispatched == 0  # not retried: a refusal fails the same way everywhere
    assert time.monotonic() - start < 60


def test_skip_drops_the_refused_prompt_counted_and_trains_exactly_b_other_groups(harness_factory, refusing_data,
                                                                                tmp_path, caplog):
    h = harness_factory(_overrides(refusing_data, tmp_path, "+tailsieve.on_refused_request=skip"))
    trained: list[str] = []
    refused_per_step = []
    for _ in range(3):
        result = h.step()
        refused_per_step.append(result["metrics"]["tailsieve/refused_groups"])
        groups = Counter(key.split("_")[0] for key in result["batch"].keys)
        assert len(groups) == B and set(groups.values()) == {N}  # exactly B whole groups
        trained += sorted(set(result["prompt_ids"]))
    assert LONG not in trained and len(trained) == len(set(trained)) == 3 * B  # none lost to the slot, none twice
    assert len(h.trainer.skipped_prompts) == 1 and sum(refused_per_step) == 1
    assert "tailsieve.on_refused_request=skip: dropped (1 prompts this run)" in caplog.text


def test_verls_own_length_check_fails_the_group_as_stock_verl_does_and_the_run_goes_on(harness_factory, refusing_data,
                                                                                       tmp_path, caplog):
    h = harness_factory(_overrides(refusing_data, tmp_path, limit="actor_rollout_ref.rollout.max_model_len=40"))
    trained: list[str] = []
    for _ in range(2):
        result = h.step()
        assert result["metrics"]["tailsieve/refused_groups"] == 0
        trained += sorted(set(result["prompt_ids"]))
    assert LONG not in trained and len(trained) == len(set(trained)) == 2 * B - 1  # its group trains no sample
    assert not h.trainer.skipped_prompts
    assert "failed in its agent loop" in caplog.text and "as stock verl does" in caplog.text


def test_only_an_input_the_engine_rejects_counts_as_a_refusal():
    import ray

    class VLLMClientError(Exception):  # vLLM's base of its request validation errors (not a ValueError)
        pass

    def raised_in_actor(exc: BaseException) -> BaseException:
        return ray.exceptions.RayTaskError("generate", "traceback", exc).as_instanceof_cause()

    assert refusal_reason(raised_in_actor(ValueError("Prompt length (50) leaves no room"))) is None  # verl's check
    assert refusal_reason(raised_in_actor(TypeError("unexpected keyword"))) is None
    assert refusal_reason(raised_in_actor(VLLMClientError("top_p must be in (0, 1], got 2.0"))).startswith(
        "VLLMClientError: top_p")
    assert refusal_reason(raised_in_actor(RuntimeError("engine core died"))) is None  # a server fault: retry
    assert refusal_reason(ray.exceptions.RayActorError()) is None  # a dead replica: retry elsewhere
