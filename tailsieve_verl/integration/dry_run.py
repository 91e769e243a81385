"""``TAILSIEVE_DRY_RUN=1 bash recipes/<recipe>.sh``: compose and validate a recipe's config, no GPU.

The recipe hands this module exactly the Hydra arguments it would hand ``verl.trainer.main_ppo``.
The dry run composes them against the installed verl's own Hydra configs (the same
``ppo_trainer`` primary config, or the ``--config-path/--config-name`` the recipe names), then
validates the result the way a real launch would before any worker starts:

0. TailSieve's own settings (:func:`tailsieve_verl.integration.config.validate_verl_config`), first,
   as a launch checks them before verl's (see :mod:`tailsieve_verl.integration.plugin`);
1. verl's ``validate_config`` (batch divisibility, actor config classes, micro-batch rules);
2. verl's config dataclasses for the sections the launch instantiates: ``algorithm``
   (``AlgoConfig``), ``actor_rollout_ref.rollout`` (``RolloutConfig``, as the agent loop builds it),
   ``actor_rollout_ref.model.mtp`` (``MtpConfig``), the rollout's checkpoint engine and
   ``distillation`` (both instantiated by the V1 trainer). ``HFModelConfig`` itself is skipped on
   purpose: it loads the tokenizer and HF config from ``model.path``, i.e. a download;
3. the trainer mode is registered in verl (the ``verl.plugins`` entry point is installed), the
   custom reward function loads, and TailSieve's own start-up wiring and validation
   (:func:`tailsieve_verl.integration.config.wire_verl_config`) accepts the config.

It prints the resolved ``algorithm``, ``actor_rollout_ref.rollout`` (as the trainer rewires it) and
``tailsieve`` sections, plus the engine settings every rollout replica is launched with (computed
by the same per-pool functions the replicas call), and exits 0; a config that would fail at start-up exits 2 with one line saying why. Nothing is
downloaded, no Ray or GPU is touched.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tailsieve_verl.core.errors import TailSieveError

STOCK_CONFIG_NAME = "ppo_trainer"
PRINTED_SECTIONS = ("algorithm", "actor_rollout_ref.rollout", "tailsieve")


class DryRunError(TailSieveError):
    """The recipe's config would not start; the message says which check failed and why."""


def parse_hydra_args(argv: Sequence[str]) -> tuple[str | None, str, list[str]]:
    """Split ``--config-path/--config-name`` (both ``--x=v`` and ``--x v`` forms) from the overrides."""
    parser = argparse.ArgumentParser(prog="tailsieve-dry-run", add_help=False)
    parser.add_argument("--config-path", "-cp", default=None)
    parser.add_argument("--config-name", "-cn", default=STOCK_CONFIG_NAME)
    known, overrides = parser.parse_known_args(list(argv))
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        raise DryRunError(f"unsupported command-line flag(s) {' '.join(flags)}: a recipe passes only "
                          "--config-path/--config-name and key=value overrides")
    return known.config_path, known.config_name, overrides


def compose(config_path: str | None, config_name: str, overrides: list[str]) -> Any:
    """Compose like ``@hydra.main`` in ``verl.trainer.main_ppo`` does, with verl's config dir as the
    default primary config location."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import verl.trainer.main_ppo as main_ppo

    GlobalHydra.instance().clear()
    if config_path is None:
        init = initialize_config_dir(config_dir=str(Path(main_ppo.__file__).parent / "config"), version_base=None)
    elif config_path.startswith("pkg://"):
        init = initialize_config_module(config_module=config_path[len("pkg://"):], version_base=None)
    else:
        init = initialize_config_dir(config_dir=str(Path(config_path).resolve()), version_base=None)
    try:
        with init:
            return hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise DryRunError(f"Hydra could not compose the config: {str(e).splitlines()[0]}") from None
    finally:
        GlobalHydra.instance().clear()


def validate_with_verl(config: Any) -> None:
    """verl's own start-up checks plus the config dataclasses a launch instantiates."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    checks = [
        ("verl validate_config", lambda: validate_config(config, use_reference_policy=need_reference_policy(config),
                                                          use_critic=need_critic(config))),
        ("algorithm (AlgoConfig)", lambda: omega_conf_to_dataclass(config.algorithm)),
        ("actor_rollout_ref.rollout (RolloutConfig)", lambda: omega_conf_to_dataclass(config.actor_rollout_ref.rollout)),
        ("actor_rollout_ref.model.mtp (MtpConfig)", lambda: omega_conf_to_dataclass(config.actor_rollout_ref.model.mtp)),
        ("actor_rollout_ref.rollout.checkpoint_engine", lambda: omega_conf_to_dataclass(
            config.actor_rollout_ref.rollout.checkpoint_engine)),
        ("distillation (DistillationConfig)", lambda: omega_conf_to_dataclass(config.distillation)),
    ]
    for name, check in checks:
        try:
            check()
        except Exception as e:  # verl raises AssertionError/ValueError/TypeError/omegaconf errors
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DryRunError(f"{name} rejects the config: {message}") from None


def check_trainer_mode(config: Any) -> None:
    """The trainer mode must be registered in verl: the plugin's entry point must be installed."""
    import verl  # noqa: F401  (loads the verl.plugins entry points)
    from verl.trainer.ppo.v1 import get_trainer_cls

    mode = config.trainer.v1.trainer_mode
    try:
        get_trainer_cls(mode)
    except Exception:
        raise DryRunError(f"trainer.v1.trainer_mode={mode!r} is not registered in verl; install the plugin in this "
                          "environment (pip install tailsieve-verl, or pip install -e . in a checkout) so verl loads "
                          "its verl.plugins entry point") from None


