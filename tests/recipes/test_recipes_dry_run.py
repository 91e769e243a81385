"""Every recipe composes against the installed verl 0.9.1 and passes verl's and TailSieve's start-up
validation; the composed configs carry Dr. GRPO, matched sampling, the seed's replica layout, and
speculative decoding exactly where each variant intends it.

Every recipe runs through the dry-run function in-process (its exact Hydra arguments come from the
recipe itself via TAILSIEVE_PRINT_ARGS=1); `TAILSIEVE_DRY_RUN=1 bash recipes/<r>.sh` end to end
runs for a representative subset, since each cold start imports verl (~10 s on 2 cores)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.sh") if p.name != "common.sh")
DRAFT = "/models/qwen3-dflash-drafter"
MODELS = ("qwen3_5-2b", "qwen3-4b", "qwen3-8b", "qwen3-30b-a3b", "qwen3_5-35b-a3b")
# the controller's perf model of each recipe: the model's own rows of a bundled H200 table, or, for a
# model no table measures, the nearest rows, which the recipe's header says it borrows
OWN_TABLE = {"qwen3-4b": "table:h200-dense:qwen3-4b", "qwen3-8b": "table:h200-dense:qwen3-8b",
             "qwen3-30b-a3b": "table:h200-moe:qwen3-30b-a3b"}
BORROWED_TABLE = {"qwen3_5-2b": "table:h200-dense:qwen3-1.7b", "qwen3_5-35b-a3b": "table:h200-moe:qwen3-30b-a3b"}
PLANS = ROOT / "scripts" / "results" / "recipes"


def recipe_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, DFLASH_DRAFT_PATH=DRAFT)
    for key in ("TAILSIEVE_DRY_RUN", "TAILSIEVE_PRINT_ARGS", "MODEL_PATH", "WORKLOAD", "N_GPUS", "NNODES", "TEST_FREQ",
                "MAX_PROMPT_LENGTH", "MAX_RESPONSE_LENGTH", "ROLLOUT_N", "TRAIN_BATCH_SIZE", "TOTAL_STEPS",
                "TAILSIEVE_Q0", "TAILSIEVE_M0", "PERF_MODEL", "MTP_BULK_TOKENS", "MTP_TAIL_TOKENS", "MTP_SCHEDULE"):
        env.pop(key, None)
    env.update(extra)
    return env


def recipe_args(recipe: Path, **env: str) -> list[str]:
    proc = subprocess.run(["bash", str(recipe)], env=recipe_env(TAILSIEVE_PRINT_ARGS="1", **env),
                          capture_output=True, text=True, check=True)
    cmd = proc.stdout.splitlines()
    assert cmd[:3] == [sys.executable, "-m", "verl.trainer.main_ppo"]
    return cmd[3:]


def model_and_kind(recipe: Path) -> tuple[str, str]:
    model = next(m for m in sorted(MODELS, key=len, reverse=True) if recipe.stem.startswith(m + "_"))
    return model, recipe.stem.removeprefix(model + "_")


def header(recipe: Path) -> str:
    """The recipe's opening comment, its lines joined."""
    lines = recipe.read_text().splitlines()[1:]
    return " ".join(line.removeprefix("#").strip() for line in lines[:next(i for i, s in enumerate(lines)
                                                                               if not s.startswith("#"))])


