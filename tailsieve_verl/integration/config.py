"""TailSieve settings (the top-level ``tailsieve:`` section of a verl config) and their start-up
validation against the rest of a composed verl 0.9.1 config.

Why one validator: the trainer calls it in ``__init__`` (inside verl's TaskRunner, before any
worker, replica or router is launched) and ``TAILSIEVE_DRY_RUN=1`` calls it on a composed config
without Ray, so both report the same single :class:`TailSieveConfigError` line for a bad setting.

Activation (see ``tailsieve_verl/config/tailsieve_trainer.yaml`` for the full list)::

    trainer.v1.trainer_mode=tailsieve     # the adaptive controller, started at one shared pool

``tailsieve.enable=false`` (or ``mode=disabled``) runs the very same trainer with (q, m) = (0, 0):
every sample goes to the one pool spanning all replicas, routed as stock verl routes it, nothing is
aborted or carried — the same-path control, which isolates the plugin's overhead from stock verl.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from tailsieve_verl.core.engine.engine import EngineConfigError, SpeculativeConfig, parse_spec_schedule
from tailsieve_verl.core.errors import TailSieveError
from tailsieve_verl.core.engine.perf import DEFAULT_PERF_MODEL, PerfModel, parse_perf_model

TRAINER_MODE = "tailsieve"
SIM_ROLLOUT_NAME = "tailsieve_sim"
# Backends whose server can abort single prompt groups without pausing the engine (abort_groups):
# verl's vLLM server through TailSieve's subclass (integration.vllm_server) and the simulated backend.
ABORT_CAPABLE_ROLLOUTS = ("vllm", SIM_ROLLOUT_NAME)
MODES = ("adaptive", "fixed", "disabled")
MODE_ALIASES = {"uniform": "disabled"}  # tailsieve.mode's old spelling, still accepted (docs/usage.md)
MISMATCH_POLICIES = ("stop", "keep_carried", "drop_carried")  # tailsieve.on_checkpoint_mismatch
REFUSAL_POLICIES = ("stop", "skip")  # tailsieve.on_refused_request
STOCK_MODE_SETTINGS = {"stop"}  # the only tailsieve.* setting that acts in verl's own trainer modes
AGENT_LOOP = "tailsieve_agent"  # integration.agent_loop registers it under this name
# Where wire_agent_loop records the agent loop the wrapper runs for rows that name none of their own
# (the user's actor_rollout_ref.rollout.agent.default_agent_loop): a key of RolloutConfig's free-form
# ``custom`` field, so every agent-loop worker receives it with the rollout config.
INNER_AGENT_LOOP_KEY = "tailsieve_inner_agent_loop"


class TailSieveConfigError(TailSieveError):
    """A TailSieve setting is invalid or inconsistent with the verl config it runs in."""


@dataclass(frozen=True)
class PoolEngineConfig:
    """vLLM settings applied to the replicas of one pool (route specialisation).

    ``None`` keeps what ``actor_rollout_ref.rollout`` / ``actor_rollout_ref.model.mtp`` say.
    """

    max_num_seqs: int | None = None
    mtp_enable: bool | None = None
    num_speculative_tokens: int | None = None  # 0: no speculation in this pool
    spec_schedule: Any = None  # vLLM's dynamic SD in this pool: "1-64:3,65-128:1" or [[1, 64, 3], [65, 128, 1]]
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def schedule(self) -> tuple[tuple[int, int, int], ...]:
        """``spec_schedule`` as (b_lo, b_hi, k) entries (checked by :func:`parse_tailsieve_section`)."""
        return parse_spec_schedule(self.spec_schedule) if self.spec_schedule is not None else ()

    def depth(self) -> int | None:
        """The pool's k: ``num_speculative_tokens``, else the schedule's deepest k (None: verl's own)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        schedule = self.schedule()
        return max(k for _, _, k in schedule) if schedule else None

    def wants_speculation(self) -> bool:
        return bool(self.mtp_enable) or (self.mtp_enable is None and bool(self.depth()))

    def is_default(self) -> bool:
        return self == PoolEngineConfig()


@dataclass(frozen=True)
class SimBackendConfig:
    """The simulated rollout backend (``actor_rollout_ref.rollout.name=tailsieve_sim``).

    Decode steps take ``perf_model.step_time(active, context) * time_scale`` wall seconds, so a
    CPU dry run of an hour-long H200 rollout takes ``time_scale`` hours. Response lengths come from
    a deterministic per-prompt log-normal model (see ``integration.simulated_server.LengthModel``).
    """

    perf_model: str | None = None  # None: reuse tailsieve.perf_model
    time_scale: float = 1.0
    mean_response_len: float = 512.0
    prompt_sigma: float = 1.0  # spread of per-prompt mean lengths (log space): the prompt effect
    sample_sigma: float = 0.5  # spread of samples around their prompt's mean: the sampling effect
    seed: int = 0
    # The engine's own request validation: a longer prompt is refused with vLLM's VLLMValidationError,
    # the explicit refusal tailsieve.on_refused_request acts on (None: the engine refuses nothing).
    max_prompt_tokens: int | None = None


@dataclass(frozen=True)
class TailSieveConfig:
    """Every TailSieve setting. Its defaults are the shipped ``tailsieve_trainer.yaml``'s, so that
    ``trainer.v1.trainer_mode=tailsieve`` alone runs the adaptive controller every measured result describes:
    started at one shared pool, (q, m) = (0, 0)."""

    enable: bool = True
    mode: str = "adaptive"  # adaptive: controller moves (q, m); fixed: tail_replicas pinned, q still adapts
    q0: int = 0  # tail groups at the first step (adaptive mode starts here)
    tail_replicas: int = 0  # m0: replicas in the tail pool at the first step (0: one shared pool)
    perf_model: str = DEFAULT_PERF_MODEL  # concurrency-throughput model used by the controller
    controller: Mapping[str, Any] = field(default_factory=dict)  # kwargs for core.tailsieve.controller
    tail: PoolEngineConfig = field(default_factory=PoolEngineConfig)
    bulk: PoolEngineConfig = field(default_factory=PoolEngineConfig)
    sim: SimBackendConfig = field(default_factory=SimBackendConfig)
    drain_timeout_s: float = 30.0  # the step waits this long after the abort for aborted groups to settle, no longer
    # A replica with requests in flight that generates no token for this long is stuck: the step stops,
    # naming it (a healthy step may run as long as it needs; only a lack of progress ends it).
    stall_timeout_s: float = 300.0
    # Time limit of every engine call the trainer makes (per-group abort, liveness probe, verl's sleep,
    # the weight update); a replica that does not answer within it stops the run, named.
    engine_call_timeout_s: float = 600.0
    poll_interval_s: float = 0.05  # TransferQueue status polling while a step waits for its cutoff
    # How often a step checks whether its last groups have finished, once nothing is left to cut off:
    # None is stock verl's own replay-buffer poll (2 s in verl 0.9.1), so that timing_s/gen of a TailSieve
    # or same-path arm is quantised exactly as the stock arm's is; lower it only where no A/B is measured.
    step_end_poll_s: float | None = None
    log_bias: bool = True  # length-bias monitor metrics
    # Warn when the length-bias KS exceeds its noise level this many steps in a row (0: never warn).
    bias_warning_steps: int = 5
    # Pools route whole groups (all n samples on one replica, the paper's setting; for prefix-cache-heavy
    # prompts) instead of each sample to the pool's least-loaded replica, as stock verl routes.
    group_atomic: bool = False
    # Abort only for the share of fresh prompts the per-prompt length record cannot predict (after the
    # first epoch the record names the tail at the step's start; core.tailsieve.cycle.TailSieveCycle).
    record_replaces_aborts: bool = False
    # Keep the tail pool on one Ray node (the one holding the most single-node replicas; m capped there);
    # by default it takes single-node replicas first and may cross nodes (core.routing.placement).
    tail_on_one_node: bool = False
    # Stop strings added to every rollout request (verl 0.9.1 has no rollout option for them and
    # vLLM ignores engine defaults when a request brings its own sampling params), e.g. ['<END>'].
    stop: tuple[str, ...] = ()
    # A resumed tailsieve.pt that is unreadable or from another run shape: stop (default), keep_carried
    # (train its carried prompts once anyway) or drop_carried (go on without them); integration.checkpoint.
    on_checkpoint_mismatch: str = "stop"
    # A request the engine refuses (e.g. a prompt longer than max_model_len): stop (default, naming the
    # prompt and the engine's reason) or skip (drop the group, counted, and train a fresh prompt instead).
    on_refused_request: str = "stop"

    @property
    def active(self) -> bool:
        """False means the same-path boundary: (q, m) = (0, 0) on the same code path."""
        return self.enable and self.mode != "disabled"

    @property
    def initial_q(self) -> int:
        return self.q0 if self.active else 0

    @property
    def initial_m(self) -> int:
        return self.tail_replicas if self.active else 0

    def controller_config(self):
        """The core controller's config: q0/tail_replicas seed it, ``mode=fixed`` (or per-pool engine
        settings, which are fixed at engine launch) pins the split, ``tailsieve.controller`` adds the rest."""
        from tailsieve_verl.core.tailsieve.controller import ControllerConfig

        known = {f.name for f in dataclasses.fields(ControllerConfig)}
        reserved = {"q_init", "m_init", "fixed_tail_replicas"}
        bad = sorted(set(self.controller) - (known - reserved))
        if bad:
            raise TailSieveConfigError(
                f"unknown or reserved tailsieve.controller key(s) {', '.join(bad)}; set q0 / tail_replicas / mode "
                f"instead of {', '.join(sorted(reserved))}; known: {', '.join(sorted(known - reserved))}"
            )
        kwargs = dict(self.controller)
        return ControllerConfig(q_init=self.q0, m_init=self.tail_replicas,
                                fixed_tail_replicas=self.tail_replicas if self.pins_split else None, **kwargs)

    @property
    def pins_split(self) -> bool:
        """``mode=fixed``, or per-pool engine settings (fixed at engine launch): m stays ``tail_replicas``."""
        return self.mode == "fixed" or not (self.tail.is_default() and self.bulk.is_default())

    def perf(self) -> PerfModel:
        return parse_perf_model(self.perf_model)

    def sim_perf(self) -> PerfModel:
        return parse_perf_model(self.sim.perf_model or self.perf_model)


def _section_to_dict(section: Any, where: str) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    if section is None:
        return {}
    if isinstance(section, DictConfig):
        section = OmegaConf.to_container(section, resolve=True)
    if not isinstance(section, Mapping):
        raise TailSieveConfigError(f"{where} must be a mapping, got {type(section).__name__}: {section!r}")
    return dict(section)


def _build(cls: type, values: Mapping[str, Any], where: str, nested: Mapping[str, type] | None = None):
    nested = nested or {}
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise TailSieveConfigError(
            f"unknown setting(s) {', '.join(f'{where}.{k}' for k in unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if name in nested:
            kwargs[name] = _build(nested[name], _section_to_dict(value, f"{where}.{name}"), f"{where}.{name}")
        elif name in ("controller", "engine_kwargs"):
            kwargs[name] = _section_to_dict(value, f"{where}.{name}")
        elif name == "stop":
            kwargs[name] = _string_list(value, f"{where}.{name}")
        else:
            kwargs[name] = value
    return cls(**kwargs)


def _string_list(value: Any, where: str) -> tuple[str, ...]:
    from omegaconf import ListConfig, OmegaConf

    if isinstance(value, ListConfig):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise TailSieveConfigError(f"{where} must be a list of non-empty strings, e.g. '[\"<END>\"]', got {value!r}")
    return tuple(value)


def parse_tailsieve_section(section: Any) -> TailSieveConfig:
    """Build a :class:`TailSieveConfig` from the ``tailsieve:`` section (mapping or DictConfig);
    types and ranges are checked, cross-checks with verl's settings are in :func:`validate_verl_config`."""
    values = _section_to_dict(section, "tailsieve")
    if isinstance(values.get("mode"), str):
        values["mode"] = MODE_ALIASES.get(values["mode"], values["mode"])
    cfg = _build(TailSieveConfig, values, "tailsieve", {"tail": PoolEngineConfig, "bulk": PoolEngineConfig, "sim": SimBackendConfig})
    _check_types(cfg)
    return cfg


def _check_int(value: Any, where: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TailSieveConfigError(f"{where} must be an integer >= {minimum}, got {value!r}")


def _check_positive(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TailSieveConfigError(f"{where} must be a number > 0, got {value!r}")


def _check_types(cfg: TailSieveConfig) -> None:
    for name in ("enable", "tail_on_one_node", "record_replaces_aborts"):
        if not isinstance(getattr(cfg, name), bool):
            raise TailSieveConfigError(f"tailsieve.{name} must be true or false, got {getattr(cfg, name)!r}")
    if cfg.mode not in MODES:
        raise TailSieveConfigError(f"tailsieve.mode must be one of {', '.join(MODES)}, got {cfg.mode!r}")
    for name, allowed in (("on_checkpoint_mismatch", MISMATCH_POLICIES), ("on_refused_request", REFUSAL_POLICIES)):
        if getattr(cfg, name) not in allowed:
            raise TailSieveConfigError(f"tailsieve.{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
    _check_int(cfg.q0, "tailsieve.q0", 0)
    _check_int(cfg.tail_replicas, "tailsieve.tail_replicas", 0)
    for name in ("drain_timeout_s", "stall_timeout_s", "engine_call_timeout_s"):
        _check_positive(getattr(cfg, name), f"tailsieve.{name}")
    _check_int(cfg.bias_warning_steps, "tailsieve.bias_warning_steps", 0)
    _check_positive(cfg.poll_interval_s, "tailsieve.poll_interval_s")
    if cfg.step_end_poll_s is not None:
        _check_positive(cfg.step_end_poll_s, "tailsieve.step_end_poll_s")
    for pool in ("tail", "bulk"):
        pool_cfg: PoolEngineConfig = getattr(cfg, pool)
        if pool_cfg.max_num_seqs is not None:
            _check_int(pool_cfg.max_num_seqs, f"tailsieve.{pool}.max_num_seqs", 1)
        if pool_cfg.num_speculative_tokens is not None:
            _check_int(pool_cfg.num_speculative_tokens, f"tailsieve.{pool}.num_speculative_tokens", 0)
        if pool_cfg.mtp_enable is not None and not isinstance(pool_cfg.mtp_enable, bool):
            raise TailSieveConfigError(f"tailsieve.{pool}.mtp_enable must be true, false or null")
        if pool_cfg.spec_schedule is not None:
            _check_schedule(pool_cfg, f"tailsieve.{pool}")
    _check_positive(cfg.sim.time_scale, "tailsieve.sim.time_scale")
    _check_positive(cfg.sim.mean_response_len, "tailsieve.sim.mean_response_len")
    if cfg.sim.max_prompt_tokens is not None:
        _check_int(cfg.sim.max_prompt_tokens, "tailsieve.sim.max_prompt_tokens", 1)
    for name in ("prompt_sigma", "sample_sigma"):
        value = getattr(cfg.sim, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise TailSieveConfigError(f"tailsieve.sim.{name} must be a number >= 0, got {value!r}")
    for where, spec in (("tailsieve.perf_model", cfg.perf_model), ("tailsieve.sim.perf_model", cfg.sim.perf_model)):
        if spec is not None:
            try:
                parse_perf_model(spec)
            except TailSieveError as exc:
                raise TailSieveConfigError(f"{where}: {exc}") from None


def _check_schedule(pool: PoolEngineConfig, where: str) -> None:
    """A pool's ``spec_schedule`` in vLLM's rules (starts at batch 1, increasing ranges, k within the
    pool's ``num_speculative_tokens``), with something to speculate."""
    try:
        schedule = parse_spec_schedule(pool.spec_schedule)
    except EngineConfigError as exc:
        raise TailSieveConfigError(f"{where}.spec_schedule: {exc}") from None
    deepest = max(k for _, _, k in schedule)
    if pool.num_speculative_tokens == 0 or pool.mtp_enable is False or deepest == 0:
        raise TailSieveConfigError(f"{where}.spec_schedule is set but the pool does not speculate ({where}."
                                   f"num_speculative_tokens={pool.num_speculative_tokens}, mtp_enable={pool.mtp_enable}, "
                                   f"deepest k {deepest}): drop the schedule or give it a k > 0")
    try:
        SpeculativeConfig(pool.depth(), (1.0,), schedule)
    except EngineConfigError as exc:
        raise TailSieveConfigError(f"{where}.spec_schedule: {exc}") from None


def _select(config: Any, path: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, path, default=default)
    return default if value is None else value


def gpus_per_replica(config: Any) -> int:
    """GPUs one rollout replica takes: ``tp · dp · pp``."""
    per_replica = 1
    for key in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        per_replica *= int(_select(config, f"actor_rollout_ref.rollout.{key}", 1))
    return per_replica


def rollout_replica_count(config: Any) -> int:
    """Replicas verl's LLMServerManager will launch in the hybrid (sync) layout:
    ``n_gpus_per_node · nnodes // (tp · dp · pp)``, as in ``LLMServerManager._initialize_llm_servers``."""
    world = int(_select(config, "trainer.n_gpus_per_node", 1)) * int(_select(config, "trainer.nnodes", 1))
    return world // gpus_per_replica(config)


def _check_tail_fits_one_node(config: Any, cfg: TailSieveConfig) -> None:
    """``tail_on_one_node``: a replica must fit on a node, and a pinned tail on one node's replicas."""
    gpus = int(_select(config, "trainer.n_gpus_per_node", 1))
    per_replica = gpus_per_replica(config)
    per_node = gpus // per_replica
    if per_node < 1:
        raise TailSieveConfigError(
            f"tailsieve.tail_on_one_node=true, but each rollout replica needs {per_replica} GPUs (tp x dp x pp) and "
            f"spans nodes of trainer.n_gpus_per_node={gpus}; lower the rollout parallel sizes or set "
            f"tailsieve.tail_on_one_node=false")
    if cfg.pins_split and cfg.tail_replicas > per_node:
        raise TailSieveConfigError(
            f"tailsieve.tail_replicas={cfg.tail_replicas} with tailsieve.tail_on_one_node=true, but a node holds "
            f"{per_node} rollout replicas; set tailsieve.tail_replicas<={per_node} or tailsieve.tail_on_one_node=false")


def validate_verl_config(config: Any) -> TailSieveConfig:
    """Check a composed verl config (DictConfig) for TailSieve and return its settings.

    Raises :class:`TailSieveConfigError` with one message saying what is wrong and how to fix it.
    Starts nothing (no Ray, no workers) so it is safe for dry runs and for the trainer's __init__.
    """
    mode = _select(config, "trainer.v1.trainer_mode")
    section = _select(config, "tailsieve")
    if not bool(_select(config, "trainer.use_v1", True)):
        raise TailSieveConfigError(
            "TailSieve runs on verl's V1 trainer only; the legacy RayPPOTrainer (trainer.use_v1=false) "
            "is unsupported: set trainer.use_v1=true"
        )
    if mode != TRAINER_MODE:
        ignored = sorted(set(section or {}) - STOCK_MODE_SETTINGS)
        if ignored:
            raise TailSieveConfigError(
                f"{', '.join(f'tailsieve.{k}' for k in ignored)} would be ignored: trainer.v1.trainer_mode is "
                f"{mode!r}, and only tailsieve.stop acts outside the TailSieve trainer; set "
                f"trainer.v1.trainer_mode={TRAINER_MODE} to use TailSieve, or remove the setting(s)")
        # Stock verl with stop strings: the tailsieve_agent wrapper adds them (wire_agent_loop), nothing else runs.
        return dataclasses.replace(parse_tailsieve_section(section), enable=False)
    cfg = parse_tailsieve_section(section)

    batch = int(_select(config, "data.train_batch_size", 0))
    if batch < 1:
        raise TailSieveConfigError(f"data.train_batch_size must be >= 1, got {batch}")
    replicas = rollout_replica_count(config)
    rollout_name = _select(config, "actor_rollout_ref.rollout.name")
    if rollout_name not in ABORT_CAPABLE_ROLLOUTS:
        raise TailSieveConfigError(
            f"actor_rollout_ref.rollout.name={rollout_name!r} cannot abort single prompt groups, which TailSieve "
            f"needs to cut the bulk pool at B - q finished groups; use one of {', '.join(ABORT_CAPABLE_ROLLOUTS)}"
        )
    if bool(_select(config, "actor_rollout_ref.rollout.disaggregation.enabled", False)):
        raise TailSieveConfigError(
            "actor_rollout_ref.rollout.disaggregation.enabled=true is unsupported by TailSieve "
            "(pools are whole replicas); disable prefill/decode disaggregation"
        )
    if bool(_select(config, "algorithm.filter_groups.enable", False)):
        raise TailSieveConfigError(
            "algorithm.filter_groups (DAPO dynamic sampling) is unsupported with TailSieve: both decide which "
            "groups a step consumes; disable one of them"
        )
    sampler = _select(config, "trainer.v1.sampler.custom_sampler", {})
    if sampler.get("path") and sampler.get("name"):
        raise TailSieveConfigError(
            f"trainer.v1.sampler.custom_sampler ({sampler.get('path')}:{sampler.get('name')}) would be replaced: the "
            f"TailSieve trainer picks each step's groups itself; unset it, or train with it in stock verl "
            f"(trainer.v1.trainer_mode=sync)"
        )
    if bool(_select(config, "skip.rollout_tq.enable", False)):
        raise TailSieveConfigError(
            "skip.rollout_tq.enable=true would be ignored: verl's rollout skip replays stock sync's submit and sample "
            "calls, which the TailSieve step replaces; disable it, or use it in stock verl (trainer.v1.trainer_mode=sync)")
    if int(_select(config, "trainer.v1.tailsieve.parameter_sync_step", 1)) != 1:
        raise TailSieveConfigError("trainer.v1.tailsieve.parameter_sync_step must be 1: TailSieve is synchronous")
    _refuse_ignored_settings(cfg, rollout_name)
    if cfg.active:
        if cfg.q0 >= batch:
            raise TailSieveConfigError(
                f"tailsieve.q0={cfg.q0} must be < data.train_batch_size={batch}: the bulk pool must finish "
                f"at least one fresh group per step"
            )
        if replicas < 2:
            raise TailSieveConfigError(
                f"TailSieve needs at least 2 rollout replicas (one tail, one bulk), but this config launches "
                f"{replicas} (trainer.n_gpus_per_node x trainer.nnodes / rollout tp x dp x pp); add GPUs, lower "
                f"the rollout parallel sizes, or set tailsieve.enable=false"
            )
        if cfg.pins_split and not 1 <= cfg.tail_replicas < replicas:
            why = "tailsieve.mode=fixed" if cfg.mode == "fixed" else "per-pool engine settings (tailsieve.tail/bulk)"
            raise TailSieveConfigError(
                f"tailsieve.tail_replicas={cfg.tail_replicas} must be in [1, {replicas - 1}] with {why}, which pin "
                f"the split: the tail and bulk pools each need at least one of the {replicas} rollout replicas (one "
                f"shared pool is tailsieve.mode=adaptive with tail_replicas=0, or tailsieve.enable=false)"
            )
        if not 0 <= cfg.tail_replicas < replicas:
            raise TailSieveConfigError(
                f"tailsieve.tail_replicas={cfg.tail_replicas} must be in [0, {replicas - 1}]: the bulk pool needs at "
                f"least one of the {replicas} rollout replicas (0 starts the controller at one shared pool)"
            )
        if cfg.tail_replicas == 0 and cfg.q0 > 0:
            raise TailSieveConfigError(
                f"tailsieve.q0={cfg.q0} with tailsieve.tail_replicas=0: one shared pool carries no groups, so the "
                f"controller starts at (q, m) = (0, 0) and q0 would be ignored; set tailsieve.q0=0, or "
                f"tailsieve.tail_replicas>=1 to start with a tail pool"
            )
        if max(cfg.q0, 1) < cfg.tail_replicas:  # q0=0 starts the controller at q=1
            raise TailSieveConfigError(
                f"tailsieve.q0={cfg.q0} is below tailsieve.tail_replicas={cfg.tail_replicas}: each tail replica needs "
                f"at least one carried group per step (q >= m), or it idles; set tailsieve.q0>={cfg.tail_replicas} "
                f"or tailsieve.tail_replicas<={max(cfg.q0, 1)}"
            )
        if cfg.tail_on_one_node:
            _check_tail_fits_one_node(config, cfg)
        try:
            cfg.controller_config().validate(replicas, batch)
        except (TypeError, TailSieveError) as exc:
            if isinstance(exc, TailSieveConfigError):
                raise
            raise TailSieveConfigError(f"tailsieve.controller: {exc}") from None
    for pool in ("tail", "bulk"):
        pool_cfg: PoolEngineConfig = getattr(cfg, pool)
        if pool_cfg.num_speculative_tokens and pool_cfg.mtp_enable is False:
            raise TailSieveConfigError(
                f"tailsieve.{pool}.num_speculative_tokens is set but tailsieve.{pool}.mtp_enable=false"
            )
        if pool_cfg.wants_speculation() and not bool(_select(config, "actor_rollout_ref.model.mtp.enable", False)):
            raise TailSieveConfigError(
                f"tailsieve.{pool} asks for MTP speculative decoding, but the model's MTP head is not loaded: set "
                f"actor_rollout_ref.model.mtp.enable=true (the rollout-side switch stays per pool)"
            )
    return cfg


def _refuse_ignored_settings(cfg: TailSieveConfig, rollout_name: str) -> None:
    """A setting the TailSieve trainer would not act on in this configuration stops the launch."""
    if not cfg.active:
        defaults = TailSieveConfig()
        ignored = [f"tailsieve.{name}" for name in ("q0", "tail_replicas", "controller", "tail", "bulk",
                                                    "record_replaces_aborts")
                   if getattr(cfg, name) != getattr(defaults, name)]
        if not cfg.enable and cfg.mode == "fixed":
            ignored.append("tailsieve.mode=fixed")
        if ignored:
            raise TailSieveConfigError(
                f"{', '.join(ignored)} would be ignored: with tailsieve.enable=false or tailsieve.mode=disabled the "
                f"trainer runs (q, m) = (0, 0) on one pool of every replica; remove them, or turn TailSieve on "
                f"(tailsieve.enable=true with mode adaptive or fixed)")
    if rollout_name != SIM_ROLLOUT_NAME and cfg.sim != SimBackendConfig():
        raise TailSieveConfigError(
            f"tailsieve.sim.* would be ignored: it configures the simulated replicas "
            f"(actor_rollout_ref.rollout.name={SIM_ROLLOUT_NAME}), and this run's rollout is {rollout_name!r}; "
            f"remove the tailsieve.sim settings")


def router_config_path() -> str:
    """Absolute path of the shipped router yaml (verl resolves it in the trainer process only)."""
    from importlib.resources import files

    return str(files("tailsieve_verl.config") / "router.yaml")


def wire_verl_config(config: Any) -> TailSieveConfig:
    """Validate, then wire what the launch needs, in place, before verl launches any worker: the
    agent-loop wrapper (:func:`wire_agent_loop`, every trainer mode) and, in the TailSieve trainer,
    TailSieve's router and the settings for the rollout replicas (``actor_rollout_ref.rollout.custom.
    tailsieve``). Called by the plugin's launch check in the driver, by the dry run and by the trainer
    in ``__init__``; idempotent. Refuses to replace a user's own router."""
    from omegaconf import OmegaConf, open_dict

    cfg = validate_verl_config(config)
    wire_agent_loop(config, cfg)
    if _select(config, "trainer.v1.trainer_mode") != TRAINER_MODE:
        return cfg
    router_yaml = router_config_path()
    rollout = config.actor_rollout_ref.rollout
    router = OmegaConf.select(rollout, "router_config_path")
    if router not in (None, router_yaml):
        raise TailSieveConfigError(
            f"actor_rollout_ref.rollout.router_config_path={router!r}: TailSieve routes groups to pools with its own "
            f"router; remove this override"
        )
    section = _section_to_dict(OmegaConf.select(config, "tailsieve"), "tailsieve")
    with open_dict(config):
        rollout.router_config_path = router_yaml
        if OmegaConf.select(rollout, "custom") is None:
            rollout.custom = {}
        rollout.custom.tailsieve = section
    return cfg


def wire_agent_loop(config: Any, cfg: TailSieveConfig) -> None:
    """Put the ``tailsieve_agent`` wrapper around the agent loop of every row that names none of its
    own, in training and validation alike, whenever it has work: the TailSieve trainer (group tags,
    abort bookkeeping), or stop strings in any trainer mode (verl 0.9.1 has no rollout option for
    them). The user's ``default_agent_loop`` moves to ``rollout.custom.tailsieve_inner_agent_loop``,
    which the wrapper runs, and ``default_agent_loop`` becomes the wrapper. So a stock-verl baseline
    and a TailSieve run with the same overrides sample with the same stop strings, validation included."""
    from omegaconf import OmegaConf, open_dict

    if not cfg.stop and _select(config, "trainer.v1.trainer_mode") != TRAINER_MODE:
        return
    rollout = config.actor_rollout_ref.rollout
    current = OmegaConf.select(rollout, "agent.default_agent_loop")
    inner = OmegaConf.select(rollout, f"custom.{INNER_AGENT_LOOP_KEY}")
    if current == AGENT_LOOP:
        if inner is None:
            raise TailSieveConfigError(
                f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_LOOP}: the plugin puts its wrapper in "
                f"place itself; set default_agent_loop to the agent loop it should wrap (verl's default: "
                f"single_turn_agent) or drop the override")
        return  # wired already
    with open_dict(config):
        if OmegaConf.select(rollout, "custom") is None:
            rollout.custom = {}
        rollout.custom[INNER_AGENT_LOOP_KEY] = current
        rollout.agent.default_agent_loop = AGENT_LOOP
