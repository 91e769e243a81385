"""verl plugin entry point (``verl.plugins: tailsieve = tailsieve_verl.integration.plugin``).

``import verl`` loads this module in every process (driver, TaskRunner, Ray workers) and swallows
plugin errors at DEBUG level; this module logs them at ERROR first, so a broken install reads as
"tailsieve-verl plugin failed to load: ..." instead of a later "Unknown trainer 'tailsieve'".

Registers: the ``tailsieve`` V1 trainer mode, the ``tailsieve_sim`` rollout replica type and the
``tailsieve_agent`` agent loop.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("tailsieve_verl")


def _load_sim_replica():
    from tailsieve_verl.integration.sim_backend import sim_replica_class

    return sim_replica_class()


def register() -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from tailsieve_verl.integration import agent_loop  # noqa: F401  (registers agent loop "tailsieve_agent")
    from tailsieve_verl.integration import trainer  # noqa: F401  (registers trainer mode "tailsieve")
    from tailsieve_verl.integration.config import SIM_ROLLOUT_NAME

    RolloutReplicaRegistry.register(SIM_ROLLOUT_NAME, _load_sim_replica)


try:
    register()
except Exception as exc:  # re-raised: verl then records it at DEBUG, we already said it loudly
    logger.error("tailsieve-verl plugin failed to load (trainer.v1.trainer_mode=tailsieve and "
                 "rollout.name=tailsieve_sim are unavailable): %r", exc, exc_info=True)
    raise