def test_recipe_set_covers_the_issue():
    names = {p.stem for p in RECIPES}
    for model in MODELS:
        for v in ("verl", "samepath", "tailsieve"):
            assert f"{model}_{v}" in names
    for model in ("qwen3_5-2b", "qwen3_5-35b-a3b"):
        assert {f"{model}_verl_mtp", f"{model}_verl_dynsd", f"{model}_samepath_mtp", f"{model}_tailsieve_mtp"} <= names
    for model in ("qwen3-4b", "qwen3-8b", "qwen3-30b-a3b"):
        assert f"{model}_tailsieve_dflash" in names


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_names_its_stock_baseline(recipe):
    """Stock verl is every A/B's baseline: each recipe's header names the stock recipe it compares with
    (the MTP variants: stock verl with MTP on every replica), which exists and runs verl's own trainer; the
    same-path control says what it is."""
    model, kind = model_and_kind(recipe)
    text = header(recipe)
    assert "uniform" not in text  # one meaning per word: uniform is group round-robin, which no recipe runs
    if kind == "verl":
        assert "stock verl, the A/B baseline" in text and "Compare with" not in text
        return
    line = next(line for line in recipe.read_text().splitlines() if line.startswith("# Compare with the stock-verl baseline: "))
    baseline = ROOT / line.split(": ", 1)[1].split()[0]
    wanted = "verl_mtp" if kind in ("tailsieve_mtp", "samepath_mtp") else "verl"
    assert baseline == ROOT / "recipes" / f"{model}_{wanted}.sh" and baseline.exists()
    assert "stock_verl\n" in baseline.read_text() or "stock_verl_mtp\n" in baseline.read_text()
    if kind == "samepath":
        assert "stock verl's per-sample least-loaded routing run through the plugin's code path" in text
        assert "(+tailsieve.enable=false, (q, m) = (0, 0))" in text and "isolates the plugin's overhead" in text


@pytest.fixture(scope="module")
def dry_run():
    from tailsieve_verl.integration.dry_run import dry_run as run

    return run


def plan_summary(plans):
    return [(p.pool, p.mtp_rollout, p.num_speculative_tokens, p.speculative_config) for p in plans]


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_dry_runs(recipe, dry_run):
    config, tailsieve, plans = dry_run(recipe_args(recipe))
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout

    # Dr. GRPO
    assert config.algorithm.adv_estimator == "grpo"
    assert config.algorithm.norm_adv_by_std_in_grpo is False
    assert config.algorithm.use_kl_in_reward is False
    assert actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert actor.loss_scale_factor == config.data.max_response_length == rollout.response_length
    assert actor.use_kl_loss is False and actor.entropy_coeff == 0
    # matched sampling (math workload by default)
    assert (rollout.n, rollout.temperature, rollout.top_p, rollout.top_k) == (8, 1.0, 1.0, -1)
    assert config.data.max_response_length == 8192
    assert tailsieve.stop == ("<END>",)  # the math template's terminator, on every recipe
    assert config.reward.custom_reward_function.path == "pkg://tailsieve_verl.rewards"
    # layout: eight TP1 replicas, or four TP2 for the two MoE models
    tp = 2 if "a3b" in recipe.stem else 1
    assert rollout.tensor_model_parallel_size == tp and len(plans) == 8 // tp
    assert actor.fsdp_config.param_offload == actor.fsdp_config.optimizer_offload == (tp == 2)
    kind = recipe.stem.split("_", 1)[1] if not recipe.stem.startswith("qwen3_5") else recipe.stem.split("_", 2)[2]
    # stock verl: verl's own sync trainer and router; only the stop-string agent wrapper is the plugin's
    assert config.trainer.v1.trainer_mode == ("sync" if kind.startswith("verl") else "tailsieve")
    # every arm samples through the same agent-loop wrapper (the stop strings) around verl's default agent
    # loop, validation included, and validates before training and every 10 steps (issue 31)
    assert rollout.agent.default_agent_loop == "tailsieve_agent"
    assert rollout.custom.tailsieve_inner_agent_loop == "single_turn_agent"
    assert config.trainer.val_before_train is True and config.trainer.test_freq == 10
    assert config.data.val_files.endswith("/math/test.parquet")
    if kind.startswith("verl"):
        assert not tailsieve.active
    bulk_depth = 1
    if kind.startswith("samepath") or kind.startswith("verl"):
        assert not tailsieve.active
        assert {p.pool for p in plans} == {"shared"}
    else:
        assert tailsieve.active and tailsieve.tail_replicas >= 0  # 0: adaptive from one shared pool
        assert [p.pool for p in plans] == ["tail"] * tailsieve.tail_replicas + ["bulk"] * (len(plans) - tailsieve.tail_replicas)
        # the controller simulates this model's own table rows, or the nearest ones the header says it borrows
        model = model_and_kind(recipe)[0]
        if model in OWN_TABLE:
            assert tailsieve.perf_model == OWN_TABLE[model]
            assert f"perf model: {OWN_TABLE[model]}, this model's own rows" in header(recipe)
        else:
            assert tailsieve.perf_model == BORROWED_TABLE[model]
            assert f"perf model: {BORROWED_TABLE[model]}, borrowed:" in header(recipe)
    if kind == "tailsieve":  # adaptive from one shared pool, where every measured result starts
        assert tailsieve.mode == "adaptive" and (tailsieve.q0, tailsieve.tail_replicas) == (0, 0)
    if kind in ("verl", "samepath", "tailsieve"):
        assert all(p[1:] == (False, None, None) for p in plan_summary(plans))
    if kind in ("samepath_mtp", "verl_mtp"):
        assert all(p[1:] == (True, bulk_depth, None) for p in plan_summary(plans))
    if kind == "verl_dynsd":  # vLLM's documented batch-size schedule on every replica, depth = its deepest k
        schedule = {"num_speculative_tokens_per_batch_size": [[1, 64, 3], [65, 128, 1], [129, 256, 0]]}
        assert all(p[1:] == (True, 3, schedule) for p in plan_summary(plans))
    if kind == "tailsieve_mtp":  # the TailSieve engines `tailsieve plan` ranks best (test_mtp_recipe_runs_the_plans_pick)
        doc = {"num_speculative_tokens_per_batch_size": [[1, 64, 3], [65, 128, 1], [129, 256, 0]]}
        if tp == 2:  # tailsieve-dynsd: vLLM's documented schedule on every replica, m free from one shared pool
            assert tailsieve.mode == "adaptive" and (tailsieve.q0, tailsieve.tail_replicas) == (0, 0)
            assert all(p[1:] == (True, 3, doc) for p in plan_summary(plans))
        else:  # tailsieve-spec: the tail pool at k = 6 on four replicas, the bulk pool on the schedule
            assert tailsieve.mode == "fixed" and (tailsieve.q0, tailsieve.tail_replicas) == (8, 4)
            assert plan_summary(plans) == [("tail", True, 6, None)] * 4 + [("bulk", True, 3, doc)] * 4
    if kind == "tailsieve_dflash":
        assert not config.actor_rollout_ref.model.mtp.enable_rollout
        for pool, mtp, depth, spec in plan_summary(plans):
            assert not mtp
            if pool == "tail":
                assert spec == {"method": "dflash", "model": DRAFT, "num_speculative_tokens": 8}
            else:
                assert spec is None


