"""Start-up validation and wiring of a composed verl config (no Ray, no workers)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from tailsieve_verl.core.errors import TailSieveError
from tailsieve_verl.integration.config import (
    TailSieveConfigError,
    parse_tailsieve_section,
    router_config_path,
    validate_verl_config,
    wire_verl_config,
)

BASE = ["trainer.n_gpus_per_node=4", "trainer.nnodes=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=vllm", "data.train_batch_size=32"]


def shipped(overrides: list[str], tail_replicas: int = 1):
    """The shipped config; these cases start with a tail pool of ``tail_replicas`` unless they set it."""
    if not any(o.startswith("tailsieve.tail_replicas=") for o in overrides):
        overrides = [*overrides, f"tailsieve.tail_replicas={tail_replicas}"]
    with initialize_config_module("tailsieve_verl.config", version_base=None):
        return compose("tailsieve_trainer", overrides=BASE + overrides)


def test_the_shipped_config_starts_at_one_shared_pool_where_the_measured_results_start():
    with initialize_config_module("tailsieve_verl.config", version_base=None):
        settings = validate_verl_config(compose("tailsieve_trainer", overrides=BASE))
    assert settings.active and (settings.q0, settings.tail_replicas) == (0, 0)
    assert settings.controller_config().plan_probe
    with initialize_config_module("tailsieve_verl.config", version_base=None):  # and its same-path arm launches
        same_path = validate_verl_config(compose("tailsieve_trainer", overrides=[*BASE, "tailsieve.enable=false"]))
    assert not same_path.active and (same_path.initial_q, same_path.initial_m) == (0, 0)


def stock(overrides: list[str]):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=BASE + overrides)


def test_a_launch_by_overrides_alone_and_one_by_the_shipped_config_build_the_same_controller():
    """One default: ``trainer.v1.trainer_mode=tailsieve`` on stock verl's config and the shipped config, each with
    nothing else set, give the same settings and the same controller, started at one shared pool."""
    from tailsieve_verl.core.tailsieve.controller import initial_split

    by_overrides = validate_verl_config(stock(["trainer.v1.trainer_mode=tailsieve"]))
    with initialize_config_module("tailsieve_verl.config", version_base=None):
        by_config = validate_verl_config(compose("tailsieve_trainer", overrides=BASE))
    assert by_overrides == by_config
    assert by_overrides.controller_config() == by_config.controller_config()
    assert initial_split(by_overrides.controller_config(), 4, 32) == (0, 0)


def test_shipped_config_and_plain_overrides_give_the_same_settings():
    a = validate_verl_config(shipped(["tailsieve.q0=4", "tailsieve.tail_replicas=1"]))
    b = validate_verl_config(stock(["trainer.v1.trainer_mode=tailsieve", "+tailsieve.q0=4", "+tailsieve.tail_replicas=1"]))
    assert a.q0 == b.q0 == 4 and a.tail_replicas == b.tail_replicas == 1 and a.active and b.active
    assert (a.initial_q, a.initial_m) == (4, 1)


def test_adaptive_mode_starts_at_one_shared_pool_as_recommend_says():
    """What `tailsieve simulate`/`plan` recommend for a run that starts at (q, m) = (0, 0) launches: the
    adaptive controller starts there (it reaches (0, 0) at run time anyway)."""
    from tailsieve_verl.cli.recommend import TRAINER_MODE, adaptive_start
    from tailsieve_verl.core.tailsieve.controller import initial_split

    cfg = validate_verl_config(stock([TRAINER_MODE, *adaptive_start(0, 0).split()]))
    assert cfg.active and (cfg.initial_q, cfg.initial_m) == (0, 0) and not cfg.pins_split
    assert initial_split(cfg.controller_config(), 4, 32) == (0, 0)


def test_stop_strings_are_read_as_a_list():
    assert validate_verl_config(shipped(["+tailsieve.stop=['<END>']"])).stop == ("<END>",)
    assert validate_verl_config(shipped([])).stop == ()


def test_disabled_mode_is_the_zero_boundary():
    for flag in ("+tailsieve.enable=false", "+tailsieve.mode=disabled"):
        cfg = validate_verl_config(stock(["trainer.v1.trainer_mode=tailsieve", flag]))
        assert not cfg.active and (cfg.initial_q, cfg.initial_m) == (0, 0)
    # the same-path control also runs where no tail pool fits
    cfg = validate_verl_config(stock(["trainer.v1.trainer_mode=tailsieve", "+tailsieve.enable=false",
                                      "trainer.n_gpus_per_node=1"]))
    assert not cfg.active


def test_the_old_spelling_of_the_disabled_mode_still_launches_the_same_run():
    """``tailsieve.mode=uniform`` was the disabled mode's name until "uniform" came to mean group round-robin
    only; a command line that still says it gets the very same settings."""
    old, new = (validate_verl_config(stock(["trainer.v1.trainer_mode=tailsieve", f"+tailsieve.mode={mode}"]))
                for mode in ("uniform", "disabled"))
    assert old == new and old.mode == "disabled" and not old.active
    with pytest.raises(TailSieveConfigError, match="tailsieve.mode must be one of adaptive, fixed, disabled"):
        parse_tailsieve_section({"mode": "group-rr"})


@pytest.mark.parametrize("overrides, message", [
    (["tailsieve.tail_replicas=4"], "tail_replicas=4 must be in [0, 3]: the bulk pool needs"),
    (["tailsieve.mode=fixed", "tailsieve.tail_replicas=0"], "tail_replicas=0 must be in [1, 3] with tailsieve.mode=fixed"),
    (["tailsieve.tail_replicas=0", "+tailsieve.tail.max_num_seqs=16"],
     "tail_replicas=0 must be in [1, 3] with per-pool engine settings"),
    (["tailsieve.q0=4", "tailsieve.tail_replicas=0"], "q0 would be ignored; set tailsieve.q0=0"),
    (["tailsieve.q0=40"], "must be < data.train_batch_size=32"),
    (["tailsieve.q0=1", "tailsieve.tail_replicas=2"], "tailsieve.q0=1 is below tailsieve.tail_replicas=2"),
    (["tailsieve.perf_model=nope"], "unknown performance model"),
    (["actor_rollout_ref.rollout.name=trtllm"], "cannot abort single prompt groups"),
    (["actor_rollout_ref.rollout.name=sglang"], "cannot abort single prompt groups"),
    (["+tailsieve.stall_timeout_s=0"], "tailsieve.stall_timeout_s must be a number > 0"),
    (["+tailsieve.engine_call_timeout_s=-1"], "tailsieve.engine_call_timeout_s must be a number > 0"),
    (["+tailsieve.bias_warning_steps=-1"], "tailsieve.bias_warning_steps must be an integer >= 0"),
    (["trainer.use_v1=false"], "legacy RayPPOTrainer"),
    (["trainer.v1.trainer_mode=sync"], "set trainer.v1.trainer_mode=tailsieve"),
    (["+tailsieve.typo=1"], "unknown setting(s) tailsieve.typo"),
    (["skip.rollout_tq.enable=true"], "skip.rollout_tq.enable=true would be ignored"),
    (["+tailsieve.step_end_poll_s=0"], "tailsieve.step_end_poll_s must be a number > 0"),
    (["+tailsieve.controller.q_gain=3"], "q_gain must be in (0, 1]"),
    (["+tailsieve.controller.q_init=3"], "reserved"),
    (["trainer.n_gpus_per_node=1"], "at least 2 rollout replicas"),
    (["+tailsieve.tail.num_speculative_tokens=4"], "actor_rollout_ref.model.mtp.enable=true"),
    (["+tailsieve.bulk.max_num_seqs=0"], "tailsieve.bulk.max_num_seqs must be an integer >= 1"),
    (["+tailsieve.bulk.num_speculative_tokens=-1"], "tailsieve.bulk.num_speculative_tokens must be an integer >= 0"),
    (["actor_rollout_ref.model.mtp.enable=true", "+tailsieve.bulk.spec_schedule=[[2,8,1]]"],
     "tailsieve.bulk.spec_schedule: the spec schedule must start at batch 1"),
    (["actor_rollout_ref.model.mtp.enable=true", "+tailsieve.tail.num_speculative_tokens=2",
      "+tailsieve.tail.spec_schedule='1-8:3'"], "tailsieve.tail.spec_schedule: spec schedule k=3 for batch 1-8 must be in 0..2"),
    (["actor_rollout_ref.model.mtp.enable=true", "+tailsieve.bulk.num_speculative_tokens=0",
      "+tailsieve.bulk.spec_schedule=[[1,8,2]]"], "tailsieve.bulk.spec_schedule is set but the pool does not speculate"),
    (["+tailsieve.bulk.spec_schedule='1-8'"], "tailsieve.bulk.spec_schedule: schedule entry '1-8' lacks its :K"),
    (["+tailsieve.tail.spec_schedule=[[1,8,2]]"], "actor_rollout_ref.model.mtp.enable=true"),
    (["tailsieve.mode=sometimes"], "tailsieve.mode must be one of"),
    (["algorithm.filter_groups.enable=true"], "filter_groups"),
    (["trainer.v1.sampler.custom_sampler.path=my.py", "trainer.v1.sampler.custom_sampler.name=Mine"],
     "trainer.v1.sampler.custom_sampler (my.py:Mine) would be replaced"),
    (["+tailsieve.stop=[1]"], "tailsieve.stop must be a list of non-empty strings"),
    # settings that would be ignored stop the launch (issue 31)
    (["tailsieve.enable=false", "tailsieve.q0=4", "tailsieve.tail_replicas=0"],
     "tailsieve.q0 would be ignored: with tailsieve.enable=false"),
    (["tailsieve.enable=false", "tailsieve.tail_replicas=1"], "tailsieve.tail_replicas would be ignored"),
    (["tailsieve.mode=disabled", "+tailsieve.tail.max_num_seqs=16"], "tailsieve.tail would be ignored"),
    (["tailsieve.enable=false", "tailsieve.mode=fixed"], "tailsieve.mode=fixed would be ignored"),
    (["+tailsieve.sim.time_scale=2"], "tailsieve.sim.* would be ignored"),
    (["+tailsieve.tail_on_one_node=yes"], "tailsieve.tail_on_one_node must be true or false"),
    (["+tailsieve.record_replaces_aborts=1"], "tailsieve.record_replaces_aborts must be true or false"),
    (["tailsieve.mode=disabled", "+tailsieve.record_replaces_aborts=true"],
     "tailsieve.record_replaces_aborts would be ignored"),
    (["+tailsieve.tail_on_one_node=true", "trainer.nnodes=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=8"],
     "each rollout replica needs 8 GPUs (tp x dp x pp) and spans nodes of trainer.n_gpus_per_node=4"),
    (["+tailsieve.tail_on_one_node=true", "trainer.nnodes=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
      "tailsieve.mode=fixed", "tailsieve.q0=3", "tailsieve.tail_replicas=3"],
     "tailsieve.tail_replicas=3 with tailsieve.tail_on_one_node=true, but a node holds 2 rollout replicas"),
])
def test_invalid_settings_fail_with_one_clear_message(overrides, message):
    with pytest.raises(TailSieveConfigError) as err:
        validate_verl_config(shipped(overrides))
    assert message in str(err.value)
    assert isinstance(err.value, TailSieveError) and "\n" not in str(err.value)


def test_wiring_points_verl_at_the_router_and_hands_settings_to_replicas():
    config = shipped(["tailsieve.q0=4", "+tailsieve.bulk.max_num_seqs=128"])
    settings = wire_verl_config(config)
    rollout = config.actor_rollout_ref.rollout
    assert rollout.router_config_path == router_config_path()
    assert parse_tailsieve_section(rollout.custom.tailsieve) == settings
    again = wire_verl_config(config)  # idempotent
    assert again == settings


def test_wiring_refuses_to_replace_a_users_router():
    config = shipped(["actor_rollout_ref.rollout.router_config_path=/my/router.yaml"])
    with pytest.raises(TailSieveConfigError, match="routes groups to pools with its own router"):
        wire_verl_config(config)


def test_record_planned_steps_are_opt_in_from_hydra_in_adaptive_mode():
    """The trainer's step planner (core.simulation.step_split.run_step_planner): adaptive runs that ask for it get
    one; the default and a pinned split leave it out."""
    from tailsieve_verl.core.engine.replica import NO_LIMITS
    from tailsieve_verl.core.simulation.step_split import StepSplitPlanner, run_step_planner

    def planner(overrides: list[str]):
        settings = validate_verl_config(shipped(overrides))
        return run_step_planner(settings.controller_config(), 4, 32, settings.perf(), (NO_LIMITS, NO_LIMITS),
                                per_sample=not settings.group_atomic)

    on = ["+tailsieve.controller.record_plan=true"]
    assert isinstance(planner(on), StepSplitPlanner) and not planner(on).group_atomic
    assert planner(on + ["+tailsieve.group_atomic=true"]).group_atomic
    assert planner([]) is None  # opt-in
    assert planner(on + ["tailsieve.mode=fixed"]) is None
    assert validate_verl_config(shipped(["+tailsieve.controller.record_plan_coverage=0.8"])).controller_config(
    ).record_plan_coverage == 0.8


def test_fixed_mode_and_pool_engine_settings_pin_the_split():
    assert shipped(["tailsieve.mode=fixed", "tailsieve.q0=4"]) is not None
    fixed = validate_verl_config(shipped(["tailsieve.mode=fixed", "tailsieve.q0=4"])).controller_config()
    assert fixed.fixed_tail_replicas == 1 and fixed.inner_loop  # the paper's fixed allocation: m pinned, q adapts
    engine = validate_verl_config(shipped(["tailsieve.q0=4", "+tailsieve.tail.max_num_seqs=16"])).controller_config()
    assert engine.fixed_tail_replicas == 1 and engine.inner_loop
    adaptive = validate_verl_config(shipped(["tailsieve.q0=4"])).controller_config()
    assert adaptive.fixed_tail_replicas is None and (adaptive.q_init, adaptive.m_init) == (4, 1)


def test_rollout_dry_run_switches_to_simulated_replicas_of_the_real_layout():
    from tailsieve_verl.integration.rollout_only import dry_run_overrides

    out = dry_run_overrides(["trainer.n_gpus_per_node=8", "trainer.nnodes=2", "actor_rollout_ref.rollout.name=vllm"])
    with initialize_config_module("verl.trainer.config", version_base=None):
        config = compose("ppo_trainer", overrides=out + ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    rollout = config.actor_rollout_ref.rollout
    assert rollout.name == "tailsieve_sim" and config.trainer.v1.trainer_mode == "tailsieve"
    assert rollout.n_gpus_per_node * rollout.nnodes // rollout.tensor_model_parallel_size == 8


@pytest.mark.parametrize("overrides, named", [
    (["+tailsieve.q0=8"], "tailsieve.q0"),
    (["+tailsieve.q0=8", "+tailsieve.mode=fixed", "+tailsieve.stop=['<END>']"], "tailsieve.mode, tailsieve.q0"),
    (["+tailsieve.enable=true"], "tailsieve.enable"),
])
def test_a_setting_stock_verl_would_ignore_stops_the_launch(overrides, named):
    """Issue 31: in verl's own trainer modes only tailsieve.stop acts; a forgotten trainer mode must not
    silently give a plain stock run."""
    with pytest.raises(TailSieveConfigError) as err:
        wire_verl_config(stock(["trainer.v1.trainer_mode=sync", *overrides]))
    assert str(err.value).startswith(f"{named} would be ignored: trainer.v1.trainer_mode is 'sync'")
    assert "set trainer.v1.trainer_mode=tailsieve" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["sync", "tailsieve"])
def test_stop_strings_wire_the_agent_wrapper_in_every_trainer_mode(mode):
    """Issue 31: a stock baseline's stop strings and validation go through the same wrapper as the
    TailSieve trainer's; the user's default agent loop is what the wrapper runs."""
    from omegaconf import OmegaConf

    config = stock([f"trainer.v1.trainer_mode={mode}", "+tailsieve.stop=['<END>']",
                    "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"])
    settings = wire_verl_config(config)
    rollout = config.actor_rollout_ref.rollout
    assert settings.stop == ("<END>",) and settings.active == (mode == "tailsieve")
    assert rollout.agent.default_agent_loop == "tailsieve_agent"
    assert OmegaConf.select(rollout, "custom.tailsieve_inner_agent_loop") == "tool_agent"
    wire_verl_config(config)  # idempotent: the driver wires it, the trainer again in its __init__
    assert OmegaConf.select(rollout, "custom.tailsieve_inner_agent_loop") == "tool_agent"
    assert (OmegaConf.select(rollout, "router_config_path") == router_config_path()) == (mode == "tailsieve")


def test_stock_verl_without_stop_strings_is_left_alone():
    config = stock(["trainer.v1.trainer_mode=sync"])
    assert not wire_verl_config(config).active
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "single_turn_agent"


def test_naming_the_wrapper_as_the_default_agent_loop_is_refused_with_the_fix():
    config = stock(["trainer.v1.trainer_mode=sync", "+tailsieve.stop=['<END>']",
                    "actor_rollout_ref.rollout.agent.default_agent_loop=tailsieve_agent"])
    with pytest.raises(TailSieveConfigError, match="the plugin puts its wrapper in place itself; set default_agent_loop"):
        wire_verl_config(config)
