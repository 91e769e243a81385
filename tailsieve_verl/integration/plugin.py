"""verl plugin entry point (``verl.plugins: tailsieve = tailsieve_verl.integration.plugin``).

``import verl`` loads this module in every process (driver, TaskRunner, Ray workers) and swallows
plugin errors at DEBUG level; this module logs them at ERROR first, so a broken install reads as
"tailsieve-verl plugin failed to load: ..." instead of a later "Unknown trainer 'tailsieve'".

Registers: the ``tailsieve`` V1 trainer mode, the ``tailsieve_sim`` rollout replica type and the
``tailsieve_agent`` agent loop. Two start-up checks run in the launching process, before verl's own:

* a ``tailsieve.*`` command-line override that Hydra cannot parse (an unquoted spec such as
  ``tailsieve.perf_model=linear:a=0.1,c=0.2``) stops with one line naming it and its quoting,
  instead of Hydra's parse error that names neither;
* ``verl.utils.config.validate_config`` (which ``verl.trainer.main_ppo`` calls in the driver
  before Ray starts, in every trainer mode) checks the TailSieve settings first, so a bad one — or
  one that would be ignored, e.g. ``+tailsieve.q0`` on a stock ``sync`` run — stops with its one line
  before verl prints "All configuration checks passed successfully!"; it then wires the launch
  (``integration.config.wire_verl_config``: the agent-loop wrapper for stop strings, the router),
  the same function the dry run calls, so the dry run and the launch agree.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
from typing import Sequence

logger = logging.getLogger("tailsieve_verl")

_TAILSIEVE_OVERRIDE = re.compile(r"^[+~]{0,2}tailsieve\.[\w.]+=")


def bad_tailsieve_override(argv: Sequence[str]) -> str | None:
    """The error line for the first ``tailsieve.*`` override in ``argv`` that Hydra cannot parse."""
    candidates = [arg for arg in argv if _TAILSIEVE_OVERRIDE.match(arg)]
    if not candidates:
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in candidates:
        try:
            parser.parse_override(arg)
        except Exception as exc:  # hydra's OverrideParseException (and whatever its grammar raises)
            key, _, value = arg.partition("=")
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return (f"tailsieve: error: Hydra cannot parse the override {arg!r} ({reason}); quote the value for Hydra "
                    f"inside the shell quotes: \"{key}='{value}'\"")
    return None


def _validate_tailsieve_first() -> None:
    """Wrap verl's ``validate_config`` so that the TailSieve settings are checked before verl's."""
    import verl.utils.config as verl_config

    original = verl_config.validate_config
    if getattr(original, "tailsieve_first", False):
        return

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        from omegaconf import OmegaConf

        from tailsieve_verl.core.errors import TailSieveError
        from tailsieve_verl.integration.config import TRAINER_MODE, wire_verl_config

        mode = OmegaConf.select(config, "trainer.v1.trainer_mode", default=None)
        if mode == TRAINER_MODE or OmegaConf.select(config, "tailsieve", default=None) is not None:
            try:
                wire_verl_config(config)  # in place: main_ppo hands this very config to its TaskRunner
            except TailSieveError as exc:
                print(f"tailsieve: error: {exc}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
        return original(config, *args, **kwargs)

    validate_config.tailsieve_first = True
    verl_config.validate_config = validate_config
    main_ppo = sys.modules.get("verl.trainer.main_ppo")  # imported before the plugin: patch its name too
    if main_ppo is not None and getattr(main_ppo, "validate_config", None) is original:
        main_ppo.validate_config = validate_config


def _load_sim_replica():
    from tailsieve_verl.integration.simulated_server import sim_replica_class

    return sim_replica_class()


def register() -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from tailsieve_verl.integration import agent_loop  # noqa: F401  (registers agent loop "tailsieve_agent")
    from tailsieve_verl.integration import trainer  # noqa: F401  (registers trainer mode "tailsieve")
    from tailsieve_verl.integration.config import SIM_ROLLOUT_NAME

    RolloutReplicaRegistry.register(SIM_ROLLOUT_NAME, _load_sim_replica)
    _validate_tailsieve_first()


_message = bad_tailsieve_override(sys.argv[1:])
if _message:  # Hydra would stop on it right after, without naming it
    print(_message, file=sys.stderr, flush=True)
    raise SystemExit(2)

try:
    register()
except Exception as exc:  # re-raised: verl then records it at DEBUG, we already said it loudly
    logger.error("tailsieve-verl plugin failed to load (trainer.v1.trainer_mode=tailsieve and "
                 "rollout.name=tailsieve_sim are unavailable): %r", exc, exc_info=True)
    raise