@pytest.mark.parametrize("model", MODELS)
def test_a_split_is_pinned_only_where_the_recipes_plan_picks_one(model, dry_run):
    """Each model's committed `tailsieve plan` (scripts/results/recipes/, its command on the first line)
    plans the recipes' own shape: B, n, replicas, response cap and the controller's perf table. A fixed
    recipe pins exactly the split that plan picks; where it picks one shared pool there is none."""
    plan = (PLANS / f"{model}_tailsieve_fixed_plan.txt").read_text().splitlines()
    flags = dict(zip(*[iter(shlex.split(plan[0])[2:])] * 2))
    config, tailsieve, plans = dry_run(recipe_args(ROOT / "recipes" / f"{model}_tailsieve.sh"))
    assert plan[0].startswith("tailsieve plan --workload ")
    assert (int(flags["--batch"]), int(flags["--n"]), int(flags["--replicas"]), int(flags["--max-response-length"])) \
        == (config.data.train_batch_size, config.actor_rollout_ref.rollout.n, len(plans), config.data.max_response_length)
    assert flags["--perf-model"] == tailsieve.perf_model
    pick = next(line for line in plan if line.startswith("best fixed split: "))
    fixed = ROOT / "recipes" / f"{model}_tailsieve_fixed.sh"
    if pick.startswith("best fixed split: one shared pool"):
        assert not fixed.exists()
        return
    q, m = (int(x) for x in re.match(r"best fixed split: q=(\d+), m=(\d+),", pick).groups())
    _, pinned, _ = dry_run(recipe_args(fixed))
    assert (pinned.mode, pinned.q0, pinned.tail_replicas) == ("fixed", q, m)
    assert pinned.controller_config().inner_loop is False