def check_reward_function(config: Any) -> None:
    """Load the custom reward function the way verl's reward workers will."""
    from omegaconf import OmegaConf
    from verl.utils.import_utils import load_extern_object

    path = OmegaConf.select(config, "reward.custom_reward_function.path")
    name = OmegaConf.select(config, "reward.custom_reward_function.name")
    if not path:
        return
    try:
        load_extern_object(module_path=path, object_name=name)
    except Exception as e:
        raise DryRunError(f"reward.custom_reward_function {path}:{name} does not load: {e}") from None


@dataclass(frozen=True)
class PoolPlan:
    """The rollout engine settings one replica is launched with."""

    replica_rank: int
    pool: str
    max_num_seqs: int
    mtp_rollout: bool  # the replica's vLLM engine drafts with the model's MTP head
    num_speculative_tokens: int | None
    speculative_config: dict | None  # extra vLLM speculative_config (e.g. DFlash), merged by verl at launch


def pool_plan(config: Any, tailsieve: Any) -> list[PoolPlan]:
    """Per-replica engine settings, computed by the same functions the TailSieve replicas call at
    launch (``integration.engine_config``) on verl's own ``RolloutConfig``."""
    from verl.utils.config import omega_conf_to_dataclass

    from tailsieve_verl.integration.config import rollout_replica_count
    from tailsieve_verl.integration.engine_config import launch_pool, pool_engine, specialise_rollout_config

    base = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    plans = []
    for rank in range(rollout_replica_count(config)):
        rollout = specialise_rollout_config(base, pool_engine(rank, tailsieve)) if tailsieve.active else base
        mtp = rollout.mtp
        mtp_rollout = bool(mtp is not None and mtp.enable and mtp.enable_rollout)
        vllm_kwargs = dict((rollout.engine_kwargs or {}).get("vllm") or {})
        spec = vllm_kwargs.get("speculative_config")
        plans.append(PoolPlan(rank, launch_pool(rank, tailsieve) if tailsieve.active else "shared",
                              int(rollout.max_num_seqs), mtp_rollout,
                              int(mtp.num_speculative_tokens) if mtp_rollout else None,
                              dict(spec) if spec else None))
    return plans


def dry_run(argv: Sequence[str]) -> tuple[Any, Any, list[PoolPlan]]:
    """Compose, validate and wire the config as the TailSieve trainer would at start-up; returns the
    composed DictConfig, the TailSieveConfig and the per-replica engine plan."""
    from omegaconf import OmegaConf

    from tailsieve_verl.integration.config import validate_verl_config, wire_verl_config

    config_path, config_name, overrides = parse_hydra_args(argv)
    config = compose(config_path, config_name, overrides)
    try:
        OmegaConf.resolve(config)
    except Exception as e:
        raise DryRunError(f"the config does not resolve: {str(e).splitlines()[0]}") from None
    validate_verl_config(config)  # TailSieve's settings first, as a launch checks them (see integration.plugin)
    validate_with_verl(config)
    check_trainer_mode(config)
    check_reward_function(config)
    tailsieve = wire_verl_config(config)
    return config, tailsieve, pool_plan(config, tailsieve)


def render(config: Any, plans: Sequence[PoolPlan]) -> str:
    from omegaconf import OmegaConf

    parts = []
    for path in PRINTED_SECTIONS:
        section = OmegaConf.select(config, path)
        body = OmegaConf.to_yaml(section) if section is not None else "null\n"
        parts.append(f"# {path}\n" + "".join(f"  {line}\n" for line in body.splitlines()))
    parts.append("# rollout replicas (engine settings at launch)\n")
    for p in plans:
        spec = "off"
        if p.mtp_rollout:
            spec = f"mtp x{p.num_speculative_tokens}"
        if p.speculative_config:
            spec = ("mtp + " if p.mtp_rollout else "") + json.dumps(p.speculative_config, sort_keys=True)
        parts.append(f"  replica {p.replica_rank}: pool={p.pool} max_num_seqs={p.max_num_seqs} speculative={spec}\n")
    return "".join(parts)


def missing_data_files(config: Any) -> list[str]:
    from omegaconf import OmegaConf

    missing = []
    for key in ("data.train_files", "data.val_files"):
        value = OmegaConf.select(config, key)
        files = list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]
        missing += [f"{key}={f}" for f in files if f and not Path(str(f)).expanduser().exists()]
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    import warnings

    # verl announces every optional training engine it cannot import (megatron, torchtitan, ...);
    # irrelevant to composing a config, and they would bury the one line that matters.
    warnings.filterwarnings("ignore", message=r".* engine is not available")
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        config, tailsieve, plans = dry_run(argv)
    except TailSieveError as e:
        print(f"tailsieve dry run: error: {e}", file=sys.stderr)
        return 2
    print(render(config, plans), end="")
    for item in missing_data_files(config):
        print(f"# note: {item} does not exist yet; a real run needs it (scripts/prepare_data.py)")
    if tailsieve.active:
        state = "active"
    elif config.trainer.v1.trainer_mode != "tailsieve":
        state = "off: stock verl (its own trainer and per-sample router)"
    else:
        state = ("off: (q, m) = (0, 0) on TailSieve's code path, "
                 + ("uniform group routing" if tailsieve.group_atomic else "stock verl's per-sample routing"))
    print(f"# dry run ok: trainer_mode={config.trainer.v1.trainer_mode}, tailsieve {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
