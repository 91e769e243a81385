"""The verl internals TailSieve relies on, checked at trainer start-up.

TailSieve plugs into verl 0.9.1 through public hooks where verl has them — the ``verl.plugins``
entry point, ``@register_trainer``, ``RolloutReplicaRegistry``, the agent-loop ``@register``, the
router plugin (``router_config_path``), ``LLMServerManager.get_client(client_cls=...)`` and the
trainer's ``prepare_step`` / ``on_*`` callbacks. For the rest verl 0.9.1 has no public hook:

* the replay buffer: ``trainer.v1.sampler.custom_sampler`` builds a user class from config without
  a handle on the trainer, so ``PPOTrainer._build_replay_buffer`` is overridden, and the TailSieve
  buffer uses ``ReplayBuffer._materialize_batch`` / ``_sync_metadata_from_transfer_queue`` to hand
  verl exactly the selected groups;
* the step: ``PPOTrainer._step_once`` is wrapped to add the ``tailsieve/*`` metrics;
* the prompt stream: ``_next_train_batch`` / ``_submit_batch_to_rollout`` / ``_add_prompts_to_generate``;
* checkpoints: ``_save_checkpoint`` / ``_load_checkpoint`` are extended to save and restore
  ``tailsieve.pt`` (verl's ``checkpoint_callback_class`` is a single user slot, and it runs after
  the checkpoint is already marked latest);
* replica failure: ``CheckpointEngineManager.remove_replicas``.

A different verl may rename or re-sign any of them, and an override whose name no longer exists is
silently never called. :func:`check_verl_internals` inspects each one (existence and parameter names
with :func:`inspect.signature`) and raises :class:`VerlCompatibilityError` with one line naming the
first mismatch and the supported verl version.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from tailsieve_verl.core.errors import TailSieveError

SUPPORTED_VERL_VERSION = "0.9.1"


class VerlCompatibilityError(TailSieveError):
    """The installed verl lacks an internal TailSieve relies on (or it changed shape)."""


@dataclass(frozen=True)
class Internal:
    """``owner.name`` must exist; ``params`` are its leading parameter names (``positional``) or a
    subset of its parameter names (``keywords``: TailSieve passes them by name)."""

    owner: str  # "module:Class"
    name: str
    params: tuple[str, ...]
    use: str  # what TailSieve does with it
    keywords: bool = False

    def where(self) -> str:
        module, cls = self.owner.split(":")
        return f"{module}.{cls}.{self.name}"


_TRAINER = "verl.trainer.ppo.v1.trainer_base:PPOTrainer"
_BUFFER = "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer"

INTERNALS: tuple[Internal, ...] = (
    Internal(_TRAINER, "_build_replay_buffer", ("self",), "overridden: builds the TailSieve replay buffer"),
    Internal(_TRAINER, "_step_once", ("self", "metrics", "timing_raw", "sample_batch_size"),
             "wrapped: adds the tailsieve/* metrics"),
    Internal(_TRAINER, "_save_checkpoint", ("self",), "extended: writes tailsieve.pt"),
    Internal(_TRAINER, "_load_checkpoint", ("self",), "extended: restores tailsieve.pt"),
    Internal(_TRAINER, "_next_train_batch", ("self", "num_prompts"), "called: fresh prompts"),
    Internal(_TRAINER, "_submit_batch_to_rollout", ("self", "batch"), "called: dispatches prompt groups"),
    Internal(_TRAINER, "_add_prompts_to_generate", ("self", "num_prompts"), "passed as the buffer's refill_fn"),
    Internal(_TRAINER, "prepare_step", ("self",), "overridden: plans the TailSieve step"),
    Internal(_TRAINER, "on_train_begin", ("self",), "overridden: clears restored TransferQueue keys"),
    Internal(_TRAINER, "get_llm_client", ("self",), "overridden: group-tagged LLM client"),
    Internal("verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync", "on_step_end", ("self",),
             "extended: weight update, then resume the aborted replicas"),
    Internal("verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync", "on_sample_end", ("self",),
             "wrapped: a dead replica's error names it"),
    Internal(_BUFFER, "__init__", ("trainer_mode", "trainer_config", "max_off_policy_threshold",
                                   "max_off_policy_strategy", "sampler_kwargs", "poll_interval", "refill_fn",
                                   "train_batch_size", "gen_batch_size"),
             "constructed by TailSieve with these keywords", keywords=True),
    Internal(_BUFFER, "sample", ("self", "global_steps", "partition_id", "batch_size"),
             "overridden: runs the TailSieve rollout step"),
    Internal(_BUFFER, "_materialize_batch", ("self", "partition_id", "selected_prompt_uids", "partition_snapshot"),
             "called: hands verl the selected groups"),
    Internal(_BUFFER, "_sync_metadata_from_transfer_queue", ("self",), "called: reads TransferQueue metadata"),
    Internal("verl.workers.rollout.llm_server:LLMServerManager", "get_client", ("self", "client_cls"),
             "called: the group-tagged client class"),
    Internal("verl.workers.rollout.llm_server:LLMServerClient", "generate", ("self", "request_id", "prompt_ids",
                                                                            "sampling_params"),
             "overridden: tags requests with their group", keywords=True),
    Internal("verl.workers.rollout.llm_server:LLMServerClient", "_vllm_request_id", ("self", "request_id"),
             "overridden: keeps the group tag in the id the server sees (per-group abort)"),
    Internal("verl.checkpoint_engine.base:CheckpointEngineManager", "remove_replicas", ("self", "replicas"),
             "called: drops a dead replica from weight sync"),
)


def _mismatch(internal: Internal) -> str | None:
    """Why ``internal`` does not match the installed verl, or None."""
    module_name, cls_name = internal.owner.split(":")
    try:
        owner = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        return f"{module_name}.{cls_name} is missing ({exc.__class__.__name__})"
    member = vars(owner).get(internal.name)  # defined by that class itself, not inherited from elsewhere
    if member is None:
        return f"{internal.where()} is missing"
    func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return f"{internal.where()} has no inspectable signature"
    expected = list(internal.params)
    ok = set(expected) <= set(params) if internal.keywords else params[: len(expected)] == expected
    if not ok:
        return f"{internal.where()}({', '.join(params)}) does not take ({', '.join(expected)})"
    return None


def check_verl_internals(internals: tuple[Internal, ...] = INTERNALS) -> None:
    """Raise :class:`VerlCompatibilityError` (one line) if any internal TailSieve uses is missing or
    re-signed in the installed verl."""
    for internal in internals:
        why = _mismatch(internal)
        if why is not None:
            try:
                import verl

                installed = getattr(verl, "__version__", "unknown")
            except ImportError:
                installed = "not installed"
            raise VerlCompatibilityError(
                f"tailsieve-verl supports verl {SUPPORTED_VERL_VERSION} (installed: {installed}): {why} "
                f"(TailSieve {internal.use}); install verl=={SUPPORTED_VERL_VERSION}")