def test_sampling_is_shared_per_workload(dry_run):
    seen = {}
    for workload in ("math", "code"):
        for recipe in (RECIPES[0], RECIPES[-1]):
            config, _, _ = dry_run(recipe_args(recipe, WORKLOAD=workload))
            r = config.actor_rollout_ref.rollout
            seen.setdefault(workload, set()).add((r.n, r.temperature, r.top_p, r.response_length,
                                                  config.actor_rollout_ref.actor.loss_scale_factor))
            assert config.data.train_files.endswith(f"/{workload}/train.parquet")
    assert {len(v) for v in seen.values()} == {1}
    assert seen["math"] != seen["code"]


def test_environment_overrides_reach_the_config(dry_run):
    recipe = ROOT / "recipes" / "qwen3_5-2b_tailsieve_mtp.sh"
    args = recipe_args(recipe, MODEL_PATH="/ckpt/qwen", N_GPUS="4", TAILSIEVE_M0="2", MTP_TAIL_TOKENS="5",
                       LOGGER='["console","file","tensorboard"]', MAX_PROMPT_LENGTH="128", MAX_RESPONSE_LENGTH="64",
                       ROLLOUT_N="4", TEST_FREQ="2")
    config, tailsieve, plans = dry_run(args)
    assert config.actor_rollout_ref.model.path == "/ckpt/qwen"
    # the sizes the E2E tier swaps in (tests/e2e/test_e2e_recipes.py), with every value derived from them
    assert (config.data.max_prompt_length, config.data.max_response_length, config.actor_rollout_ref.rollout.n) == (128, 64, 4)
    assert config.actor_rollout_ref.actor.loss_scale_factor == 64
    assert (config.trainer.val_before_train, config.trainer.test_freq) == (True, 2)
    off, _, _ = dry_run(recipe_args(recipe, TEST_FREQ="-1"))
    assert (off.trainer.val_before_train, off.trainer.test_freq) == (False, -1)
    assert list(config.trainer.logger) == ["console", "file", "tensorboard"]
    doc = {"num_speculative_tokens_per_batch_size": [[1, 64, 3], [65, 128, 1], [129, 256, 0]]}
    assert plan_summary(plans) == [("tail", True, 5, None)] * 2 + [("bulk", True, 3, doc)] * 2
    _, _, plans = dry_run(recipe_args(recipe, MTP_BULK_TOKENS="2"))  # a depth instead of the plan's schedule
    assert plan_summary(plans) == [("tail", True, 6, None)] * 4 + [("bulk", True, 2, None)] * 4


def run_recipe(name: str, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "recipes" / f"{name}.sh"), *overrides],
                          env=recipe_env(TAILSIEVE_DRY_RUN="1", **env), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name, ending", [("qwen3_5-2b_tailsieve_mtp", "tailsieve active"),
                                          ("qwen3-30b-a3b_samepath", "stock verl's per-sample routing"),
                                          ("qwen3-8b_verl", "stock verl (its own trainer and per-sample router)")])
def test_dry_run_end_to_end_through_bash(name, ending):
    proc = run_recipe(name)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for header in ("# algorithm", "# actor_rollout_ref.rollout", "# tailsieve", "# rollout replicas (engine settings at launch)"):
        assert f"\n{header}\n" in "\n" + out
    assert "norm_adv_by_std_in_grpo: false" in out
    assert out.rstrip().endswith(ending)


def test_dry_run_rejects_an_impossible_split():
    proc = run_recipe("qwen3-4b_tailsieve", "tailsieve.tail_replicas=8")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tailsieve dry run: error:") and "tail_replicas=8" in last


def test_dflash_recipe_needs_a_drafter():
    env = recipe_env(TAILSIEVE_PRINT_ARGS="1")
    env.pop("DFLASH_DRAFT_PATH")
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "qwen3-8b_tailsieve_dflash.sh")], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "DFLASH_DRAFT_PATH" in proc.stderr


def test_shipped_config_name_form_and_bad_overrides(dry_run):
    from tailsieve_verl.integration.dry_run import DryRunError

    base = ["actor_rollout_ref.model.path=/models/any", "actor_rollout_ref.rollout.name=vllm",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True"]
    shipped = ["--config-path=pkg://tailsieve_verl.config", "--config-name", "tailsieve_trainer", *base]
    _, tailsieve, plans = dry_run(shipped)  # starts at one shared pool, where every measured result starts
    assert tailsieve.active and tailsieve.mode == "adaptive" and (tailsieve.q0, tailsieve.tail_replicas) == (0, 0)
    assert {p.pool for p in plans} == {"bulk"}
    config, tailsieve, plans = dry_run([*shipped, "tailsieve.q0=4", "tailsieve.tail_replicas=1"])
    assert config.trainer.v1.trainer_mode == "tailsieve" and tailsieve.q0 == 4 and tailsieve.active
    assert config.actor_rollout_ref.rollout.router_config_path.endswith("router.yaml")
    assert config.actor_rollout_ref.rollout.custom.tailsieve.q0 == 4
    with pytest.raises(DryRunError, match="Hydra could not compose"):
        dry_run([*base, "actor_rollout_ref.rollout.no_such_key=1"])
    with pytest.raises(DryRunError, match="unsupported command-line flag"):
        dry_run(["--multirun", *base])


def test_dynsd_schedule_from_the_environment(dry_run):
    recipe = ROOT / "recipes" / "qwen3_5-35b-a3b_verl_dynsd.sh"
    config, _, plans = dry_run(recipe_args(recipe, MTP_SCHEDULE="[[1,32,6],[33,64,1],[65,256,0]]"))
    schedule = {"num_speculative_tokens_per_batch_size": [[1, 32, 6], [33, 64, 1], [65, 256, 0]]}
    assert plan_summary(plans) == [("shared", True, 6, schedule)] * 4  # the depth is the schedule's deepest k


def test_dynsd_rejects_a_bad_schedule_in_one_line():
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "qwen3_5-2b_verl_dynsd.sh")],
                          env=recipe_env(TAILSIEVE_PRINT_ARGS="1", MTP_SCHEDULE="1-64:3"), capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("qwen3_5-2b_verl_dynsd: MTP_SCHEDULE must be a JSON list of "
                                                    "[batch_lo, batch_hi, k], got '1-64:3'")


def label_engine(label: str) -> tuple[int, dict | None]:
    """A plan's engine label (``k=K`` or a schedule) as the dry run's (depth, speculative_config)."""
    from tailsieve_verl.cli.recommend import parse_schedule

    if label.startswith("k="):
        return int(label.removeprefix("k=")), None
    schedule = parse_schedule(label)
    return max(k for *_, k in schedule), {"num_speculative_tokens_per_batch_size": schedule}


@pytest.mark.parametrize("name", ["qwen3_5-2b_tailsieve_mtp", "qwen3_5-35b-a3b_tailsieve_mtp"])
def test_mtp_recipe_runs_the_plans_pick(name, dry_run, capsys):
    """Each TailSieve MTP recipe names the `tailsieve plan` command for its bundled profile and runs what it
    picks: where the pick is the stock fallback, the recipe says so, names that configuration and its
    prediction, and runs the plan's best TailSieve configuration (its engines per pool, its split).
    Runs the recipe's exact command (~30-50 s on 2 cores)."""
    from tailsieve_verl.cli import plan as plan_cli

    recipe = ROOT / "recipes" / f"{name}.sh"
    lines = recipe.read_text().splitlines()
    comment = " ".join(line.lstrip("# ") for line in lines if line.startswith("#"))
    command = next(line.removeprefix("#").strip() for line in lines if line.startswith("#   tailsieve plan "))
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    assert plan_cli.run(parser.parse_args(shlex.split(command)[1:] + ["--json"])) == 0
    plan = json.loads(capsys.readouterr().out.splitlines()[-1])
    stock, best = plan["best_stock"], max(plan["candidates"], key=lambda c: c["speedup_vs_best_stock"])
    assert ("Its pick is the stock fallback" in comment) == plan["choice"]["fallback"]
    assert f"({stock['name']}, predicted {stock['speedup_vs_verl']:.2f}x stock verl)" in comment
    depth, schedule = label_engine(stock["label"])
    assert (json.dumps(schedule["num_speculative_tokens_per_batch_size"], separators=(",", ":")) in comment
            if schedule else f"MTP_BULK_TOKENS={depth} bash" in comment)
    assert f"best TailSieve configuration, {best['name']}" in comment
    assert f"predicted {best['speedup_vs_best_stock']:.3f}x the pick" in comment

    _, tailsieve, plans = dry_run(recipe_args(recipe))
    assert tailsieve.mode == ("fixed" if best["name"] == "tailsieve-spec" else "adaptive")
    m = tailsieve.tail_replicas
    assert m == best["m"]  # the trainer starts where the plan did (m = 0: one shared pool)
    assert plan_summary(plans) == ([("tail", True, *label_engine(best["engines"]["tail"]))] * m
                                   + [("bulk", True, *label_engine(best["engines"]["bulk"]))] * (len(plans) - m))


def _pick(name: str, label: str, q: int, m: int):
    from tailsieve_verl.core.simulation.planner import Configuration

    return Configuration(name, label, {}, q, m, 1.0, (1.0, 1.0), 1.0, (1.0, 1.0))


@pytest.mark.parametrize("recipe, printed", [
    # plan's "to pin it" line and its pinned candidate, on a recipe that already sets tailsieve.mode, q0,
    # tail_replicas and perf_model, and on stock verl's recipe, which sets none of them
    ("qwen3-8b_tailsieve", lambda r: f"{r.TRAINER_MODE} {r.perf_model_override('table:h200-moe')} {r.pin_overrides(4, 2)}"),
    ("qwen3-8b_verl", lambda r: f"{r.TRAINER_MODE} {r.pin_overrides(4, 2)}"),
    # a plan's speculation picks: per-pool engines on an MTP recipe, vLLM's schedule on the dynamic-SD recipe
    ("qwen3_5-2b_tailsieve_mtp", lambda r: r.plan_overrides(_pick("tailsieve-spec", "tail k=6 / bulk 1-64:3,65-128:1",
                                                                   4, 2), "table:h200-dense")),
    ("qwen3_5-35b-a3b_verl_dynsd", lambda r: r.plan_overrides(_pick("verl-dynsd", "1-32:4,33-64:1", 0, 0),
                                                                 "table:h200-moe")),
])
def test_printed_overrides_compose_when_appended_to_a_shipped_recipe(dry_run, recipe, printed):
    """What `plan` and `simulate` print after "add to your verl command" is appended to a recipe's command
    line as a user would: Hydra must take it whether or not the recipe already sets the key."""
    from tailsieve_verl.cli import recommend

    line = printed(recommend)
    config, tailsieve, _ = dry_run([*recipe_args(ROOT / "recipes" / f"{recipe}.sh"), *shlex.split(line)])
    if "tailsieve.mode=fixed" in line:
        assert tailsieve.active and tailsieve.mode == "fixed" and tailsieve.tail_replicas == 2
        assert tailsieve.q0 == 4 and tailsieve.controller.get("inner_loop") is (False if "inner_loop" in line else None)
    if "table:h200-moe" in line and recipe.startswith("qwen3-8b"):
        assert tailsieve.perf_model == "table:h200-moe"
    if recipe.endswith("tailsieve_mtp"):
        assert tailsieve.tail.num_speculative_tokens == 6 and list(map(list, tailsieve.bulk.spec_schedule)) == [[1, 64, 3], [65, 128, 1]]
    if recipe.endswith("dynsd"):
        spec = config.actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config
        assert list(map(list, spec.num_speculative_tokens_per_batch_size)) == [[1, 32, 4], [33, 64, 1]]
